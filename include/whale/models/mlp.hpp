// The `mlp` reference workload (shared/workloads.md): Linear 1024→4096, GELU,
// Linear 4096→4096, GELU, Linear 4096→1024, softmax cross-entropy, on teacher
// data; global batch 256. Types and data only; plans are chosen by the user.
#pragma once

#include "whale/nn/gelu.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/train/data.hpp"

namespace whale::models {

using mlp = sequential<linear<1024, 4096>, gelu, linear<4096, 4096>, gelu, linear<4096, 1024>,
                       softmax_cross_entropy>;
inline constexpr index_t mlp_global_batch = 256;

/// Teacher-labelled data for `mlp`: x ~ N(0,1) of width 1024, 1024 classes.
inline teacher_data mlp_data(seed s = seed{7}, index_t global_batch = mlp_global_batch) {
  return teacher_data(s, 1024, 1024, global_batch);
}

}  // namespace whale::models
