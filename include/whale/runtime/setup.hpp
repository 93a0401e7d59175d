// The construction of executor<P> (runtime/executor.hpp): what its plan's type
// tells the model-independent runtime (executor_core: the launch checks and this
// rank's program), then placing the plan's chunks, binding and initialising the
// parameters. Not the steps (runtime/step.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "whale/runtime/executor.hpp"

namespace whale {

template <class P> detail::plan_facts executor<P>::facts() {
  detail::plan_facts f;
  f.name = layer_name<P>();
  f.desc = describe<P>();
  f.zero_level = level, f.chunks = chunks_per_rank, f.staged = staged, f.replicated = replicated;
  f.has_split = has_split, f.splits_data = stage_type::splits_data, f.split_backward = split_backward;
  f.schedule = sched::name();
  if constexpr (staged) {
    static_assert(X::fixed_stages % chunks_per_rank == 0,
                  "whale::pipeline<interleaved_1f1b<V>, ...>: the stage count must be a multiple of V (each pipe rank "
                  "holds V of them)");
    f.explicit_stages = X::explicit_stages, f.fixed_stages = X::fixed_stages;
  }
  return f;
}

template <class P>
executor<P>::executor(const context& ctx, seed s, plan_options o) : detail::executor_core(ctx, std::move(o), facts()) {
  // executor_core checked the launch and opened the communicators; the split regions check their degrees first
  if constexpr (has_split) {  // split regions learn their communicators before parameters are counted
    split_env env;
    env.data = data_, env.model = model_comm_, env.no_data_sync = &no_sync_;
    env.data_device = dev_data_.get(), env.model_device = dev_model_.get();
    for (auto& part : parts_) part.configure(env);
  }
  lower_program();
  for (int ch = 0; ch < chunks_per_rank; ++ch) parts_[static_cast<std::size_t>(ch)].place(stages_ * chunks_per_rank, ch * stages_ + stage_, prog_.stage_blocks);
  for (int ch = 0; ch < chunks_per_rank; ++ch) chunk_at_[static_cast<std::size_t>(ch) + 1] = chunk_at_[static_cast<std::size_t>(ch)] + chunk_size(ch);
  if (o_.micro_batches > 0 && staged) order_for(o_.micro_batches);  // a bad schedule fails here, on every rank
  check_placement();
  const index_t n = param_count();
  bind(s, n);
  if constexpr (level < 3) {  // replicated parameters start equal: rank 0 of each data group wins (split-over-data shards differ by design)
    // (worker_cuts: replicas hold other ranges; every layer starts from its own seeded streams anyway)
    if (replicas_ > 1 && level == 0 && !o_.worker_cuts)
      for (auto [b, e] : detail::complement(no_sync_, n)) broadcast(*data_, params_.v().rows(b, e - b), 0);
  }
  if (!be_.on_cpu()) {  // initialised and made equal on the host: now into the device's memory, layers bound there
    if constexpr (level <= 1) detail::place_params(be_, params_, grads_);
    else if constexpr (level == 2) detail::move_to(be_, params_, mem_kind::params);  // gradients: ZeRO's own buffers
    if constexpr (level < 3)
      for (int ch = 0; ch < chunks_per_rank; ++ch) {
        const index_t at = chunk_at_[static_cast<std::size_t>(ch)];
        parts_[static_cast<std::size_t>(ch)].bind_and_init(params_.data() + at, level < 2 ? grads_.data() + at : nullptr, s, false);
      }
    if constexpr (level > 0) {
      if constexpr (level < 3) zero_.set_full_params(params_.data());
      zero_.set_backend(be_, dev_data_.get());  // the owned shards too (ZeRO 2-3)
    }
  }
  finish_setup();
}

template <class P> void executor<P>::bind(seed s, index_t n) {
  if constexpr (level == 3) {
    auto& part_ = parts_[0];
    zero_.setup(*data_, level, part_.begin(), n, zero_engine_options());
    tensor<float> tmp({n}, mem_kind::workspace);  // init from the whole stage's streams, keep the owned range
    part_.bind_and_init(tmp.data(), nullptr, s, true);
    detail::tie_params(ties_, tmp.data(), pipe_);
    copy<float>(cview<float>(tmp.data() + zero_.begin(), {zero_.local_count()}), zero_.shard_params());
    part_.bind_and_init(nullptr, nullptr, s, false);  // leaves point at gathered buffers only while they run
  } else {
    params_ = tensor<float>({n}, mem_kind::params);
    if (level < 2) grads_ = tensor<float>({n}, mem_kind::grads);
    for (int ch = 0; ch < chunks_per_rank; ++ch) {
      const index_t at = chunk_at_[static_cast<std::size_t>(ch)];
      parts_[static_cast<std::size_t>(ch)].bind_and_init(params_.data() + at, level < 2 ? grads_.data() + at : nullptr, s, true);
    }
    detail::tie_params(ties_, params_.data(), pipe_);
    if (level > 0) {
      zero_.setup(*data_, level, parts_[0].begin(), n, zero_engine_options());
      zero_.set_full_params(params_.data());
    }
  }
}

}  // namespace whale
