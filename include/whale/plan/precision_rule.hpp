// What bf16 mixed precision cannot run with: the one rule, applied where a
// plan is lowered (plan/check.hpp: a run's step and every plan auto_plan
// prices) and where a trainer starts (train/trainer_start_impl.hpp).
#pragma once

#include <string>

namespace whale {

/// Whether a plan of ZeRO level `zero` trains in bf16 mixed precision (`bf16`)
/// or fp32: empty if it does, else why not.
inline std::string precision_refusal(bool bf16, int zero) {
  if (bf16 && zero == 3)
    return "bf16 mixed precision with ZeRO-3 is not implemented (shard<..., 3>: its gathered weights are not rounded, and "
           "its fp32 master weights would need the same partition as the parameters); use ZeRO 0-2 or fp32";
  return {};
}

}  // namespace whale
