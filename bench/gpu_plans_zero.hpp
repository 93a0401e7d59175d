// gpu_plans: ZeRO 1-3 (shard<tp_gpt, L>: with a model axis, ZeRO x TP) and
// recompute (ZeRO-3 over a GPT whose blocks are recomputed in backward). See gpu_plans.hpp; compiled in gpu_plans.cu.
#pragma once

#include "gpu_plans.hpp"

namespace gpu_plans {

inline std::vector<entry> zero_entries() {
  return {
      {"zero1", "ZeRO-1: shard<tp_gpt, 1> over the data axis (optimizer state partitioned)", on_data,
       train_gpt<shard<tp_gpt, 1>>, gpt_flops},
      {"zero2", "ZeRO-2: shard<tp_gpt, 2> (and gradients, reduce-scattered per layer)", on_data,
       train_gpt<shard<tp_gpt, 2>>, gpt_flops},
      {"zero3", "ZeRO-3: shard<tp_gpt, 3> (and parameters, gathered per layer, the next one prefetched)", on_data,
       train_gpt<shard<tp_gpt, 3>>, gpt_flops},
      {"recompute", "ZeRO-3 over the GPT with every block recomputed in backward: shard<tp_gpt_recompute, 3>", on_data,
       train_gpt<shard<tp_gpt_recompute, 3>>, gpt_flops},
  };
}

}  // namespace gpu_plans
