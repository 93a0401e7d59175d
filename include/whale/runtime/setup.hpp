// The construction of executor<P> (runtime/executor.hpp): the launch checks,
// placing the plan's chunks, lowering this rank's program, binding and initialising
// the parameters. Not the steps (runtime/step.hpp) nor the memory checks (memory_step.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "whale/runtime/executor.hpp"

namespace whale {

template <class P>
executor<P>::executor(const context& ctx, seed s, plan_options o) : ctx_(&ctx), o_(std::move(o)) {
  const auto& shape = ctx.mesh().shape();
  const std::string who = "whale::" + layer_name<P>() + ": ";
  // first: a rank launched differently is named before it can hang the others
  detail::check_ranks_agree(ctx.world(), detail::launch_fields(layer_name<P>(), shape, o_), who);
  if (!(o_.bucket_mib > 0)) throw std::invalid_argument(who + "the bucket size must be positive (got " + std::to_string(o_.bucket_mib) + " MiB)");
  if (o_.micro_batches * V > max_micro)
    throw std::invalid_argument(who + "at most " + std::to_string(max_micro / V) + " micro-batches" +
                                (V > 1 ? " with " + std::to_string(V) + " chunks per pipe rank" : std::string()));
  if (o_.micro_batches > 1 && stage_type::splits_data)
    throw std::invalid_argument(who + "a split<..., axis::data> region needs the whole per-replica batch in one pass "
                                      "(it gathers every row of the global batch); use micro_batches 0 or 1");
  be_ = o_.backend;
  if (!be_.on_cpu()) {  // what runs in a device's memory so far (docs/device.md)
    if (o_.bf16_reduce && !o_.device_collectives)  // the packed buckets are summed by the device's own communicator
      throw std::invalid_argument(who + "summing gradients in bf16 (bf16_reduce) with the network on a device (" + be_.name() +
                                  ") needs the device's own communicator: set plan_options::device_collectives");
  }
  if (!staged && shape.size(axis::pipe) != 1)
    throw std::invalid_argument(who + "the mesh " + shape.spec() + " has a pipe axis, but the plan has no pipeline<...>");
  if (shape.size(axis::model) != 1 && !has_split)
    throw std::invalid_argument(who + "the mesh " + shape.spec() +
                                " has a model axis, but no stage holds a split region (the model ranks would only "
                                "repeat each other's work); launch without a model axis, or split layers over axis::model");
  if (shape.size(axis::data) != 1 && !replicated && !has_split)
    throw std::invalid_argument(who + "the mesh " + shape.spec() + " has " + std::to_string(shape.size(axis::data)) +
                                " ranks on the data axis, but the plan is not replicated; wrap it in replicate<...>");
  if constexpr (staged) {
    if constexpr (X::fixed_stages > 0) {
      static_assert(X::fixed_stages % V == 0,
                    "whale::pipeline<interleaved_1f1b<V>, ...>: the stage count must be a multiple of V (each pipe rank "
                    "holds V of them)");
      if (shape.size(axis::pipe) * V != X::fixed_stages)
        throw std::invalid_argument(
            who + "the pipeline has " + std::to_string(X::fixed_stages) + " stages but the mesh's pipe axis has " +
            std::to_string(shape.size(axis::pipe)) + " rank(s) (" + shape.spec() + ")" +
            (V > 1 ? " holding " + std::to_string(V) + " chunks each" : std::string()) +
            "; every stage needs its own pipe rank" + (V > 1 ? " and chunk" : "") + ": launch with --mesh " +
            (replicated ? "data=D,pipe=" : "pipe=") + std::to_string(X::fixed_stages / V));
    }
  }
  if (!o_.trace_path.empty()) check_output_path(ctx.world(), o_.trace_path, "whale: the trace file (--trace, WHALE_TRACE)");
  p_ = shape.size(axis::pipe), d_ = shape.size(axis::data);
  stage_ = ctx.mesh().coord(axis::pipe), replica_ = ctx.mesh().coord(axis::data);
  model_rank_ = ctx.mesh().coord(axis::model);
  slow_.set_factor(o_.speed_of(ctx.rank(), ctx.size()));  // a list of the wrong length fails on every rank
  if (o_.balance && (!o_.speeds.empty() || !o_.memory_caps_mib.empty())) {  // a replica runs at the pace of its slowest rank
    if (stage_type::splits_data)
      throw std::invalid_argument(who + "plan_options::balance splits the batch by speed, but a split<..., axis::data> "
                                        "region gathers the same number of rows from every replica; balance plans without one");
    std::vector<double> slowest(static_cast<std::size_t>(d_), 1.0);
    for (int r = 0; r < ctx.size(); ++r) {
      auto& f = slowest[static_cast<std::size_t>(shape.coord(r, axis::data))];
      f = std::max(f, o_.speed_of(r, ctx.size()));
    }
    for (double f : slowest) replica_weights_.push_back(1.0 / f);
  }
  pipe_ = &ctx.mesh().comm(axis::pipe), data_ = &ctx.mesh().comm(axis::data), model_comm_ = &ctx.mesh().comm(axis::model);
  if (!be_.on_cpu() && o_.device_collectives) {  // collective over each axis group, on every rank alike (agreed above)
    dev_data_ = make_device_comm(*data_, be_);
    if constexpr (has_split) dev_model_ = make_device_comm(*model_comm_, be_);
    if (ctx.size() > 1) dev_world_ = make_device_comm(ctx.world(), be_);
    if (shape.size(axis::pipe) > 1)  // waiting on NCCL, keep MPI's pipeline sends moving
      for (auto* d : {dev_data_.get(), dev_model_.get(), dev_world_.get()})
        if (d) d->set_progress([this] { msg_.progress(); });
  }
  if constexpr (has_split) {  // split regions learn their communicators before parameters are counted
    split_env env;
    env.data = data_, env.model = model_comm_, env.no_data_sync = &no_sync_;
    env.data_device = dev_data_.get(), env.model_device = dev_model_.get();
    for (auto& part : parts_) part.configure(env);
  }
  if (o_.in_flight < 0 || o_.in_flight > max_micro || (o_.in_flight > 0 && o_.micro_batches > 0))
    throw std::invalid_argument(who + "plan_options::in_flight (N_m minibatches in flight, 1 to " + std::to_string(max_micro) +
                                ") makes each minibatch one micro-batch; do not also set micro_batches");
  if (o_.worker_cuts) {  // what it means must be what it does
    constexpr bool cuttable = [] {
      if constexpr (staged) return V == 1 && !X::explicit_stages && level == 0;
      else return false;
    }();
    if (!cuttable)
      throw std::invalid_argument(who + "plan_options::worker_cuts cuts each data replica's pipeline of a repeat for "
                                        "its own ranks; this plan has none to cut (it needs replicate<pipeline<1f1b or "
                                        "gpipe, a model with one repeat>>, no explicit stages, no ZeRO)");
    if (!o_.blocks.empty())
      throw std::invalid_argument(who + "plan_options::worker_cuts chooses each replica's stage blocks, but stage blocks "
                                        "were given (--stage-blocks, WHALE_STAGE_BLOCKS); give one or the other");
  }
  if constexpr (staged && V == 1) {
    if constexpr (!X::explicit_stages) {  // unequal ranks: slow stages get fewer blocks
      if (o_.blocks.empty() && (!o_.speeds.empty() || !o_.memory_caps_mib.empty()) && p_ > 1) {
        std::vector<double> slow(static_cast<std::size_t>(p_), 1.0);  // a pipe position runs at its slowest rank's pace
        std::vector<double> cap(static_cast<std::size_t>(p_), 0.0);   // and fits its smallest rank's memory
        for (int r = 0; r < ctx.size(); ++r) {
          // worker_cuts: only this replica's ranks; otherwise every replica's (one cut for all)
          if (o_.worker_cuts && shape.coord(r, axis::data) != replica_) continue;
          const auto at = static_cast<std::size_t>(shape.coord(r, axis::pipe));
          slow[at] = std::max(slow[at], o_.speed_of(r, ctx.size()));
          const double c = o_.memory_cap_of(r, ctx.size()) * 1048576.0;
          if (c > 0) cap[at] = cap[at] > 0 ? std::min(cap[at], c) : c;
        }
        // the capped cut counts whole, unsharded stages; with ZeRO or split stages only the make-time check applies
        const bool capped = level == 0 && !has_split && std::any_of(cap.begin(), cap.end(), [](double c) { return c > 0; });
        if (capped || std::any_of(slow.begin(), slow.end(), [](double f) { return f != 1.0; })) {
          lower_options lo = lowering_of(o_, d_ * p_);  // (o_.blocks is empty here)
          lo.micro_batches = 0;
          lo.stage_slowness = slow;
          if (capped) {
            for (auto& c : cap) c = c > 0 ? c : std::numeric_limits<double>::infinity();
            lo.stage_memory_caps = cap;
            // minibatches in flight: each a whole minibatch of the replica, N_m of them
            lo.micro_batches = o_.in_flight > 0 ? o_.in_flight : o_.micro_batches;
            lo.balance_seq = o_.plan_batch > 0 ? o_.plan_seq : o_.balance_seq;
            if (o_.plan_batch > 0)  // rows of one micro-batch of one replica
              lo.cap_rows = o_.plan_batch * o_.plan_seq /
                            (d_ * (o_.in_flight > 0 ? 1 : std::max(1, o_.micro_batches > 0 ? o_.micro_batches : p_)));
          }
          try {
            o_.blocks = detail::stage_cut(describe<P>(), p_, lo);
          } catch (const std::invalid_argument& e) {
            throw std::invalid_argument(who + e.what());
          }
        }
      }
    }
  }
  // the program of this rank: what it holds (placement only; rows do not matter here), and the pipeline's cut
  lower_options lo = lowering_of(o_, d_ * p_);  // p micro-batches of one sequence per replica: valid for every schedule
  lo.micro_batches = staged ? p_ : 0;
  try {
    prog_ = lower<P>(shape, ctx.rank(), lo);
  } catch (const std::invalid_argument& e) {  // the plan's rules, named as the executor names them
    std::string why = e.what();
    if (const std::string by = "whale::lower: " + describe<P>().name + ": "; why.rfind(by, 0) == 0) why = why.substr(by.size());
    throw std::invalid_argument(who + why);
  }
  for (int ch = 0; ch < V; ++ch) parts_[static_cast<std::size_t>(ch)].place(p_ * V, ch * p_ + stage_, prog_.stage_blocks);
  for (int ch = 0; ch < V; ++ch) chunk_at_[static_cast<std::size_t>(ch) + 1] = chunk_at_[static_cast<std::size_t>(ch)] + chunk_size(ch);
  if (o_.micro_batches > 0 && staged) schedule_for(o_.micro_batches);  // a bad schedule fails here, on every rank
  const index_t n = chunk_at_[V];
  const auto held = prog_.totals();
  if (n != held.params_held)
    throw std::logic_error(who + "the runtime holds " + std::to_string(n) + " parameters, the program " +
                           std::to_string(held.params_held));
  // tied heads: where each one's table lies (this rank, or another pipe rank's program)
  if (const auto d = describe<P>(); std::any_of(d.units.begin(), d.units.end(), [](const unit_desc& u) { return u.ties_to >= 0; }))
    tied_model_ = true, ties_ = detail::ties_of(prog_, [&](int pipe) {
      auto c = ctx.mesh().coords();
      c[static_cast<std::size_t>(axis::pipe)] = pipe;
      return lower<P>(shape, shape.rank_of(c), lo);
    });
  check_state_memory(held, n);  // before the parameters are allocated: do they fit on this node?
  if (o_.balance && !o_.memory_caps_mib.empty() && o_.plan_batch > 0 && d_ > 1) fit_rows_to_caps();
  bind(s, n);
  if constexpr (level < 3) {  // replicated parameters start equal: rank 0 of each data group wins (split-over-data shards differ by design)
    // (worker_cuts: replicas hold other ranges; every layer starts from its own seeded streams anyway)
    if (d_ > 1 && level == 0 && !o_.worker_cuts)
      for (auto [b, e] : detail::complement(no_sync_, n)) broadcast(*data_, params_.v().rows(b, e - b), 0);
  }
  if (!be_.on_cpu()) {  // initialised and made equal on the host: now into the device's memory, layers bound there
    if constexpr (level <= 1) detail::place_params(be_, params_, grads_);
    else if constexpr (level == 2) detail::move_to(be_, params_, mem_kind::params);  // gradients: ZeRO's own buffers
    if constexpr (level < 3)
      for (int ch = 0; ch < V; ++ch) {
        const index_t at = chunk_at_[static_cast<std::size_t>(ch)];
        parts_[static_cast<std::size_t>(ch)].bind_and_init(params_.data() + at, level < 2 ? grads_.data() + at : nullptr, s, false);
      }
    if constexpr (level > 0) {
      if constexpr (level < 3) zero_.set_full_params(params_.data());
      zero_.set_backend(be_, dev_data_.get());  // the owned shards too (ZeRO 2-3)
    }
  }
  if (d_ > 1 && level < 2 && !o_.worker_cuts) {
    // the program's buckets; binding found which ranges are summed over data, and they must be the same
    if (detail::merged_ranges(prog_.grad_buckets) != detail::complement(no_sync_, n))
      throw std::logic_error("whale::" + layer_name<P>() + ": the program's gradient buckets do not cover the ranges "
                             "summed over the data axis");
    sync_.plan(prog_.grad_buckets, blocking_buckets(), o_.bf16_reduce, be_, dev_data_.get());
  }
  msg_.bind(*pipe_, be_);
  // on a device, pipeline messages take the device's own channels (collective over the pipe group, on every rank alike)
  if (!be_.on_cpu() && o_.device_collectives && p_ > 1) msg_.open_channels(make_device_comm(*pipe_, be_));
  if (o_.trace || !o_.trace_path.empty()) {
    tr_.enable(ctx.rank(), stage_, replica_);
    barrier(ctx.world());
    tr_.set_origin();
  }
}

template <class P> void executor<P>::bind(seed s, index_t n) {
  if constexpr (level == 3) {
    auto& part_ = parts_[0];
    zero_.setup(*data_, level, part_.begin(), n, zopts());
    tensor<float> tmp({n}, mem_kind::workspace);  // init from the whole stage's streams, keep the owned range
    part_.bind_and_init(tmp.data(), nullptr, s, true);
    detail::tie_params(ties_, tmp.data(), pipe_);
    copy<float>(cview<float>(tmp.data() + zero_.begin(), {zero_.local_count()}), zero_.shard_params());
    part_.bind_and_init(nullptr, nullptr, s, false);  // leaves point at gathered buffers only while they run
  } else {
    params_ = tensor<float>({n}, mem_kind::params);
    if (level < 2) grads_ = tensor<float>({n}, mem_kind::grads);
    for (int ch = 0; ch < V; ++ch) {
      const index_t at = chunk_at_[static_cast<std::size_t>(ch)];
      parts_[static_cast<std::size_t>(ch)].bind_and_init(params_.data() + at, level < 2 ? grads_.data() + at : nullptr, s, true);
    }
    detail::tie_params(ties_, params_.data(), pipe_);
    if (level > 0) {
      zero_.setup(*data_, level, parts_[0].begin(), n, zopts());
      zero_.set_full_params(params_.data());
    }
  }
}

}  // namespace whale
