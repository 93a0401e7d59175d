// Point-to-point messages between pipeline stages: sends that never block
// (copied into a pool of outgoing buffers), receives posted into per-slot
// buffers as soon as their activation slot is free, progress polling. No
// model knowledge; compiled once.
//
// With the stage in a device's memory, messages take one of two ways:
// - the device's own communicator over the pipe group (open_channels; NCCL on
//   a GPU), one for every message of the stage, so its operations run one at
//   a time on its one stream. Every rank issues its sends and receives in the
//   one order all ranks agree on (message_order in strategy/schedule.hpp: by
//   the replay's round in which the receiver reads the message, then by the
//   receiving rank): before each action, those read by its round or earlier;
//   the rest at the pass's end. The first message not yet done then has both
//   ends at the head of their queues, so no operation waits for a later one:
//   the pipeline never needs two NCCL kernels resident at once, and a host
//   that waits for nothing cannot hold it up. A send is copied into a pooled
//   device buffer and sent from there when its turn comes; a receive lands
//   straight in the slot's device buffer, just before the action that reads
//   it, and the device's queue (not the host) waits for it
//   (device_comm::request::join). Pairs match by issue order, as NCCL
//   matches them, which holds where the schedule sends each link's messages
//   in the order they are read (schedule_report::in_order, true for the
//   built-in schedules); a step whose schedule does not takes host copies.
// - otherwise through host copies, by MPI: a send is copied down into its
//   outgoing buffer, a receive lands in a host buffer of its slot and is
//   copied up into the slot's device buffer when it is read.
#pragma once

#include <deque>
#include <limits>
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
#include "whale/strategy/schedule.hpp"

namespace whale::detail {

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
  /// The device's own communicator over the pipe group (`dev`; needs 2 pipe
  /// ranks or more): every message of the stage takes it, in message_order().
  void open_channels(std::unique_ptr<device_comm> dev) {
    if (!dev) return;
    close_channels();
    if (dev->size() < 2) throw std::logic_error("whale::messenger: device channels need two pipe ranks or more");
    pipe_dev_ = std::move(dev);
  }
  messenger() = default;
  messenger(messenger&&) = default;  // (the moved-from one holds nothing to close)
  messenger& operator=(messenger&&) = delete;
  ~messenger() { close_channels(); }
  /// Whether this step's messages take the device's own channels: they are
  /// open, and the schedule sends each link's messages in the order they are read.
  bool channels() const noexcept { return use_; }
  /// The device communicator's traffic (its operations and bytes).
  comm_stats channel_traffic() const { return pipe_dev_ ? pipe_dev_->stats() : comm_stats{}; }
  /// The host's waits for its operations (device_comm::host_waits).
  std::int64_t channel_host_waits() const { return pipe_dev_ ? pipe_dev_->host_waits() : 0; }
  /// With channels, set each step after start_step(): this rank's messages of
  /// the step in message_order() (kept by the caller until the step ends).
  void set_order(const std::vector<pipe_op>& ops) noexcept { ops_ = &ops; }
  /// With channels, before each action: issue the messages read by round
  /// `round` or earlier (message_order()), those not issued yet.
  void issue_through(int round) {
    while (ops_ && issued_ < ops_->size() && (*ops_)[issued_].round <= round) issue((*ops_)[issued_++]);
  }
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
    if (channels()) {
      ops_ = nullptr;
      issued_ = 0;
      cap_ = slots;
      for (auto& o : dev_out_) o.queued = false;  // (a step cut short by an exception leaves some queued)
      for (int k = 0; k < 2; ++k) {
        waiting_[k].assign(static_cast<std::size_t>(keys), pending{});
        dreq_[k].clear();
        dreq_[k].resize(static_cast<std::size_t>(keys));
        recv_issued_[k].assign(static_cast<std::size_t>(keys), 0);
        ready_[k].clear();
      }
    }
  }
  /// Post pass `key`'s receives into slot `slot`: its activation and (a training step) its gradient.
  void post(int key, int slot, const peer_msg& act, const peer_msg& grad) {
    const auto k = static_cast<std::size_t>(key), sl = static_cast<std::size_t>(slot);
    if (channels()) {  // issued in message_order(), just before the action that reads it
      if (act.on) waiting_[0][k] = {true, slot, act};
      if (grad.on) waiting_[1][k] = {true, slot, grad};
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
  /// What a pipeline message carries.
  enum class message_kind { activation, gradient };
  /// Send `v` to pipe rank `dst` without blocking (copied into a pooled
  /// buffer): an activation, or an input gradient, of `width` columns (the
  /// receiver reads rows x width).
  void send(cview<float> v, int dst, int tag, message_kind kind, index_t width) {
    if (channels()) {
      if (v.numel() != rows_ * width)  // NCCL needs a message's two ends to agree on its size
        throw std::logic_error("whale::messenger: a pipeline message of " + std::to_string(v.numel()) + " elements, where the receiver reads " +
                               std::to_string(rows_) + " x " + std::to_string(width));
      // a free outgoing buffer; at the cap (one per activation slot, as the memory plan counts), the
      // oldest one whose send is issued, once the device's queue has joined that send: the host runs
      // ahead of the device and would otherwise find few sends done
      std::size_t at = 0;
      while (at < dev_out_.size() && (dev_out_[at].queued || !dev_out_[at].req.test())) ++at;
      if (at == dev_out_.size() && static_cast<int>(dev_out_.size()) >= cap_) {
        std::size_t oldest = dev_out_.size();
        for (std::size_t i = 0; i < dev_out_.size(); ++i)
          if (!dev_out_[i].queued && (oldest == dev_out_.size() || dev_out_[i].seq < dev_out_[oldest].seq)) oldest = i;
        if (oldest < dev_out_.size()) {
          dev_out_[oldest].req.join();
          at = oldest;
        }
      }
      if (at == dev_out_.size()) dev_out_.emplace_back();
      auto& ob = dev_out_[at];
      {
        const place_scope on(be_.memory());
        ensure(ob.buf, v.shape(), mem_kind::comm);
      }
      be_.copy(ob.buf.data(), v.data(), v.bytes());  // on the compute stream; the send follows it
      ob.queued = true;
      ob.dst = dst;
      ob.n = v.numel();
      ready_[kind == message_kind::gradient ? 1 : 0].push_back(at);  // sent when its turn in message_order() comes
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
  /// The step's last messages issued; every send complete.
  void flush() {
    if (channels()) {
      issue_through(std::numeric_limits<int>::max());
      if (!ready_[0].empty() || !ready_[1].empty())
        throw std::logic_error("whale::messenger: a pipeline message was sent that this rank's message order does not list");
    }
    for (auto& o : dev_out_) o.req.join();  // the device's queue follows the sends (their buffers are reused in its order)
    for (auto& o : out_)
      if (o.req) o.req->wait(), o.req.reset();
  }

 private:
  void close_channels() noexcept {
    for (auto& kind : dreq_) kind.clear();  // the operations before their communicator
    dev_out_.clear();
    pipe_dev_.reset();
    use_ = false;
  }
  struct pending {
    bool on = false;  // posted: its slot is free
    int slot = 0;
    peer_msg msg;
  };
  /// One message of message_order(), on the pipe group's device communicator.
  void issue(const pipe_op& op) {
    const auto k = static_cast<std::size_t>(op.kind);
    if (op.send) {
      auto& q = ready_[k];
      if (q.empty())
        throw std::logic_error("whale::messenger: the message order sends a" + std::string(op.kind ? " gradient" : "n activation") +
                               " to pipe rank " + std::to_string(op.peer) + " before the stage made it");
      auto& ob = dev_out_[q.front()];
      q.pop_front();
      if (ob.dst != op.peer)
        throw std::logic_error("whale::messenger: the stage sent to pipe rank " + std::to_string(ob.dst) +
                               " where the message order sends to " + std::to_string(op.peer));
      ob.queued = false;
      ob.seq = ++sent_;
      ob.req = pipe_dev_->isend(ob.buf.data(), ob.n, dtype::f32, op.peer, 0);
      return;
    }
    const auto key = static_cast<std::size_t>(op.key);
    const auto& w = waiting_[k][key];
    if (!w.on || w.msg.rank != op.peer)
      throw std::logic_error("whale::messenger: pass " + std::to_string(op.key) + "'s receive from pipe rank " + std::to_string(op.peer) +
                             " comes before its slot was posted");
    auto& slots = k == 0 ? xin_ : gin_;
    recv_issued_[k][key] = 1;
    dreq_[k][key] = pipe_dev_->irecv(slots[static_cast<std::size_t>(w.slot)].data(), rows_ * w.msg.width, dtype::f32, op.peer, 0);
  }
  /// Kind `k`'s message of pass `key`, in its slot: issued by now (issue_through its reader's round), joined.
  cview<float> received(int k, int key, std::vector<tensor<float>>& slots, int slot, index_t width) {
    if (!recv_issued_[k][static_cast<std::size_t>(key)])
      throw std::logic_error("whale::messenger: pass " + std::to_string(key) + " reads a message not issued on the device communicator "
                                                                               "(read before its round came in the message order)");
    dreq_[k][static_cast<std::size_t>(key)].join();  // the kernels that read the slot follow the receive
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
  // the device's own communicator over the pipe group (open_channels)
  struct dev_outbox {
    tensor<float> buf;          // in the device's memory
    device_comm::request req;   // its send; complete when the buffer is free
    bool queued = false;        // made, not yet issued
    int dst = 0;                // its pipe rank
    index_t n = 0;              // its elements
    std::uint64_t seq = 0;      // when its send was issued
  };
  std::unique_ptr<device_comm> pipe_dev_;  // the pipe group's device communicator: every message, in message_order()
  bool use_ = false;                       // this step's messages take it
  const std::vector<pipe_op>* ops_ = nullptr;  // this rank's messages of the step, in order
  std::size_t issued_ = 0;                     // how many of them are issued
  int cap_ = 1;                                // outgoing buffers kept (more only while all hold unissued sends)
  std::uint64_t sent_ = 0;                     // sends issued so far
  std::vector<pending> waiting_[2];            // per kind and key: posted receives
  std::vector<device_comm::request> dreq_[2];  // per kind and key: the receive
  std::vector<char> recv_issued_[2];            // per kind and key: the receive is issued
  std::deque<std::size_t> ready_[2];           // per kind: outboxes made, in the order made, not yet issued
  std::vector<dev_outbox> dev_out_;
};

}  // namespace whale::detail
