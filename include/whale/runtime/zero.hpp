// ZeRO over the data axis for any flat parameter range, compiled once (no
// model types): each data rank owns a near-even contiguous range of the
// range; level 2 reduce-scatters each leaf's gradients into the owners as its
// backward ends, level 3 also all-gathers each leaf's parameters just before
// it runs (prefetching the next one, in the order of the step's program, or
// for passes it does not describe in the order recorded on their first) and
// frees them after. Levels 1–2 all-gather the parameters after the update.
// The executor binds the layers and owns the full buffers of levels 1–2. With
// the stage in a device's memory (set_backend), the owned shards and the
// buffers layers bind are there. With the device's own communicator (NCCL on
// a GPU) every collective takes those buffers themselves. Without one, each
// runs on host twins of them: a gather lands in its buffer's host twin and is
// copied up when a layer needs it; a leaf's gradients are copied down,
// reduce-scattered into a host piece, and copied (or added) into the owned
// gradients on completion. The larger members are in runtime/zero_impl.hpp.
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
#include "whale/detail/compiled.hpp"
#include "whale/nn/layer.hpp"
#include "whale/plan/partition.hpp"
#include "whale/plan/program.hpp"

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
  void setup(world_comm& data, int level, index_t base, index_t n, options o);
  int level() const noexcept { return level_; }
  index_t begin() const noexcept { return begin_; }  ///< owned range, relative to base
  index_t end() const noexcept { return end_; }
  index_t local_count() const noexcept { return end_ - begin_; }
  const std::vector<index_t>& counts() const noexcept { return counts_; }
  view<float> shard_params() const noexcept { return shard_params_.v(); }
  view<float> shard_grads() const noexcept { return shard_grads_.v(); }
  std::size_t comm_buffers() const noexcept { return pool_.size() + pool16_.size(); }
  /// Level 3: how often a pass asked for parameters in an order other than the
  /// one known for its kind (each such pass prefetches nothing from there on).
  std::size_t rerecords() const noexcept { return rerecords_; }
  /// Levels 1–2: where leaves find their parameters between uses.
  void set_full_params(float* p) noexcept { full_params_ = p; }

  /// Which kind of pass asks for parameters: training and forward-only passes
  /// ask in different orders; each kind keeps its own recorded order, so
  /// alternating them prefetches.
  enum class pass_kind { training, forward_only };
  /// Level 3: the order a pass of `kind` uses the leaves in, as the step's
  /// program lists them (program::leaf_uses; offsets relative to the range's
  /// base): passes of that kind prefetch from it from their first, and the
  /// pool takes the buffers of their gathers and gradients now. A pass that asks otherwise
  /// records its own order (rerecords()).
  void follow(pass_kind kind, const std::vector<leaf_use>& uses);
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
  void set_backend(const backend_ref& be, device_comm* dev = nullptr);
  /// Levels 1–2 after the update of the owned range: every rank gets all parameters.
  void gather_after_update(float* full);
  /// All n parameters into `out`, host memory (collective at level 3).
  void gather_params(view<float> out) const;

 private:
  struct leaf_info {
    index_t offset = 0, count = 0;  // relative to base
    std::vector<index_t> counts;
    index_t mine_at = 0, mine = 0;
  };
  const leaf_info& info(index_t global_offset, index_t count);

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
  void wait_oldest();

  struct gathered {
    index_t offset = -1, count = 0;
    int buf = -1;
    std::optional<world_comm::request> req;
    device_comm::request dreq{};  // on a device with its own communicator
  };
  void start_gather(gathered& g, const leaf_info& l);
  void drop(gathered& g);

  // The order in which leaves ask for their parameters: the program's (follow), or
  // recorded in the first pass of its kind; used to prefetch (a change of order re-records).
  struct event {
    index_t offset;
    bool backward;
    friend bool operator==(const event&, const event&) = default;
  };
  float* gather_for(const leaf_info& l, event ev);
  void done_with(const leaf_info& l);

  void before_forward(const leaf_ref& r);
  void after_forward(const leaf_ref& r);
  void before_backward(const leaf_ref& r);
  // Reduce-scatter the leaf's gradients into the owners, non-blocking, in buckets.
  void scatter_grads(const leaf_info& l);
  void after_backward(const leaf_ref& r);
  void finish_pass();
  // After a pass that recorded the order: replay its buffer traffic (with
  // prefetching) without communicating, so the pool holds every buffer later passes take.
  void rehearse();

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

#if WHALE_CORE_DEFINITIONS  // header-only, or the compiled core's own unit (detail/compiled.hpp)
#include "whale/runtime/zero_impl.hpp"
#endif
