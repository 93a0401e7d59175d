// bf16 mixed precision's weights around one pass (the trainer's and the WSP
// trainer's steps): the fp32 master weights kept aside while the pass
// computes with them rounded to bf16. Not a template.
#pragma once

#include <utility>

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/kernels/elementwise.hpp"
#include "whale/tensor/tensor.hpp"

namespace whale::detail {

/// Under bf16 (`on`), from construction to restore(): this rank's parameters
/// `p` rounded to bf16 (the weights a pass computes with), the fp32 master
/// values kept aside in `master` (in the weights' memory: a device's, for a
/// network on one) and put back by restore(), or by the destructor when the
/// pass throws; and meanwhile a GPU's GEMMs on its bf16 tensor cores
/// (backend_ref::bf16_products). Under fp32: nothing.
class bf16_weights {
 public:
  bf16_weights(bool on, view<float> p, tensor<float>& master, backend_ref be) : weights_(p), be_(be) {
    if (!on) return;
    {
      const place_scope where(be.memory());  // where the weights are: a device's memory, on one
      master.resize(p.shape());
    }
    be.copy(master.data(), p.data(), p.bytes());
    master_ = &master;
    be.launch(p.numel(), kernels::to_bf16{p.data()});
    be.bf16_products(true);  // a GPU's GEMMs on its bf16 tensor cores: the layers' operands are bf16 values
  }
  bf16_weights(const bf16_weights&) = delete;
  bf16_weights& operator=(const bf16_weights&) = delete;
  /// Put the master weights back (throws if a device's copy fails).
  void restore() {
    if (!master_) return;
    auto* m = std::exchange(master_, nullptr);
    be_.bf16_products(false);
    be_.copy(weights_.data(), m->data(), weights_.bytes());
  }
  ~bf16_weights() {
    try {
      restore();  // a pass that threw: its error is the one reported
    } catch (...) {
    }
  }

 private:
  view<float> weights_;
  backend_ref be_;
  tensor<float>* master_ = nullptr;
};

}  // namespace whale::detail
