// gpu_plans: pipelines -- 1F1B (the all-strategies type
// shard<replicate<pipeline<one_f_one_b, tp_gpt>>, 1>, which is also the 3-D
// plan with ZeRO-1 on a data x pipe x model mesh), GPipe, interleaved 1F1B
// (2 chunks per pipe rank) and ZB-H1. See gpu_plans.hpp; compiled in gpu_plans.cu.
#pragma once

#include "gpu_plans.hpp"

namespace gpu_plans {

using all_strategies = shard<replicate<pipeline<one_f_one_b, tp_gpt>>, 1>;

inline std::vector<entry> pipeline_entries() {
  return {
      {"1f1b", "pipeline, 1F1B: shard<replicate<pipeline<one_f_one_b, tp_gpt>>, 1> with every rank on the pipe axis",
       on_pipe, train_gpt<all_strategies>, gpt_flops},
      {"3d", "the same type on data x pipe x model (default pipe=2,model=2, the rest on data: 3-D with ZeRO-1)", three_d,
       train_gpt<all_strategies>, gpt_flops},
      {"gpipe", "pipeline, GPipe: replicate<pipeline<gpipe, tp_gpt>>", on_pipe, train_gpt<replicate<pipeline<gpipe, tp_gpt>>>,
       gpt_flops},
      {"interleaved", "pipeline, interleaved 1F1B with 2 chunks per pipe rank: replicate<pipeline<interleaved_1f1b<2>, tp_gpt>>",
       on_pipe, train_gpt<replicate<pipeline<interleaved_1f1b<2>, tp_gpt>>>, gpt_flops},
      {"zbh1", "pipeline, zero-bubble ZB-H1 (B and W passes): replicate<pipeline<zb_h1, tp_gpt>>", on_pipe,
       train_gpt<replicate<pipeline<zb_h1, tp_gpt>>>, gpt_flops},
  };
}

}  // namespace gpu_plans
