// executor_core's memory work (runtime/executor_core.hpp): the rows each
// rank takes under plan_options' memory caps, and the checks, before any
// allocation, that the plan's state and a training step fit this rank's
// device. Compiled once in whale::core under the compiled core
// (detail/compiled.hpp); inline, as the rest of the library, without it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/runtime/executor_core.hpp"

#if !WHALE_CORE_DEFINITIONS
#error "whale/runtime/executor_memory_impl.hpp holds the compiled core's definitions: include whale/runtime/executor_core.hpp, not this file"
#endif

namespace whale::detail {

WHALE_CORE_INLINE void executor_core::fit_rows_to_caps() {
  const int w = ctx_->size();
  const index_t global = o_.plan_batch;
  const double cap = o_.memory_cap_of(ctx_->rank(), w) * 1048576.0;
  std::vector<double> speed = replica_weights_;  // by speed: 1 / the replica's slowest factor
  std::vector<char> fixed(static_cast<std::size_t>(replicas_), 0);
  // Activations grow with a replica's rows, the rest does not: each round gives every
  // replica over a cap the rows that fit and the others the rest by speed, until none is over.
  for (int round = 0; round <= replicas_; ++round) {
    const index_t rows = slice(global, replica_).second;
    const auto e = predicted_memory(global, o_.plan_seq);
    const double fixed_bytes = static_cast<double>(e.model_state() + e.comm), act = static_cast<double>(e.activations);
    double most = std::numeric_limits<double>::infinity();  // rows this rank can take within its cap
    if (cap > 0) most = act > 0 ? std::floor(static_cast<double>(rows) * (cap - fixed_bytes) / act) : most;
    std::vector<double> all(static_cast<std::size_t>(2 * w));
    double mine[2] = {most, static_cast<double>(rows)};
    if (w > 1) all_gather(ctx_->world(), view<double>(mine, {2}), view<double>(all.data(), {2 * static_cast<index_t>(w)}));
    else all.assign(mine, mine + 2);
    std::vector<double> room(static_cast<std::size_t>(replicas_), std::numeric_limits<double>::infinity()), has(room.size(), 0);
    const auto& shape = ctx_->mesh().shape();
    for (int r = 0; r < w; ++r) {
      const auto k = static_cast<std::size_t>(shape.coord(r, axis::data));
      room[k] = std::min(room[k], all[static_cast<std::size_t>(2 * r)]);
      has[k] = all[static_cast<std::size_t>(2 * r + 1)];
    }
    bool over = false;
    for (int k = 0; k < replicas_; ++k) {
      const auto ku = static_cast<std::size_t>(k);
      if (room[ku] < 1)
        throw std::invalid_argument(who() + "data replica " + std::to_string(k) + "'s ranks fit no row of a step of " +
                                    std::to_string(global) +
                                    " (plan_batch) within their memory caps (--memory-caps, WHALE_MEMORY_CAPS); raise "
                                    "the caps, give them fewer layers, or a smaller batch");
      if (has[ku] > room[ku]) over = true, fixed[ku] = 1;
    }
    if (!over) return;
    if (round == replicas_) break;
    // whole shares (in micro-batch multiples when the slice uses them): the capped replicas
    // get what fits, the others the rest by speed, at least one each
    const index_t q = o_.micro_batches > 1 && global % o_.micro_batches == 0 && global / o_.micro_batches >= replicas_ ? o_.micro_batches : 1;
    const index_t units = global / q;
    std::vector<index_t> want(static_cast<std::size_t>(replicas_), 0);
    index_t capped = 0;
    std::vector<double> free_speeds;  // of the replicas that are not capped
    for (int k = 0; k < replicas_; ++k) {
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
    for (int k = 0; k < replicas_; ++k)
      if (fixed[static_cast<std::size_t>(k)] && want[static_cast<std::size_t>(k)] < 1)
        throw std::invalid_argument(who() + "data replica " + std::to_string(k) +
                                    "'s memory caps hold less than one micro-batch of rows; raise the caps (--memory-caps, "
                                    "WHALE_MEMORY_CAPS) or use fewer micro-batches");
    if (free_count == 0 || rest < free_count)
      throw std::invalid_argument(who() + "the memory caps (--memory-caps, WHALE_MEMORY_CAPS) of the "
                                          "data replicas hold fewer rows than a step of " + std::to_string(global) +
                                  " (plan_batch); raise the caps or use a smaller batch");
    // the others share the rest by speed, as the weighted slice splits any batch
    for (int k = 0, i = 0; k < replicas_; ++k)
      if (!fixed[static_cast<std::size_t>(k)]) want[static_cast<std::size_t>(k)] = weighted_slice(rest, free_count, i++, free_speeds).second;
    // weighted_slice gives each part one unit, then the rest by weight: weights want - 1 give exactly `want`
    double sum = 0;
    for (int k = 0; k < replicas_; ++k) sum += static_cast<double>(want[static_cast<std::size_t>(k)] - 1);
    for (int k = 0; k < replicas_; ++k)
      replica_weights_[static_cast<std::size_t>(k)] = sum > 0 ? static_cast<double>(want[static_cast<std::size_t>(k)] - 1) : 1.0;
  }
  throw std::invalid_argument(who() + "no split of a step of " + std::to_string(global) +
                              " rows (plan_batch) over the data replicas fits every rank's memory cap (--memory-caps, "
                              "WHALE_MEMORY_CAPS); raise the caps or use a smaller batch");
}

WHALE_CORE_INLINE void executor_core::check_state_memory(const program_totals& held, index_t n) const {
  // Emulated per-rank memory (plan_options::memory_caps_mib): every rank learns every rank's
  // model state and cap, so that all of them fail with the same sentence, naming the first over.
  if (!o_.memory_caps_mib.empty()) {
    const int w = ctx_->size();
    const std::int64_t master = o_.precision == precision::bf16 ? 4 * static_cast<std::int64_t>(held.params_held) : 0;  // bf16's fp32 copy
    double mine[2] = {static_cast<double>(held.param_bytes + held.grad_bytes + held.optimizer_bytes + master),
                      o_.memory_cap_of(ctx_->rank(), w) * 1048576.0};
    std::vector<double> all(static_cast<std::size_t>(2 * w));
    if (w > 1) all_gather(ctx_->world(), view<double>(mine, {2}), view<double>(all.data(), {2 * static_cast<index_t>(w)}));
    else all.assign(mine, mine + 2);
    for (int r = 0; r < w; ++r) {
      const double need = all[static_cast<std::size_t>(2 * r)], cap = all[static_cast<std::size_t>(2 * r + 1)];
      if (cap > 0 && need > cap)
        throw std::invalid_argument(who() + "rank " + std::to_string(r) + "'s memory cap (--memory-caps, "
                                    "WHALE_MEMORY_CAPS) is " + mib_text(static_cast<std::int64_t>(cap)) +
                                    ", but its parameters, gradients and AdamW state" +
                                    std::string(master > 0 ? " (and bf16's fp32 master weights)" : "") + " need " +
                                    mib_text(static_cast<std::int64_t>(need)) +
                                    "; give it fewer layers (a pipeline cuts by the caps), ZeRO, or a larger cap");
    }
  }
  // ZeRO-3 initialises the whole stage once, in host memory (on a device, only the device's part is checked)
  const std::int64_t start = level_ == 3 && be_.on_cpu() ? 4 * static_cast<std::int64_t>(n) : 0;
  check_memory_fits(ctx_->world(), held.param_bytes + held.grad_bytes + start,
                    "its parameters (" + mib_text(held.param_bytes) + ") and gradients (" + mib_text(held.grad_bytes) + ")",
                    who(), "spread the model over more ranks (split, pipeline, ZeRO-3) or more nodes", be_);
}

WHALE_CORE_INLINE void executor_core::check_step_memory(const step_ctx& c, std::int64_t data_bytes) {
  if (memory_checked_) return;
  memory_checked_ = true;
  if (!be_.on_cpu()) data_bytes = 0;  // on a device the data source's buffers are host memory, apart
  // minibatches in flight: N_m of them, each a whole minibatch, are one pass's micro-batches
  const index_t global = (c.seq > 0 ? c.global_rows / c.seq : c.global_rows) * std::max(1, in_flight_);
  auto lo = step_lowering(global, c.seq, 8);
  if (in_flight_ > 0) lo.micro_batches = in_flight_;
  auto step = lower(desc_, ctx_->mesh().shape(), ctx_->rank(), lo);
  const auto e = predict_memory(desc_, step, o_);
  step_order_ = std::move(step.order);  // the step's passes run in its order (order_for)
  std::ostringstream what;
  what << "the activations of its step (" << mib_text(e.activations) << ": " << e.live_micro_batches
       << " micro-batch(es) of " << e.rows << " rows kept) and its communication buffers (" << mib_text(e.comm) << ")";
  if (data_bytes > 0) what << ", with its data source's batch (" << mib_text(data_bytes) << ")";
  check_memory_fits(ctx_->world(), e.activations + e.comm + data_bytes, what.str(), who(),
                    "use a smaller batch, more micro-batches" + std::string(facts_.staged ? " (fewer kept under 1f1b)" : "") +
                        ", recompute<Block>, or more ranks",
                    be_);
  // ZeRO-3 gathers in the step's order from the first step; its pool (counted in e.comm above) is taken now
  if (level_ == 3) zero_.follow(zero_engine::pass_kind::training, step.leaf_uses());
}

}  // namespace whale::detail
