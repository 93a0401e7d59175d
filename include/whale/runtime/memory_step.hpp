// The memory of executor<P> (runtime/executor.hpp): what its program predicts
// for real steps (plan/memory.hpp), and the two checks against the node's
// free memory (runtime/memory_check.hpp) — before the parameters are
// allocated, and before the first training step allocates its activations.
#pragma once

#include <cmath>
#include <limits>
#include <sstream>
#include <vector>
#include <string>

#include "whale/runtime/executor.hpp"
#include "whale/runtime/memory_check.hpp"

namespace whale {

template <class P>
lower_options executor<P>::step_lowering(index_t global_batch, index_t seq, int optimizer_bytes_per_param) const {
  lower_options lo = lowering_of(o_, global_batch, seq);
  lo.replica_weights = replica_weights_;
  lo.optimizer_bytes_per_param = optimizer_bytes_per_param;
  return lo;
}

template <class P>
memory_estimate executor<P>::predicted_memory(index_t global_batch, index_t seq, int optimizer_bytes_per_param) const {
  const auto prog = lower<P>(ctx_->mesh().shape(), ctx_->rank(), step_lowering(global_batch, seq, optimizer_bytes_per_param));
  return predict_memory(describe<P>(), prog, memory_options{o_.max_pending, o_.prefetch});
}

template <class P> void executor<P>::fit_rows_to_caps() {
  const int w = ctx_->size();
  const index_t global = o_.plan_batch;
  const double cap = o_.memory_cap_of(ctx_->rank(), w) * 1048576.0;
  std::vector<double> speed = replica_weights_;  // by speed: 1 / the replica's slowest factor
  std::vector<char> fixed(static_cast<std::size_t>(d_), 0);
  // Activations grow with a replica's rows, the rest does not: each round gives every
  // replica over a cap the rows that fit and the others the rest by speed, until none is over.
  for (int round = 0; round <= d_; ++round) {
    const index_t rows = slice(global, replica_).second;
    const auto e = predicted_memory(global, o_.plan_seq);
    const double fixed_bytes = static_cast<double>(e.model_state() + e.comm), act = static_cast<double>(e.activations);
    double most = std::numeric_limits<double>::infinity();  // rows this rank can take within its cap
    if (cap > 0) most = act > 0 ? std::floor(static_cast<double>(rows) * (cap - fixed_bytes) / act) : most;
    std::vector<double> all(static_cast<std::size_t>(2 * w));
    double mine[2] = {most, static_cast<double>(rows)};
    if (w > 1) all_gather(ctx_->world(), view<double>(mine, {2}), view<double>(all.data(), {2 * static_cast<index_t>(w)}));
    else all.assign(mine, mine + 2);
    std::vector<double> room(static_cast<std::size_t>(d_), std::numeric_limits<double>::infinity()), has(room.size(), 0);
    const auto& shape = ctx_->mesh().shape();
    for (int r = 0; r < w; ++r) {
      const auto k = static_cast<std::size_t>(shape.coord(r, axis::data));
      room[k] = std::min(room[k], all[static_cast<std::size_t>(2 * r)]);
      has[k] = all[static_cast<std::size_t>(2 * r + 1)];
    }
    bool over = false;
    for (int k = 0; k < d_; ++k) {
      const auto ku = static_cast<std::size_t>(k);
      if (room[ku] < 1)
        throw std::invalid_argument("whale::" + layer_name<P>() + ": data replica " + std::to_string(k) +
                                    "'s ranks fit no row of a step of " + std::to_string(global) +
                                    " (plan_batch) within their memory caps (--memory-caps, WHALE_MEMORY_CAPS); raise "
                                    "the caps, give them fewer layers, or a smaller batch");
      if (has[ku] > room[ku]) over = true, fixed[ku] = 1;
    }
    if (!over) return;
    if (round == d_) break;
    // whole shares (in micro-batch multiples when the slice uses them): the capped replicas
    // get what fits, the others the rest by speed, at least one each
    const index_t q = o_.micro_batches > 1 && global % o_.micro_batches == 0 && global / o_.micro_batches >= d_ ? o_.micro_batches : 1;
    const index_t units = global / q;
    std::vector<index_t> want(static_cast<std::size_t>(d_), 0);
    index_t capped = 0;
    std::vector<double> free_speeds;  // of the replicas that are not capped
    for (int k = 0; k < d_; ++k) {
      const auto ku = static_cast<std::size_t>(k);
      if (fixed[ku]) {
        want[ku] = static_cast<index_t>(std::min(std::floor(room[ku] / static_cast<double>(q)), has[ku] / static_cast<double>(q)));
        capped += want[ku];
      } else {
        free_speeds.push_back(speed[ku]);
      }
    }
    const index_t rest = units - capped;
    const int free_count = static_cast<int>(free_speeds.size());
    for (int k = 0; k < d_; ++k)
      if (fixed[static_cast<std::size_t>(k)] && want[static_cast<std::size_t>(k)] < 1)
        throw std::invalid_argument("whale::" + layer_name<P>() + ": data replica " + std::to_string(k) +
                                    "'s memory caps hold less than one micro-batch of rows; raise the caps (--memory-caps, "
                                    "WHALE_MEMORY_CAPS) or use fewer micro-batches");
    if (free_count == 0 || rest < free_count)
      throw std::invalid_argument("whale::" + layer_name<P>() + ": the memory caps (--memory-caps, WHALE_MEMORY_CAPS) of the "
                                  "data replicas hold fewer rows than a step of " + std::to_string(global) +
                                  " (plan_batch); raise the caps or use a smaller batch");
    // the others share the rest by speed, as the weighted slice splits any batch
    for (int k = 0, i = 0; k < d_; ++k)
      if (!fixed[static_cast<std::size_t>(k)]) want[static_cast<std::size_t>(k)] = detail::weighted_slice(rest, free_count, i++, free_speeds).second;
    // weighted_slice gives each part one unit, then the rest by weight: weights want - 1 give exactly `want`
    double sum = 0;
    for (int k = 0; k < d_; ++k) sum += static_cast<double>(want[static_cast<std::size_t>(k)] - 1);
    for (int k = 0; k < d_; ++k)
      replica_weights_[static_cast<std::size_t>(k)] = sum > 0 ? static_cast<double>(want[static_cast<std::size_t>(k)] - 1) : 1.0;
  }
  throw std::invalid_argument("whale::" + layer_name<P>() + ": no split of a step of " + std::to_string(global) +
                              " rows (plan_batch) over the data replicas fits every rank's memory cap (--memory-caps, "
                              "WHALE_MEMORY_CAPS); raise the caps or use a smaller batch");
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
  // ZeRO-3 initialises the whole stage once, in host memory (on a device, only the device's part is checked)
  const std::int64_t start = level == 3 && be_.on_cpu() ? 4 * static_cast<std::int64_t>(n) : 0;
  detail::check_memory_fits(ctx_->world(), held.param_bytes + held.grad_bytes + start,
                            "its parameters (" + detail::mib_text(held.param_bytes) + ") and gradients (" +
                                detail::mib_text(held.grad_bytes) + ")",
                            "whale::" + layer_name<P>() + ": ", "spread the model over more ranks (split, pipeline, ZeRO-3) or more nodes",
                            be_);
}

template <class P> void executor<P>::check_step_memory(const step_ctx& c, std::int64_t data_bytes) {
  if (memory_checked_) return;
  memory_checked_ = true;
  if (!be_.on_cpu()) data_bytes = 0;  // on a device the data source's buffers are host memory, apart
  // minibatches in flight: N_m of them, each a whole minibatch, are one pass's micro-batches
  const index_t global = (c.seq > 0 ? c.global_rows / c.seq : c.global_rows) * std::max(1, in_flight_);
  auto lo = step_lowering(global, c.seq, 8);
  if (in_flight_ > 0) lo.micro_batches = in_flight_;
  const auto e = predict_memory(describe<P>(), lower<P>(ctx_->mesh().shape(), ctx_->rank(), lo), memory_options{o_.max_pending, o_.prefetch});
  std::ostringstream what;
  what << "the activations of its step (" << detail::mib_text(e.activations) << ": " << e.live_micro_batches
       << " micro-batch(es) of " << e.rows << " rows kept) and its communication buffers (" << detail::mib_text(e.comm) << ")";
  if (data_bytes > 0) what << ", with its data source's batch (" << detail::mib_text(data_bytes) << ")";
  detail::check_memory_fits(ctx_->world(), e.activations + e.comm + data_bytes, what.str(), "whale::" + layer_name<P>() + ": ",
                            "use a smaller batch, more micro-batches" + std::string(staged ? " (fewer kept under 1f1b)" : "") +
                                ", recompute<Block>, or more ranks",
                            be_);
}

}  // namespace whale
