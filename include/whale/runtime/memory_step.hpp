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
