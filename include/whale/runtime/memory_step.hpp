// The memory of executor<P> (runtime/executor.hpp): what its program predicts
// for real steps (plan/memory.hpp), and the two checks against the node's
// free memory (runtime/memory_check.hpp) — before the parameters are
// allocated, and before the first training step allocates its activations.
#pragma once

#include <sstream>
#include <string>

#include "whale/runtime/executor.hpp"
#include "whale/runtime/memory_check.hpp"

namespace whale {

template <class P>
lower_options executor<P>::step_lowering(index_t global_batch, index_t seq, int optimizer_bytes_per_param) const {
  lower_options lo;
  lo.global_batch = global_batch;
  lo.seq = seq;
  lo.micro_batches = o_.micro_batches;
  lo.stage_blocks = o_.blocks;
  lo.balance_seq = o_.balance_seq;
  lo.bucket_mib = o_.bucket_mib;
  lo.replica_weights = replica_weights_;
  lo.optimizer_bytes_per_param = optimizer_bytes_per_param;
  return lo;
}

template <class P>
memory_estimate executor<P>::predicted_memory(index_t global_batch, index_t seq, int optimizer_bytes_per_param) const {
  const auto prog = lower<P>(ctx_->mesh().shape(), ctx_->rank(), step_lowering(global_batch, seq, optimizer_bytes_per_param));
  return predict_memory(describe<P>(), prog, memory_options{o_.max_pending, o_.prefetch});
}

template <class P> void executor<P>::check_state_memory(const program_totals& held, index_t n) const {
  // Emulated per-rank memory (plan_options::memory_caps_mib): every rank learns every rank's
  // model state and cap, so that all of them fail with the same sentence, naming the first over.
  if (!o_.memory_caps_mib.empty()) {
    const int w = ctx_->size();
    double mine[2] = {static_cast<double>(held.param_bytes + held.grad_bytes + held.optimizer_bytes),
                      o_.memory_cap_of(ctx_->rank(), w) * 1048576.0};
    std::vector<double> all(static_cast<std::size_t>(2 * w));
    if (w > 1) all_gather(ctx_->world(), view<double>(mine, {2}), view<double>(all.data(), {2 * static_cast<index_t>(w)}));
    else all.assign(mine, mine + 2);
    for (int r = 0; r < w; ++r) {
      const double need = all[static_cast<std::size_t>(2 * r)], cap = all[static_cast<std::size_t>(2 * r + 1)];
      if (cap > 0 && need > cap)
        throw std::invalid_argument("whale::" + layer_name<P>() + ": rank " + std::to_string(r) + "'s memory cap (--memory-caps, "
                                    "WHALE_MEMORY_CAPS) is " + detail::mib_text(static_cast<std::int64_t>(cap)) +
                                    ", but its parameters, gradients and AdamW state need " +
                                    detail::mib_text(static_cast<std::int64_t>(need)) +
                                    "; give it fewer layers (a pipeline cuts by the caps), ZeRO, or a larger cap");
    }
  }
  const std::int64_t start = level == 3 ? 4 * static_cast<std::int64_t>(n) : 0;  // ZeRO-3 initialises the whole stage once
  detail::check_memory_fits(ctx_->world(), held.param_bytes + held.grad_bytes + start,
                            "its parameters (" + detail::mib_text(held.param_bytes) + ") and gradients (" +
                                detail::mib_text(held.grad_bytes) + ")",
                            "whale::" + layer_name<P>() + ": ", "spread the model over more ranks (split, pipeline, ZeRO-3) or more nodes");
}

template <class P> void executor<P>::check_step_memory(const step_ctx& c) const {
  const index_t global = c.seq > 0 ? c.global_rows / c.seq : c.global_rows;
  const auto e = predicted_memory(global, c.seq);
  std::ostringstream what;
  what << "the activations of its step (" << detail::mib_text(e.activations) << ": " << e.live_micro_batches
       << " micro-batch(es) of " << e.rows << " rows kept) and its communication buffers (" << detail::mib_text(e.comm) << ")";
  detail::check_memory_fits(ctx_->world(), e.activations + e.comm, what.str(), "whale::" + layer_name<P>() + ": ",
                            "use a smaller batch, more micro-batches" + std::string(staged ? " (fewer kept under 1f1b)" : "") +
                                ", recompute<Block>, or more ranks");
}

}  // namespace whale
