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

class messenger {
 public:
  void bind(world_comm& pipe) noexcept { pipe_ = &pipe; }
  /// Per step: m micro-batches, `slots` activation slots of (rows, in_w) inputs
  /// from the previous stage and (rows, out_w) gradients from the next one.
  /// `grads`: a training step (a forward-only pass receives no gradients).
  /// Slot buffers are only ever added, so switching passes allocates nothing.
  void start_step(int m, int slots, index_t rows, index_t in_w, index_t out_w, bool first, bool last, bool grads = true) {
    first_ = first, last_ = last;
    rows_ = rows, in_w_ = in_w, out_w_ = out_w;
    const auto n = static_cast<std::size_t>(slots);
    if (!first) {
      if (xin_.size() < n) xin_.resize(n);
      for (std::size_t i = 0; i < n; ++i) ensure(xin_[i], {rows, in_w}, mem_kind::activations);
    }
    if (!last && grads) {
      if (gin_.size() < n) gin_.resize(n);
      for (std::size_t i = 0; i < n; ++i) ensure(gin_[i], {rows, out_w}, mem_kind::comm);
    }
    act_.clear(), grad_.clear();
    act_.resize(static_cast<std::size_t>(m)), grad_.resize(static_cast<std::size_t>(m));
  }
  /// Post micro-batch j's receives into slot `slot` (tags 2j: activation, 2j+1: gradient).
  /// `grads`: also the gradient (a training step; a forward-only pass has none).
  void post(int j, int slot, int stage, bool grads = true) {
    const auto ju = static_cast<std::size_t>(j), sl = static_cast<std::size_t>(slot);
    if (!first_) act_[ju].emplace(pipe_->irecv(xin_[sl].data(), rows_ * in_w_, dtype::f32, stage - 1, 2 * j));
    if (!last_ && grads) grad_[ju].emplace(pipe_->irecv(gin_[sl].data(), rows_ * out_w_, dtype::f32, stage + 1, 2 * j + 1));
  }
  cview<float> activation(int j, int slot) {
    act_[static_cast<std::size_t>(j)]->wait();
    return xin_[static_cast<std::size_t>(slot)].v();
  }
  cview<float> gradient(int j, int slot) {
    grad_[static_cast<std::size_t>(j)]->wait();
    return gin_[static_cast<std::size_t>(slot)].v();
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
  bool first_ = true, last_ = true;
  index_t rows_ = 0, in_w_ = 0, out_w_ = 0;
  std::vector<tensor<float>> xin_, gin_;
  std::vector<std::optional<world_comm::request>> act_, grad_;
  std::vector<outbox> out_;
};

}  // namespace whale::detail
