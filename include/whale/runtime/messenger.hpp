// Point-to-point messages between pipeline stages: sends that never block
// (copied into a pool of outgoing buffers), receives posted into per-slot
// buffers as soon as their activation slot is free, progress polling. No
// model knowledge; compiled once.
#pragma once

#include <optional>
#include <vector>

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
  void bind(world_comm& pipe) noexcept { pipe_ = &pipe; }
  /// Per step: `keys` micro-batch passes (micro-batches × chunks), `slots`
  /// activation slots of up to (rows, in_w) inputs and (rows, out_w) gradients;
  /// `acts` / `grads`: whether any pass receives an activation / a gradient.
  /// Slot buffers are only ever added, so switching passes allocates nothing.
  void start_step(int keys, int slots, index_t rows, index_t in_w, index_t out_w, bool acts, bool grads) {
    rows_ = rows;
    const auto n = static_cast<std::size_t>(slots);
    if (acts) {
      if (xin_.size() < n) xin_.resize(n);
      for (std::size_t i = 0; i < n; ++i) ensure(xin_[i], {rows, in_w}, mem_kind::activations);
    }
    if (grads) {
      if (gin_.size() < n) gin_.resize(n);
      for (std::size_t i = 0; i < n; ++i) ensure(gin_[i], {rows, out_w}, mem_kind::comm);
    }
    act_.clear(), grad_.clear();
    act_.resize(static_cast<std::size_t>(keys)), grad_.resize(static_cast<std::size_t>(keys));
  }
  /// Post pass `key`'s receives into slot `slot`: its activation and (a training step) its gradient.
  void post(int key, int slot, const peer_msg& act, const peer_msg& grad) {
    const auto k = static_cast<std::size_t>(key), sl = static_cast<std::size_t>(slot);
    if (act.on) act_[k].emplace(pipe_->irecv(xin_[sl].data(), rows_ * act.width, dtype::f32, act.rank, act.tag));
    if (grad.on) grad_[k].emplace(pipe_->irecv(gin_[sl].data(), rows_ * grad.width, dtype::f32, grad.rank, grad.tag));
  }
  cview<float> activation(int key, int slot, index_t width) {
    act_[static_cast<std::size_t>(key)]->wait();
    return cview<float>(xin_[static_cast<std::size_t>(slot)].data(), {rows_, width});
  }
  cview<float> gradient(int key, int slot, index_t width) {
    grad_[static_cast<std::size_t>(key)]->wait();
    return cview<float>(gin_[static_cast<std::size_t>(slot)].data(), {rows_, width});
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
    ensure(ob->buf, v.shape(), mem_kind::comm);
    copy(v, ob->buf.v());
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
  struct outbox {
    tensor<float> buf;
    std::optional<world_comm::request> req;
  };
  world_comm* pipe_ = nullptr;
  index_t rows_ = 0;
  std::vector<tensor<float>> xin_, gin_;
  std::vector<std::optional<world_comm::request>> act_, grad_;
  std::vector<outbox> out_;
};

}  // namespace whale::detail
