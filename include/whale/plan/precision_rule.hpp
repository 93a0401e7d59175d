// A step's number format, `precision`, and what bf16 mixed precision cannot
// run with: the one rule, applied where a plan is lowered (plan/check.hpp:
// make<P> with plan_options::precision, a run's step, and every plan auto_plan
// prices). The network owns the precision (plan_options::precision, or
// network<M>'s constructor); the trainer trains in the network's.
#pragma once

#include <string>

#include "whale/detail/parse.hpp"

namespace whale {

/// The number format of a training step's compute. fp32: everything in fp32.
/// bf16 (mixed precision): the weights a step computes with and every layer's
/// output and input gradient are bf16, arithmetic accumulates in fp32, and
/// the master weights, their gradients and the optimizer state stay fp32. On
/// the CPU, bf16 is emulated: values are rounded to bf16 (to nearest, ties to
/// even) where they are stored, and computed in fp32 -- what a GPU's bf16 GEMM
/// with fp32 accumulation does (docs/precision.md).
enum class precision { fp32, bf16 };
inline const char* to_string(precision p) noexcept { return p == precision::bf16 ? "bf16" : "fp32"; }
/// "fp32" or "bf16", whole; anything else is an error naming `what`.
inline precision parse_precision(const std::string& text, const std::string& what) {
  if (text == "fp32") return precision::fp32;
  if (text == "bf16") return precision::bf16;
  throw detail::parse_error(what + " '" + text + "': expected fp32 or bf16");
}
/// Whether a plan of ZeRO level `zero` trains in bf16 mixed precision (`bf16`)
/// or fp32: empty if it does, else why not.
inline std::string precision_refusal(bool bf16, int zero) {
  if (bf16 && zero == 3)
    return "bf16 mixed precision with ZeRO-3 is not implemented (shard<..., 3>: its gathered weights are not rounded, and "
           "its fp32 master weights would need the same partition as the parameters); use ZeRO 0-2 or fp32";
  return {};
}
/// Whether a device profile whose `kernels` line times its kernels in
/// `kernels` ("bf16", "fp32"; empty: no such line, analytic compute) can
/// price a plan that trains in `p`: empty if it can, else why not, naming
/// where the plan's precision was set (`set_by`); `fixed`: the caller cannot
/// train in another precision (no advice to change it). The one rule for
/// auto_plan's profile and the planning tools' --precision.
inline std::string profile_precision_refusal(const std::string& kernels, precision p, const std::string& set_by, bool fixed = false) {
  if (kernels.empty() || kernels == to_string(p)) return {};
  return "the device profile times its kernels in " + kernels + " (its 'kernels' line), but the plan trains in " +
         to_string(p) + " (" + set_by + "); " + (fixed ? std::string("give") : "make the plan in " + kernels + ", or give") +
         " a profile measured in " + to_string(p) + " or one without a kernels line";
}

}  // namespace whale
