// ZeRO over the data axis for any flat parameter range, compiled once (no
// model types): each data rank owns a near-even contiguous range of the
// range; level 2 reduce-scatters each leaf's gradients into the owners as its
// backward ends, level 3 also all-gathers each leaf's parameters just before
// it runs (prefetching the next one, in the order recorded on the first pass)
// and frees them after. Levels 1–2 all-gather the parameters after the update.
// The executor binds the layers and owns the full buffers of levels 1–2. With
// the stage in a device's memory (set_backend), the owned shards and the
// buffers layers bind are there. With the device's own communicator (NCCL on
// a GPU) every collective takes those buffers themselves. Without one, each
// runs on host twins of them: a gather lands in its buffer's host twin and is
// copied up when a layer needs it; a leaf's gradients are copied down,
// reduce-scattered into a host piece, and copied (or added) into the owned
// gradients on completion.
#pragma once

#include <algorithm>
#include <cstring>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/cpu/launch.hpp"
#include "whale/backend/kernels/elementwise.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/device_comm.hpp"
#include "whale/comm/staging.hpp"
#include "whale/comm/context.hpp"
#include "whale/nn/layer.hpp"

namespace whale::detail {

/// ZeRO levels 1–3 of one flat range [base, base + n) of the flat model.
class zero_engine {
 public:
  struct options {
    double bucket_mib = 25.0;  ///< reduce-scatter buckets within a leaf
    bool prefetch = true;      ///< level 3: gather the next leaf while one runs
    int max_pending = 2;       ///< leaves whose reduce-scatters may be in flight
    bool bf16 = false;         ///< levels 2-3: gradients packed to bf16 and reduce-scattered in bf16
  };

  /// `full_params` (levels 1–2): the executor's buffer of all n parameters.
  void setup(world_comm& data, int level, index_t base, index_t n, options o) {
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
  int level() const noexcept { return level_; }
  index_t begin() const noexcept { return begin_; }  ///< owned range, relative to base
  index_t end() const noexcept { return end_; }
  index_t local_count() const noexcept { return end_ - begin_; }
  const std::vector<index_t>& counts() const noexcept { return counts_; }
  view<float> shard_params() const noexcept { return shard_params_.v(); }
  view<float> shard_grads() const noexcept { return shard_grads_.v(); }
  std::size_t comm_buffers() const noexcept { return pool_.size() + pool16_.size(); }
  /// Level 3: how often a pass asked for parameters in an order other than the
  /// one recorded for its kind (each such pass prefetches nothing from there on).
  std::size_t rerecords() const noexcept { return rerecords_; }
  /// Levels 1–2: where leaves find their parameters between uses.
  void set_full_params(float* p) noexcept { full_params_ = p; }

  /// Which kind of pass asks for parameters: training and forward-only passes
  /// ask in different orders; each kind keeps its own recorded order, so
  /// alternating them prefetches.
  enum class pass_kind { training, forward_only };
  /// Put the engine's hooks around `c.hooks` for one pass (levels 2–3). Its
  /// first backward starts the owned gradients; set_accumulate(true) makes
  /// later ones (micro-batches) add to them.
  void begin_pass(step_ctx& c, pass_kind kind) {
    if (level_ < 2) return;
    accumulate_ = false;
    kind_ = kind == pass_kind::training ? 0 : 1;
    hooks_.next = c.hooks;
    c.hooks = &hooks_;
  }
  /// Whether the next backwards add to the owned gradients (micro-batches after the first).
  void set_accumulate(bool a) noexcept { accumulate_ = a; }
  /// End of a pass: every reduce-scatter done, every gather buffer back in the pool.
  void end_pass(step_ctx& c) {
    if (level_ < 2) return;
    c.hooks = hooks_.next;
    finish_pass();
  }
  /// The stage in a device's memory (`be` not the CPU): the owned shards move
  /// there and comm buffers are allocated there. `dev`: the communicator that
  /// takes them (the data axis's on the device); null: each comm buffer has a
  /// host twin where its collectives run, and the gather after the update
  /// (levels 1-2) goes through a host copy of all n parameters.
  void set_backend(const backend_ref& be, device_comm* dev = nullptr) {
    be_ = be;
    dev_ = be.on_cpu() ? nullptr : dev;
    if (staged() && o_.bf16)
      throw std::invalid_argument(std::string("whale::shard: summing gradients in bf16 (bf16_reduce) on a device (") + be.name() +
                                  ") needs the device's own communicator (device_collectives; NCCL needs a build with MPI)");
    move_to(be, shard_params_, mem_kind::params);
    move_to(be, shard_grads_, mem_kind::grads);
  }
  /// Levels 1–2 after the update of the owned range: every rank gets all parameters.
  void gather_after_update(float* full) {
    if (level_ > 2 || comm_->size() == 1) return;
    // in place on the CPU; on a device the owned range down, every range back up
    collective_in(be_, *comm_, dev_, host_full_, full + begin_, local_count(), full, n_,
                  [&](auto& cm, const float* mine, float* all) {
                    all_gather_v(cm, cview<float>(mine, {local_count()}), view<float>(all, {n_}),
                                 std::span<const index_t>(counts_));
                  });
  }
  /// All n parameters into `out`, host memory (collective at level 3).
  void gather_params(view<float> out) const {
    std::vector<float> keep;  // on a device: the owned shard's host copy
    all_gather_v(*comm_, be_.host_readable(cview<float>(shard_params_.v()), keep), out, std::span<const index_t>(counts_));
  }

 private:
  struct leaf_info {
    index_t offset = 0, count = 0;  // relative to base
    std::vector<index_t> counts;
    index_t mine_at = 0, mine = 0;
  };
  const leaf_info& info(index_t global_offset, index_t count) {
    const index_t offset = global_offset - base_;
    auto it = leaves_.find(offset);
    if (it != leaves_.end()) return it->second;
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

  // Pools of comm buffers (fp32, and bf16 for packed gradients), taken by
  // exact size and released at fixed points, so that every step takes the
  // same buffers: nothing is allocated after the first.
  // On a device, each buffer is there; staged through the host, it also has a host twin, where its collectives run.
  template <class T> struct pool {
    struct buffer {
      tensor<T> t;
      tensor<T> host;  // on a device: the host twin
      bool busy = false;
    };
    std::vector<buffer> bufs;
    int acquire(index_t count, const backend_ref& be, bool twin) {
      for (std::size_t i = 0; i < bufs.size(); ++i)
        if (!bufs[i].busy && static_cast<index_t>(bufs[i].t.capacity()) == count) {
          bufs[i].busy = true;
          return static_cast<int>(i);
        }
      buffer b;
      {
        const place_scope on(be.memory());
        b.t = tensor<T>({count}, mem_kind::comm);
      }
      if (twin) {
        const place_scope on_host(nullptr);
        b.host = tensor<T>({count}, mem_kind::comm);
      }
      b.busy = true;
      bufs.push_back(std::move(b));
      return static_cast<int>(bufs.size() - 1);
    }
    T* data(int b) const noexcept { return bufs[static_cast<std::size_t>(b)].t.data(); }
    /// Where buffer b's collectives run: itself, or its host twin where it has one.
    T* host(int b) const noexcept {
      const auto& x = bufs[static_cast<std::size_t>(b)];
      return x.host.capacity() ? x.host.data() : x.t.data();
    }
    void release(int b) noexcept {
      if (b >= 0) bufs[static_cast<std::size_t>(b)].busy = false;
    }
    std::size_t size() const noexcept { return bufs.size(); }
  };
  int acquire(index_t count) { return pool_.acquire(count, be_, staged()); }
  float* data(int b) const noexcept { return pool_.data(b); }
  float* host(int b) const noexcept { return pool_.host(b); }
  bool on_device() const noexcept { return !be_.on_cpu(); }
  /// On a device without its own communicator: collectives on host twins.
  bool staged() const noexcept { return on_device() && !dev_; }
  void release(int b) noexcept { pool_.release(b); }
  std::uint16_t* bits(int b) const noexcept { return reinterpret_cast<std::uint16_t*>(pool16_.data(b)); }

  struct pending {
    world_comm::request req;
    int buf;        // the leaf's gradient buffer
    bool last;      // the leaf's last bucket: its buffer returns to the pool when this completes
    int sum = -1;   // accumulating (always, staged through the host): the buffer the owned piece arrived in (staged: its host twin), copied or added on completion
    index_t at = 0, count = 0;
    int packed = -1, recv = -1;  // bf16: the bucket packed, and the owned piece summed in bf16
    bool add = false;            // bf16, and on a device: added to the owned gradients (micro-batches after the first), not copied
    device_comm::request dreq{};  // on a device with its own communicator: the operation
  };
  void progress() {
    for (auto& p : pending_) p.req.test(), p.dreq.test();
  }
  void wait_oldest() {
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

  struct gathered {
    index_t offset = -1, count = 0;
    int buf = -1;
    std::optional<world_comm::request> req;
    device_comm::request dreq{};  // on a device with its own communicator
  };
  void start_gather(gathered& g, const leaf_info& l) {
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
  void drop(gathered& g) {
    g.dreq.join();
    if (g.req) g.req->wait();
    g.req.reset();
    release(g.buf);
    g = gathered{};
  }

  // The order in which leaves ask for their parameters, recorded in the first
  // pass of each kind and used to prefetch in later ones (a change of order re-records).
  struct event {
    index_t offset;
    bool backward;
    friend bool operator==(const event&, const event&) = default;
  };
  float* gather_for(const leaf_info& l, event ev) {
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
  void done_with(const leaf_info& l) {
    const bool again = !recording() && pos_ < trace().size() && trace()[pos_].offset == l.offset;
    if (!again && held_.offset == l.offset) drop(held_);
  }

  void before_forward(const leaf_ref& r) {
    if (level_ < 3) return;
    const auto& l = info(r.offset, r.count);
    r.rebind(gather_for(l, {l.offset, false}), nullptr);
  }
  void after_forward(const leaf_ref& r) {
    if (level_ < 3) return;
    r.rebind(nullptr, nullptr);
    done_with(info(r.offset, r.count));
  }
  void before_backward(const leaf_ref& r) {
    const auto& l = info(r.offset, r.count);
    float* p = level_ == 3 ? gather_for(l, {l.offset, true}) : full_params_ + l.offset;
    grad_buf_ = acquire(l.count);
    r.rebind(p, data(grad_buf_));
  }
  // Reduce-scatter the leaf's gradients into the owners, non-blocking, in buckets.
  void scatter_grads(const leaf_info& l) {
    const auto per = std::max<index_t>(1, static_cast<index_t>(o_.bucket_mib * 1048576.0 / sizeof(float)));
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
  void after_backward(const leaf_ref& r) {
    const auto& l = info(r.offset, r.count);
    scatter_grads(l);
    if (level_ == 3) {
      r.rebind(nullptr, nullptr);
      done_with(l);
    } else {
      r.rebind(full_params_ + l.offset, nullptr);
    }
  }
  void finish_pass() {
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
  // After a pass that recorded the order: replay its buffer traffic (with
  // prefetching) without communicating, so the pool holds every buffer later passes take.
  void rehearse() {
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

  struct hooks final : layer_hooks {
    zero_engine* self = nullptr;
    layer_hooks* next = nullptr;  // hooks set before ours (e.g. a trace): called inside ours
    void before_forward(const leaf_ref& r) override {
      if (r.count) self->before_forward(r);
      if (next) next->before_forward(r);
    }
    void after_forward(const leaf_ref& r) override {
      if (next) next->after_forward(r);
      if (r.count) self->after_forward(r);
    }
    void before_backward(const leaf_ref& r) override {
      if (r.count) self->before_backward(r);
      if (next) next->before_backward(r);
    }
    void after_backward(const leaf_ref& r) override {
      if (next) next->after_backward(r);
      if (r.count) self->after_backward(r);
    }
  };

  world_comm* comm_ = nullptr;
  int level_ = 0;
  index_t base_ = 0, n_ = 0, begin_ = 0, end_ = 0;
  options o_;
  std::vector<index_t> counts_, starts_, scratch_counts_;
  tensor<float> shard_params_, shard_grads_;
  float* full_params_ = nullptr;
  backend_ref be_;              // where the stage computes
  device_comm* dev_ = nullptr;  // on a device: the communicator that takes its buffers (null: host twins)
  tensor<float> host_full_;     // levels 1-2 staged: the gather after the update's host copies (through_host)
  hooks hooks_;
  std::unordered_map<index_t, leaf_info> leaves_;
  pool<float> pool_;
  pool<whale::bf16> pool16_;
  std::vector<pending> pending_;
  int pending_leaves_ = 0, grad_buf_ = -1;
  gathered held_, next_;
  std::vector<event> traces_[2];       // [0] training passes, [1] forward-only passes
  bool recordings_[2] = {true, true};
  int kind_ = 0;
  std::vector<event>& trace() noexcept { return traces_[kind_]; }
  bool& recording() noexcept { return recordings_[kind_]; }
  std::size_t pos_ = 0, rerecords_ = 0;
  bool dry_ = false, accumulate_ = false;
};

}  // namespace whale::detail
