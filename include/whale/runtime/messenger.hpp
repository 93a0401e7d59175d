// Point-to-point messages between pipeline stages: sends that never block
// (copied into a pool of outgoing buffers), receives posted into per-slot
// buffers as soon as their activation slot is free, progress polling. With
// the stage in a device's memory, messages travel through host copies: a send
// is copied down into its outgoing buffer, a receive lands in a host buffer of
// its slot and is copied up into the slot's device buffer when it is read. No
// model knowledge; compiled once.
#pragma once

#include <optional>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/nn/layer.hpp"

namespace whale::detail {

/// One receive of a micro-batch pass: from pipe rank `rank` with `tag`, (rows, width) floats.
struct peer_msg {
  bool on = false;
  int rank = 0, tag = 0;
  index_t width = 0;
};

class messenger {
 public:
  /// `be`: where the stage computes; on a device, the slots are there and messages are staged through the host.
  void bind(world_comm& pipe, const backend_ref& be = {}) noexcept {
    pipe_ = &pipe;
    be_ = be;
  }
  /// Per step: `keys` micro-batch passes (micro-batches × chunks), `slots`
  /// activation slots of up to (rows, in_w) inputs and (rows, out_w) gradients;
  /// `acts` / `grads`: whether any pass receives an activation / a gradient.
  /// Slot buffers are only ever added, so switching passes allocates nothing.
  void start_step(int keys, int slots, index_t rows, index_t in_w, index_t out_w, bool acts, bool grads) {
    rows_ = rows;
    const auto n = static_cast<std::size_t>(slots);
    auto slots_of = [&](std::vector<tensor<float>>& dev, std::vector<tensor<float>>& host, index_t w, mem_kind k) {
      if (dev.size() < n) dev.resize(n);
      {
        const place_scope on(be_.memory());
        for (std::size_t i = 0; i < n; ++i) ensure(dev[i], {rows, w}, k);
      }
      if (be_.on_cpu()) return;
      if (host.size() < n) host.resize(n);
      const place_scope on_host(nullptr);
      for (std::size_t i = 0; i < n; ++i) ensure(host[i], {rows, w}, mem_kind::comm);
    };
    if (acts) slots_of(xin_, xin_host_, in_w, mem_kind::activations);
    if (grads) slots_of(gin_, gin_host_, out_w, mem_kind::comm);
    act_.clear(), grad_.clear();
    act_.resize(static_cast<std::size_t>(keys)), grad_.resize(static_cast<std::size_t>(keys));
  }
  /// Post pass `key`'s receives into slot `slot`: its activation and (a training step) its gradient.
  void post(int key, int slot, const peer_msg& act, const peer_msg& grad) {
    const auto k = static_cast<std::size_t>(key), sl = static_cast<std::size_t>(slot);
    auto& xin = be_.on_cpu() ? xin_ : xin_host_;
    auto& gin = be_.on_cpu() ? gin_ : gin_host_;
    if (act.on) act_[k].emplace(pipe_->irecv(xin[sl].data(), rows_ * act.width, dtype::f32, act.rank, act.tag));
    if (grad.on) grad_[k].emplace(pipe_->irecv(gin[sl].data(), rows_ * grad.width, dtype::f32, grad.rank, grad.tag));
  }
  cview<float> activation(int key, int slot, index_t width) {
    act_[static_cast<std::size_t>(key)]->wait();
    return arrived(xin_, xin_host_, slot, width);
  }
  cview<float> gradient(int key, int slot, index_t width) {
    grad_[static_cast<std::size_t>(key)]->wait();
    return arrived(gin_, gin_host_, slot, width);
  }
  /// Send `v` to pipe rank `dst` without blocking (copied into a pooled buffer).
  void send(cview<float> v, int dst, int tag) {
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
    for (auto& o : out_)
      if (o.req && o.req->test()) o.req.reset();
    for (auto& r : act_)
      if (r) r->test();
    for (auto& r : grad_)
      if (r) r->test();
  }
  /// Every send complete.
  void flush() {
    for (auto& o : out_)
      if (o.req) o.req->wait(), o.req.reset();
  }

 private:
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
};

}  // namespace whale::detail
