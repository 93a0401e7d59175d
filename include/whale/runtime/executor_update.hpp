// executor_core's optimizer step (runtime/executor_core.hpp): the state of the
// range this rank updates, and the update itself, with ZeRO 1-2's all-gather of
// the parameters after it. Templates over the optimizer only: one definition
// for every plan (executor<P> and auto_plan's candidates share it).
#pragma once

#include "whale/optim/optimizer.hpp"
#include "whale/runtime/executor_core.hpp"

namespace whale::detail {

template <class O> typename O::state executor_core::make_optimizer_state(const O& opt) const {
  const place_scope on(be_.memory());  // in the parameters' memory (a device's, on one)
  return opt.make_state(local_count());
}

template <class O> void executor_core::apply_optimizer(const O& opt, typename O::state& st, kernels::update_gate gate) {
  const auto t0 = tr_.now();
  update_on(be_, opt, st, local_params(), local_grads(), gate);
  if (level_ > 0 && level_ < 3) zero_.gather_after_update(params_.data());
  tr_.add(span_kind::optimizer, step_ - 1, -1, t0, tr_.now());
}

template <class O> void executor_core::apply_optimizer(const O& opt, typename O::state& st, float grad_scale) {
  const auto t0 = tr_.now();
  auto g = local_grads();
  if (grad_scale != 1.f) be_.launch(g.numel(), kernels::scale{g.data(), grad_scale});
  update_on(be_, opt, st, local_params(), g);
  if (level_ > 0 && level_ < 3) zero_.gather_after_update(params_.data());
  tr_.add(span_kind::optimizer, step_ - 1, -1, t0, tr_.now());
}

template <class O>
void executor_core::apply_optimizer_with_delta(const O& opt, typename O::state& st, kernels::update_gate gate,
                                               kernels::update_delta delta) {
  const auto t0 = tr_.now();
  update_on(be_, opt, st, local_params(), local_grads(), gate, delta);
  tr_.add(span_kind::optimizer, step_ - 1, -1, t0, tr_.now());
}

}  // namespace whale::detail
