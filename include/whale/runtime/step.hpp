// One step of executor<P> (runtime/executor.hpp): its input checked and, on a
// device, copied up; then executor_core walks the schedule (runtime/pass.hpp),
// asking this rank's chunks for their forward and backward passes.
// forward(inputs) is a pass without training that keeps the last stage's output.
#pragma once

#include <array>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "whale/runtime/executor.hpp"

namespace whale {

template <class P>
double executor<P>::pass(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels, detail::pass_mode mode,
                         tensor<float>* logits) {
  c.be = be_;
  const index_t B = c.batch;
  const int m = micro_count(B);
  if (x.shape().rank() == 0 || x.shape()[0] != B)
    throw std::invalid_argument(who() + "the input has " +
                                std::to_string(x.shape().rank() ? x.shape()[0] : 0) + " rows but step_ctx says " +
                                std::to_string(B) + " sequences");
  check_pass(c, mode);
  // On a device: everything the pass allocates goes there, and the host's rows are copied up once.
  const place_scope on(be_.memory());
  std::array<step_ctx::host_mirror, 2> mirrors{};  // the layers check token ids and labels on the host copies
  if (!be_.on_cpu()) {
    in_.resize(x.shape());
    be_.copy(in_.data(), x.data(), x.bytes());
    mirrors[0] = {in_.data(), x.data(), static_cast<std::size_t>(x.bytes())};
    x = in_.v();
    if (labels.data()) {
      labels_.resize(labels.shape());
      be_.copy(labels_.data(), labels.data(), labels.bytes());
      mirrors[1] = {labels_.data(), labels.data(), static_cast<std::size_t>(labels.bytes())};
      labels = labels_.v();
    }
  }
  x_ = x;
  return run_pass(c, m, labels, mode, logits, mirrors);
}

template <class P> view<float> executor<P>::chunk_forward(int ch, step_ctx& c, int micro, index_t mb, cview<float> in) {
  return parts_[static_cast<std::size_t>(ch)].forward(c, first_rows(ch, micro, mb), in);
}
template <class P>
double executor<P>::chunk_forward_loss(int ch, step_ctx& c, int micro, index_t mb, cview<float> in, cview<std::int32_t> labels) {
  return parts_[static_cast<std::size_t>(ch)].forward_loss(c, first_rows(ch, micro, mb), in, labels);
}
template <class P> view<float> executor<P>::chunk_logits(int ch, step_ctx& c, int micro, index_t mb, cview<float> in) {
  return parts_[static_cast<std::size_t>(ch)].logits(c, first_rows(ch, micro, mb), in);
}
template <class P> view<float> executor<P>::chunk_backward(int ch, step_ctx& c, cview<float> dy) {
  return parts_[static_cast<std::size_t>(ch)].backward(c, dy);
}

template <class P> tensor<float> executor<P>::forward(step_ctx& c, cview<input_type> x) {
  static_assert(gives_logits(),
                "whale::executor::forward: the model does not end in a plain loss layer (its last element is a "
                "container, e.g. split<sequential<..., Loss>>, whose class-split logits are not gathered there); end "
                "the model in softmax_cross_entropy after the split region (sequential<..., split<linear<D, V>>, "
                "softmax_cross_entropy>), or split the whole model (split<M>), to get logits");
  tensor<float> out;
  pass(c, x, {}, detail::evaluation_pass, &out);
  if (stages_ > 1) {  // the last stage holds them
    index_t dims[2] = {out.shape().rank() == 2 ? out.shape()[0] : 0, out.shape().rank() == 2 ? out.shape()[1] : 0};
    broadcast(*pipe_, view<index_t>(dims, {2}), stages_ - 1);
    if (stage_ != stages_ - 1) out = tensor<float>({dims[0], dims[1]}, mem_kind::workspace);
    broadcast(*pipe_, view<float>(out.data(), {dims[0] * dims[1]}), stages_ - 1);
  }
  return out;
}

}  // namespace whale
