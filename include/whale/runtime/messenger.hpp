// Point-to-point messages between pipeline stages: sends that never block
// (copied into a pool of outgoing buffers), receives posted into per-slot
// buffers as soon as their activation slot is free, progress polling. No
// model knowledge; compiled once.
//
// With the stage in a device's memory, messages take one of two ways:
// - the device's own channels (open_channels; NCCL on a GPU): one
//   communicator per pipe rank, direction and kind (activations go to the
//   next pipe rank, gradients to the previous one), each with its own stream,
//   on which a pair's messages match in the order they are issued, as NCCL
//   matches them. A send is copied into a pooled device buffer and sent from
//   there; each channel's receives are issued in the order the stage reads
//   them (order()), each as soon as its slot is free and every earlier one is
//   issued, straight into the slot's device buffer. Both ends agree when the
//   schedule sends each link's messages in the order they are read
//   (schedule_report::in_order, true for the built-in schedules); a step
//   whose schedule does not takes host copies. A blocked receive holds up
//   only its own channel.
// - otherwise through host copies, by MPI: a send is copied down into its
//   outgoing buffer, a receive lands in a host buffer of its slot and is
//   copied up into the slot's device buffer when it is read.
#pragma once

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/comm/device_comm.hpp"
#include "whale/nn/layer.hpp"

namespace whale::detail {

/// Test hook: on a host-executed backend (the guarded one), issue each channel
/// receive ahead, as on a GPU, instead of when the stage reads it. Off by
/// default there, since an operation in flight keeps the guarded region open
/// to host code; tests/mpi_device.cpp runs every pipeline both ways.
inline bool issue_ahead_on_host = false;

/// One receive of a micro-batch pass: from pipe rank `rank` with `tag`, (rows, width) floats.
struct peer_msg {
  bool on = false;
  int rank = 0, tag = 0;
  index_t width = 0;
};

class messenger {
 public:
  /// `be`: where the stage computes; on a device, the slots are there and
  /// messages are staged through the host unless open_channels() is called.
  void bind(world_comm& pipe, const backend_ref& be = {}) noexcept {
    pipe_ = &pipe;
    be_ = be;
  }
  /// The device's own channels between pipe ranks, split from `dev`, the
  /// device's communicator over the pipe group (collective over it; every
  /// rank of the group calls it). Needs 2 pipe ranks or more. `wrap`: also
  /// the links around the ring, from the last pipe rank to the first and back
  /// (interleaved schedules).
  void open_channels(std::unique_ptr<device_comm> dev, bool wrap) {
    if (!dev) return;
    close_channels();
    const int P = dev->size(), me = dev->rank();
    if (P < 2) throw std::logic_error("whale::messenger: device channels need two pipe ranks or more");
    tensor<float> one;  // each channel's first message (NCCL connects a pair on its first exchange, both ends waiting)
    {
      const place_scope on(be_.memory());
      one = tensor<float>({1}, mem_kind::comm);
    }
    be_.fill_zero(one.data(), sizeof(float));
    for (int k = 0; k < 2; ++k) {
      out_ch_[k].assign(static_cast<std::size_t>(P), -1), in_ch_[k].assign(static_cast<std::size_t>(P), -1);
      for (int src = 0; src < P; ++src) {  // activations to src + 1, gradients to src - 1
        const int dst = k == 0 ? (src + 1) % P : (src + P - 1) % P;
        if (!wrap && (k == 0 ? dst < src : dst > src)) continue;  // (the same on every rank)
        const bool member = me == src || me == dst;
        auto c = dev->split(member ? 0 : -1, me == src ? 0 : 1);  // the sender is rank 0 of the pair
        if (!member) continue;
        // connected now, by both ends at once: a first receive issued later, before the peer's first
        // send on it, would otherwise hold this rank's thread in NCCL's connection setup
        auto r = me == src ? c.isend(one.data(), 1, dtype::f32, 1, 0) : c.irecv(one.data(), 1, dtype::f32, 0, 0);
        r.wait();
        (me == src ? out_ch_[k][static_cast<std::size_t>(dst)] : in_ch_[k][static_cast<std::size_t>(src)]) =
            static_cast<int>(chans_.size());
        chans_.push_back(std::move(c));
      }
    }
    pipe_dev_ = std::move(dev);
  }
  messenger() = default;
  messenger(messenger&&) = default;  // (the moved-from one holds nothing to close)
  messenger& operator=(messenger&&) = delete;
  ~messenger() { close_channels(); }
  /// Whether this step's messages take the device's own channels: they are
  /// open, and the schedule sends each link's messages in the order they are read.
  bool channels() const noexcept { return use_; }
  /// The channels' traffic (their operations and bytes; the first message of each, sent when it opens, included).
  comm_stats channel_traffic() const {
    comm_stats t;
    for (const auto& c : chans_) t += c.stats();
    return t;
  }
  /// With channels, set each step after start_step(): the keys of the passes
  /// that receive an activation (kind 0) or a gradient (kind 1), in the order
  /// the stage reads them.
  std::vector<int>& order(int kind) { return order_[kind]; }
  /// Per step: `keys` micro-batch passes (micro-batches × chunks), `slots`
  /// activation slots of up to (rows, in_w) inputs and (rows, out_w) gradients;
  /// `acts` / `grads`: whether any pass receives an activation / a gradient.
  /// Slot buffers are only ever added, so switching passes allocates nothing.
  /// `in_order`: the schedule sends each link's messages in the order the
  /// receiver reads them (schedule_report::in_order); if not, this step's
  /// messages go through host copies even where channels are open.
  void start_step(int keys, int slots, index_t rows, index_t in_w, index_t out_w, bool acts, bool grads, bool in_order = true) {
    rows_ = rows;
    use_ = pipe_dev_ != nullptr && in_order;
    const auto n = static_cast<std::size_t>(slots);
    auto slots_of = [&](std::vector<tensor<float>>& dev, std::vector<tensor<float>>& host, index_t w, mem_kind k) {
      if (dev.size() < n) dev.resize(n);
      {
        const place_scope on(be_.memory());
        for (std::size_t i = 0; i < n; ++i) ensure(dev[i], {rows, w}, k);
      }
      if (be_.on_cpu() || channels()) return;
      if (host.size() < n) host.resize(n);
      const place_scope on_host(nullptr);
      for (std::size_t i = 0; i < n; ++i) ensure(host[i], {rows, w}, mem_kind::comm);
    };
    if (acts) slots_of(xin_, xin_host_, in_w, mem_kind::activations);
    if (grads) slots_of(gin_, gin_host_, out_w, mem_kind::comm);
    act_.clear(), grad_.clear();
    act_.resize(static_cast<std::size_t>(keys)), grad_.resize(static_cast<std::size_t>(keys));
    if (channels())
      for (int k = 0; k < 2; ++k) {
        order_[k].clear();
        issued_[k] = 0;
        waiting_[k].assign(static_cast<std::size_t>(keys), pending{});
        dreq_[k].clear();
        dreq_[k].resize(static_cast<std::size_t>(keys));
      }
  }
  /// Post pass `key`'s receives into slot `slot`: its activation and (a training step) its gradient.
  void post(int key, int slot, const peer_msg& act, const peer_msg& grad) {
    const auto k = static_cast<std::size_t>(key), sl = static_cast<std::size_t>(slot);
    if (channels()) {  // issued in the order the stage reads them, once every earlier one is
      if (act.on) waiting_[0][k] = {true, slot, act};
      if (grad.on) waiting_[1][k] = {true, slot, grad};
      // (on a host-executed backend, when read: an operation in flight keeps its memory open to host code)
      if (!lazy()) issue(0), issue(1);
      return;
    }
    auto& xin = be_.on_cpu() ? xin_ : xin_host_;
    auto& gin = be_.on_cpu() ? gin_ : gin_host_;
    if (act.on) act_[k].emplace(pipe_->irecv(xin[sl].data(), rows_ * act.width, dtype::f32, act.rank, act.tag));
    if (grad.on) grad_[k].emplace(pipe_->irecv(gin[sl].data(), rows_ * grad.width, dtype::f32, grad.rank, grad.tag));
  }
  cview<float> activation(int key, int slot, index_t width) {
    if (channels()) return received(0, key, xin_, slot, width);
    act_[static_cast<std::size_t>(key)]->wait();
    return arrived(xin_, xin_host_, slot, width);
  }
  cview<float> gradient(int key, int slot, index_t width) {
    if (channels()) return received(1, key, gin_, slot, width);
    grad_[static_cast<std::size_t>(key)]->wait();
    return arrived(gin_, gin_host_, slot, width);
  }
  /// Send `v` to pipe rank `dst` without blocking (copied into a pooled
  /// buffer): an activation, or (`gradient`) an input gradient, of `width`
  /// columns (the receiver reads rows x width).
  void send(cview<float> v, int dst, int tag, bool gradient, index_t width) {
    if (channels()) {
      if (v.numel() != rows_ * width)  // NCCL needs a message's two ends to agree on its size
        throw std::logic_error("whale::messenger: a pipeline message of " + std::to_string(v.numel()) + " elements, where the receiver reads " +
                               std::to_string(rows_) + " x " + std::to_string(width));
      auto& ch = channel(out_ch_[gradient ? 1 : 0], dst, "to");
      dev_outbox* ob = nullptr;
      for (auto& o : dev_out_)
        if (o.req.test()) {
          ob = &o;
          break;
        }
      if (!ob) ob = &dev_out_.emplace_back();
      {
        const place_scope on(be_.memory());
        ensure(ob->buf, v.shape(), mem_kind::comm);
      }
      be_.copy(ob->buf.data(), v.data(), v.bytes());  // on the compute stream; the send follows it
      ob->req = ch.isend(ob->buf.data(), v.numel(), dtype::f32, 1, 0);
      return;
    }
    outbox* ob = nullptr;
    for (auto& o : out_)
      if (!o.req || o.req->test()) {
        o.req.reset();
        ob = &o;
        break;
      }
    if (!ob) ob = &out_.emplace_back();
    const place_scope on_host(nullptr);  // what MPI reads: host memory
    ensure(ob->buf, v.shape(), mem_kind::comm);
    if (be_.on_cpu()) {
      copy(v, ob->buf.v());
    } else {
      be_.copy(ob->buf.data(), v.data(), v.bytes());
      be_.synchronize();
    }
    ob->req.emplace(pipe_->isend(ob->buf.data(), v.numel(), dtype::f32, dst, tag));
  }
  /// Poll outstanding messages so that MPI moves them while this rank computes.
  void progress() {
    for (auto& o : dev_out_) o.req.test();
    for (auto& kind : dreq_)
      for (auto& r : kind) r.test();
    for (auto& o : out_)
      if (o.req && o.req->test()) o.req.reset();
    for (auto& r : act_)
      if (r) r->test();
    for (auto& r : grad_)
      if (r) r->test();
  }
  /// Every send complete.
  void flush() {
    for (auto& o : dev_out_) o.req.wait();
    for (auto& o : out_)
      if (o.req) o.req->wait(), o.req.reset();
  }

 private:
  /// Whether receives are issued when read (a host-executed backend), not ahead.
  bool lazy() const noexcept { return be_.host_executed() && !issue_ahead_on_host; }
  /// The channels closed in the order they were opened, the same on every rank
  /// (closing an MPI communicator is collective over it).
  void close_channels() noexcept {
    for (auto& kind : dreq_) kind.clear();  // the operations before their communicators
    dev_out_.clear();
    for (auto& c : chans_) c = device_comm{};
    chans_.clear();
    pipe_dev_.reset();
    use_ = false;
  }
  device_comm& channel(const std::vector<int>& of, int peer, const char* dir) {
    const int i = peer >= 0 && static_cast<std::size_t>(peer) < of.size() ? of[static_cast<std::size_t>(peer)] : -1;
    if (i < 0) throw std::logic_error(std::string("whale::messenger: no device channel ") + dir + " pipe rank " + std::to_string(peer));
    return chans_[static_cast<std::size_t>(i)];
  }
  struct pending {
    bool on = false;  // posted: its slot is free
    int slot = 0;
    peer_msg msg;
  };
  /// Issue kind `k`'s receives in reading order while the next one's slot is
  /// free, up to pass `upto` (-1: as far as the slots allow).
  void issue(int k, int upto = -1) {
    auto& ord = order_[k];
    while (issued_[k] < ord.size()) {
      if (upto >= 0 && issued_[k] > 0 && ord[issued_[k] - 1] == upto) return;
      const auto key = static_cast<std::size_t>(ord[issued_[k]]);
      const auto& w = waiting_[k][key];
      if (!w.on) return;
      auto& ch = channel(in_ch_[k], w.msg.rank, "from");
      auto& slots = k == 0 ? xin_ : gin_;
      dreq_[k][key] = ch.irecv(slots[static_cast<std::size_t>(w.slot)].data(), rows_ * w.msg.width, dtype::f32, 0, 0);
      ++issued_[k];
    }
  }
  /// Kind `k`'s message of pass `key`, in its slot: issued by now (the stage reads in order()), waited for.
  cview<float> received(int k, int key, std::vector<tensor<float>>& slots, int slot, index_t width) {
    issue(k, lazy() ? key : -1);
    const auto& ord = order_[k];
    std::size_t at = 0;
    while (at < issued_[k] && ord[at] != key) ++at;
    if (at == issued_[k])
      throw std::logic_error("whale::messenger: pass " + std::to_string(key) + " reads a message not issued on its device channel "
                                                                               "(read out of order, or before its slot was posted)");
    dreq_[k][static_cast<std::size_t>(key)].wait();
    return cview<float>(slots[static_cast<std::size_t>(slot)].data(), {rows_, width});
  }
  /// A received message in slot `slot`: on a device, its host copy copied up first.
  cview<float> arrived(std::vector<tensor<float>>& dev, std::vector<tensor<float>>& host, int slot, index_t width) {
    const auto sl = static_cast<std::size_t>(slot);
    if (!be_.on_cpu()) {
      be_.copy(dev[sl].data(), host[sl].data(), static_cast<std::size_t>(rows_ * width) * sizeof(float));
      be_.synchronize();  // the host buffer takes the slot's next message
    }
    return cview<float>(dev[sl].data(), {rows_, width});
  }
  struct outbox {
    tensor<float> buf;
    std::optional<world_comm::request> req;
  };
  world_comm* pipe_ = nullptr;
  backend_ref be_;  // where the stage's slots are (a device: messages are staged through the host)
  index_t rows_ = 0;
  std::vector<tensor<float>> xin_, gin_;            // the slots, in the stage's memory
  std::vector<tensor<float>> xin_host_, gin_host_;  // on a device: where their messages land
  std::vector<std::optional<world_comm::request>> act_, grad_;
  std::vector<outbox> out_;
  // the device's own channels (open_channels): [kind][pipe rank], valid where a pair exchanges that kind
  struct dev_outbox {
    tensor<float> buf;          // in the device's memory
    device_comm::request req;   // its send; complete when the buffer is free
  };
  std::unique_ptr<device_comm> pipe_dev_;
  bool use_ = false;                        // this step's messages take the channels
  std::vector<device_comm> chans_;          // in the order they were split, the same on every rank
  std::vector<int> out_ch_[2], in_ch_[2];   // [kind][pipe rank]: the index in chans_ of the channel to / from it, or -1
  std::vector<int> order_[2];               // per kind: the keys in reading order
  std::size_t issued_[2] = {0, 0};          // per kind: how many of order_ are issued
  std::vector<pending> waiting_[2];         // per kind and key: posted receives
  std::vector<device_comm::request> dreq_[2];
  std::vector<dev_outbox> dev_out_;
};

}  // namespace whale::detail
