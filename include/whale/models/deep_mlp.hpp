// The `deep-mlp` reference workload (shared/workloads.md): 8 × (Linear
// 512→512, GELU), Linear 512→16, softmax cross-entropy, on teacher labels of 16
// classes; global batch 128. For time-to-loss runs. Types and data only.
#pragma once

#include "whale/nn/gelu.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/train/data.hpp"

namespace whale::models {

using deep_mlp_block = sequential<linear<512, 512>, gelu>;
/// The 8 blocks are a repeat, so a pipeline can cut them at run time.
using deep_mlp = sequential<repeat<8, deep_mlp_block>, linear<512, 16>, softmax_cross_entropy>;
inline constexpr index_t deep_mlp_global_batch = 128;

/// Teacher-labelled data for `deep-mlp`: x ~ N(0,1) of width 512, 16 classes.
inline teacher_data deep_mlp_data(seed s = seed{7}, index_t global_batch = deep_mlp_global_batch) {
  return teacher_data(s, 512, 16, global_batch);
}

}  // namespace whale::models
