// zero_engine's larger members (runtime/zero.hpp): setup, the device's
// buffers, the gathers of level 3 with their recorded order and prefetch, the
// reduce-scatters of levels 2-3 in buckets, the end of a pass and its
// rehearsal. Compiled once in whale::core under the compiled core
// (detail/compiled.hpp); inline, as the rest of the library, without it.
#pragma once

#include <algorithm>
#include <cstring>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "whale/runtime/zero.hpp"

#if !WHALE_CORE_DEFINITIONS
#error "whale/runtime/zero_impl.hpp holds the compiled core's definitions: include whale/runtime/zero.hpp, not this file"
#endif

namespace whale::detail {

WHALE_CORE_INLINE void zero_engine::setup(world_comm& data, int level, index_t base, index_t n, options o) {
  if (level < 1 || level > 3) throw std::invalid_argument("whale::shard: the ZeRO level must be 1, 2 or 3");
  if (!(o.bucket_mib > 0)) throw std::invalid_argument("whale::shard: the bucket size must be positive");
  if (o.max_pending < 1) throw std::invalid_argument("whale::shard: max_pending must be at least 1");
  comm_ = &data;
  level_ = level;
  base_ = base;
  n_ = n;
  o_ = o;
  o_.bf16 = o.bf16 && data.size() > 1;  // alone, nothing is summed: no rounding
  counts_ = block_counts(n, data.size());
  starts_.assign(counts_.size(), 0);
  for (std::size_t r = 1; r < counts_.size(); ++r) starts_[r] = starts_[r - 1] + counts_[r - 1];
  begin_ = starts_[static_cast<std::size_t>(data.rank())];
  end_ = begin_ + counts_[static_cast<std::size_t>(data.rank())];
  scratch_counts_.assign(counts_.size(), 0);
  if (level >= 2) shard_grads_ = tensor<float>({local_count()}, mem_kind::grads);
  if (level == 3) shard_params_ = tensor<float>({local_count()}, mem_kind::params);
  hooks_.self = this;
  }

WHALE_CORE_INLINE void zero_engine::set_backend(const backend_ref& be, device_comm* dev) {
  be_ = be;
  dev_ = be.on_cpu() ? nullptr : dev;
  if (staged() && o_.bf16)
    throw std::invalid_argument(std::string("whale::shard: summing gradients in bf16 (bf16_reduce) on a device (") + be.name() +
                                ") needs the device's own communicator (device_collectives; NCCL needs a build with MPI)");
  move_to(be, shard_params_, mem_kind::params);
  move_to(be, shard_grads_, mem_kind::grads);
  }

WHALE_CORE_INLINE void zero_engine::gather_after_update(float* full) {
  if (level_ > 2 || comm_->size() == 1) return;
  // in place on the CPU; on a device the owned range down, every range back up
  collective_in(be_, *comm_, dev_, host_full_, full + begin_, local_count(), full, n_,
                [&](auto& cm, const float* mine, float* all) {
                  all_gather_v(cm, cview<float>(mine, {local_count()}), view<float>(all, {n_}),
                               std::span<const index_t>(counts_));
                });
  }

WHALE_CORE_INLINE void zero_engine::gather_params(view<float> out) const {
  std::vector<float> keep;  // on a device: the owned shard's host copy
  all_gather_v(*comm_, be_.host_readable(cview<float>(shard_params_.v()), keep), out, std::span<const index_t>(counts_));
  }

WHALE_CORE_INLINE const zero_engine::leaf_info& zero_engine::info(index_t global_offset, index_t count) {
  const index_t offset = global_offset - base_;
  auto it = leaves_.find(offset);
  if (it != leaves_.end()) {
    if (it->second.count != count)
      throw std::logic_error("whale::shard: the leaf at " + std::to_string(offset) + " has " + std::to_string(count) +
                             " parameters, but " + std::to_string(it->second.count) + " were known for it (the step's program)");
    return it->second;
  }
  leaf_info l;
  l.offset = offset;
  l.count = count;
  for (int r = 0; r < comm_->size(); ++r) {
    const auto ru = static_cast<std::size_t>(r);
    const index_t lo = std::max(offset, starts_[ru]), hi = std::min(offset + count, starts_[ru] + counts_[ru]);
    l.counts.push_back(std::max<index_t>(0, hi - lo));
    if (r == comm_->rank()) {
      l.mine = std::max<index_t>(0, hi - lo);
      l.mine_at = l.mine ? lo - offset : 0;
    }
  }
  return leaves_.emplace(offset, std::move(l)).first->second;
  }

WHALE_CORE_INLINE void zero_engine::wait_oldest() {
  auto& p = pending_.front();
  p.req.wait();
  p.dreq.join();  // on a device: its queue waits for the reduce-scatter, the host does not
  if (p.recv >= 0 && !dry_) {  // bf16: widen the owned piece into (or onto) the owned gradients
    float* g = shard_grads_.data() + p.at;
    if (p.add) be_.launch(p.count, kernels::unpack_add_bf16{bits(p.recv), g});
    else be_.launch(p.count, kernels::unpack_bf16{bits(p.recv), g});
  }
  if (p.sum >= 0 && !dry_) {
    float* g = shard_grads_.data() + p.at;
    if (on_device() && !staged()) {  // the piece arrived in a device buffer: added there
      be_.launch(p.count, kernels::add{g, data(p.sum), g});
    } else if (on_device()) {  // the piece arrived in the host twin: up into the owned gradients, or added there
      const auto bytes = static_cast<std::size_t>(p.count) * sizeof(float);
      if (p.add) {
        be_.copy(data(p.sum), host(p.sum), bytes);
        be_.launch(p.count, kernels::add{g, data(p.sum), g});
      } else {
        be_.copy(g, host(p.sum), bytes);
      }
      be_.synchronize();  // the twin returns to the pool
    } else {
      const float* s = data(p.sum);
      for (index_t i = 0; i < p.count; ++i) g[i] += s[i];
    }
  }
  release(p.sum);
  pool16_.release(p.packed);
  pool16_.release(p.recv);
  if (p.last) {
    release(p.buf);
    --pending_leaves_;
  }
  pending_.erase(pending_.begin());
  }

WHALE_CORE_INLINE void zero_engine::start_gather(gathered& g, const leaf_info& l) {
  g.offset = l.offset;
  g.count = l.count;
  g.buf = acquire(l.count);
  if (dry_) return;
  const float* mine = l.mine ? shard_params_.data() + (l.offset + l.mine_at - begin_) : shard_params_.data();
  if (dev_) {  // the device's communicator gathers into the buffer itself
    g.dreq = iall_gather_v(*dev_, cview<float>(mine, {l.mine}), view<float>(data(g.buf), {l.count}),
                           std::span<const index_t>(l.counts));
    return;
  }
  if (staged()) {  // the owned piece down into its place in the host twin; gathered there in place
    index_t at = 0;
    for (int r = 0; r < comm_->rank(); ++r) at += l.counts[static_cast<std::size_t>(r)];
    be_.copy(host(g.buf) + at, mine, static_cast<std::size_t>(l.mine) * sizeof(float));
    be_.synchronize();
    mine = host(g.buf) + at;
  }
  g.req.emplace(iall_gather_v(*comm_, cview<float>(mine, {l.mine}), view<float>(host(g.buf), {l.count}),
                              std::span<const index_t>(l.counts)));
  }

WHALE_CORE_INLINE void zero_engine::drop(gathered& g) {
  g.dreq.join();
  if (g.req) g.req->wait();
  g.req.reset();
  release(g.buf);
  g = gathered{};
  }

WHALE_CORE_INLINE float* zero_engine::gather_for(const leaf_info& l, event ev) {
  progress();
  if (recording()) {
    trace().push_back(ev);
  } else if (pos_ >= trace().size() || !(trace()[pos_] == ev)) {
    ++rerecords_;
    drop(next_);  // the order changed: every rank sees the same change
    trace().resize(pos_);
    trace().push_back(ev);
    recording() = true;
  }
  ++pos_;
  if (held_.offset != l.offset) {
    drop(held_);
    if (next_.offset == l.offset) std::swap(held_, next_);
    else start_gather(held_, l);
  }
  held_.dreq.join();  // the layer's kernels follow the gather
  if (held_.req) {
    held_.req->wait();
    held_.req.reset();
    if (staged()) be_.copy(data(held_.buf), host(held_.buf), static_cast<std::size_t>(held_.count) * sizeof(float));
  }
  if (o_.prefetch && !recording() && pos_ < trace().size()) {
    const auto& nx = trace()[pos_];
    if (nx.offset != l.offset && next_.offset != nx.offset) {
      drop(next_);
      start_gather(next_, leaves_.at(nx.offset));
    }
  }
  return data(held_.buf);
  }

WHALE_CORE_INLINE void zero_engine::done_with(const leaf_info& l) {
  const bool again = !recording() && pos_ < trace().size() && trace()[pos_].offset == l.offset;
  if (!again && held_.offset == l.offset) drop(held_);
  }

WHALE_CORE_INLINE void zero_engine::before_forward(const leaf_ref& r) {
  if (level_ < 3) return;
  const auto& l = info(r.offset, r.count);
  r.rebind(gather_for(l, {l.offset, false}), nullptr);
  }

WHALE_CORE_INLINE void zero_engine::after_forward(const leaf_ref& r) {
  if (level_ < 3) return;
  r.rebind(nullptr, nullptr);
  done_with(info(r.offset, r.count));
  }

WHALE_CORE_INLINE void zero_engine::before_backward(const leaf_ref& r) {
  const auto& l = info(r.offset, r.count);
  float* p = level_ == 3 ? gather_for(l, {l.offset, true}) : full_params_ + l.offset;
  grad_buf_ = acquire(l.count);
  r.rebind(p, data(grad_buf_));
  }

WHALE_CORE_INLINE void zero_engine::scatter_grads(const leaf_info& l) {
  const auto per = bucket_elements(o_.bucket_mib);  // the lowering's cut (plan/partition.hpp)
  const int p = comm_->size();
  for (index_t a = 0; a < l.count; a += per) {
    const index_t b = std::min(l.count, a + per);
    const index_t ga = l.offset + a, gb = l.offset + b;
    index_t mine = 0, mine_at = 0;
    for (int r = 0; r < p; ++r) {
      const auto ru = static_cast<std::size_t>(r);
      const index_t lo = std::max(ga, starts_[ru]), hi = std::min(gb, starts_[ru] + counts_[ru]);
      scratch_counts_[ru] = std::max<index_t>(0, hi - lo);
      if (r == comm_->rank() && hi > lo) mine = hi - lo, mine_at = lo - begin_;
    }
    const bool last = b == l.count;
    if (o_.bf16) {  // packed, summed in bf16 into a bf16 piece, widened when it completes
      const int packed = pool16_.acquire(b - a, be_, staged()), recv = mine > 0 ? pool16_.acquire(mine, be_, staged()) : -1;
      pending pd{world_comm::request{}, -1, last, -1, mine_at, mine, packed, recv, accumulate_};
      if (!dry_) {  // packed where the gradients are; on a device, summed there by its communicator
        be_.launch(b - a, kernels::pack_bf16{data(grad_buf_) + a, bits(packed)});
        const cview<whale::bf16> in(pool16_.data(packed), {b - a});
        const view<whale::bf16> out(recv >= 0 ? pool16_.data(recv) : nullptr, {mine});
        if (dev_) pd.dreq = ireduce_scatter_v(*dev_, in, out, std::span<const index_t>(scratch_counts_));
        else pd.req = ireduce_scatter_v(*comm_, in, out, std::span<const index_t>(scratch_counts_));
      }
      pending_.push_back(std::move(pd));
      continue;
    }
    // staged through the host, the owned piece always arrives in a buffer's host twin (then copied or added up)
    const int sum = (accumulate_ || staged()) && mine > 0 ? acquire(mine) : -1;
    float* dst = sum >= 0 ? host(sum) : shard_grads_.data() + mine_at;
    pending pd{world_comm::request{}, grad_buf_, last, sum, mine_at, mine};
    pd.add = accumulate_;
    if (!dry_ && dev_) {  // the device's communicator takes the gradient buffer itself
      pd.dreq = ireduce_scatter_v(*dev_, cview<float>(data(grad_buf_) + a, {b - a}), view<float>(dst, {mine}),
                                  std::span<const index_t>(scratch_counts_));
    } else if (!dry_) {
      if (staged()) {  // the bucket down into the gradient buffer's host twin
        be_.copy(host(grad_buf_) + a, data(grad_buf_) + a, static_cast<std::size_t>(b - a) * sizeof(float));
        be_.synchronize();
      }
      pd.req = ireduce_scatter_v(*comm_, cview<float>(host(grad_buf_) + a, {b - a}), view<float>(dst, {mine}),
                                 std::span<const index_t>(scratch_counts_));
    }
    pending_.push_back(std::move(pd));
  }
  ++pending_leaves_;
  if (o_.bf16) release(grad_buf_);  // packed: the fp32 gradients are read no more
  grad_buf_ = -1;
  progress();
  while (pending_leaves_ > o_.max_pending) wait_oldest();
  }

WHALE_CORE_INLINE void zero_engine::after_backward(const leaf_ref& r) {
  const auto& l = info(r.offset, r.count);
  scatter_grads(l);
  if (level_ == 3) {
    r.rebind(nullptr, nullptr);
    done_with(l);
  } else {
    r.rebind(full_params_ + l.offset, nullptr);
  }
  }

WHALE_CORE_INLINE void zero_engine::finish_pass() {
  while (!pending_.empty()) wait_oldest();
  if (level_ == 3) {
    drop(next_);
    drop(held_);
  }
  const bool recorded = recording();
  recording() = false;
  pos_ = 0;
  if (level_ == 3 && recorded && o_.prefetch && !dry_) rehearse();
  }

WHALE_CORE_INLINE void zero_engine::follow(pass_kind kind, const std::vector<leaf_use>& uses) {
  if (level_ < 3 || uses.empty()) return;
  const int k = kind == pass_kind::training ? 0 : 1;
  if (!recordings_[k] && traces_[k].size() == uses.size()) {  // the same order again: nothing to do
    bool same = true;
    for (std::size_t i = 0; i < uses.size() && same; ++i) same = traces_[k][i] == event{uses[i].local_offset, uses[i].backward};
    if (same) return;
  }
  std::vector<event> order;
  order.reserve(uses.size());
  for (const auto& u : uses) order.push_back({info(base_ + u.local_offset, u.params).offset, u.backward});  // info() checks the sizes
  const int saved = kind_;
  kind_ = k;
  trace() = std::move(order);
  recording() = false;
  pos_ = 0;
  if (o_.prefetch) rehearse();  // the buffers its passes take, now
  kind_ = saved;
}

WHALE_CORE_INLINE void zero_engine::rehearse() {
  dry_ = true;
  const auto order = trace();
  for (const auto& e : order) {
    const auto& l = leaves_.at(e.offset);
    gather_for(l, e);
    if (e.backward) {
      grad_buf_ = acquire(l.count);
      scatter_grads(l);
    }
    done_with(l);
  }
  finish_pass();
  dry_ = false;
  }

}  // namespace whale::detail
