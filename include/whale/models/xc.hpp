// The `xc` reference workload (shared/workloads.md), the Whale paper's
// 100,000-class classifier: Linear 512→2048, ReLU, Linear 2048→100000,
// softmax cross-entropy; 64 samples per data-parallel rank. Types and data only.
#pragma once

#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/train/data.hpp"

namespace whale::models {

using xc_backbone = sequential<linear<512, 2048>, relu>;
using xc_classifier = sequential<linear<2048, 100000>, softmax_cross_entropy>;
using xc = sequential<xc_backbone, xc_classifier>;
inline constexpr index_t xc_batch_per_rank = 64;

/// Teacher-labelled data for `xc`: x ~ N(0,1) of width 512, 100,000 classes.
inline teacher_data xc_data(seed s = seed{7}, index_t global_batch = xc_batch_per_rank) {
  return teacher_data(s, 512, 100000, global_batch);
}

}  // namespace whale::models
