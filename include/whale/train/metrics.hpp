// Metrics of the logits for trainer_options::eval_metric: each returns this
// rank's share (a sum over its rows and their count); the trainer adds the
// shares of every rank. Plain functions; no communication.
#pragma once

#include <cstdint>

#include "whale/nn/layer.hpp"
#include "whale/tensor/tensor.hpp"
#include "whale/train/trainer_options.hpp"

namespace whale {

/// Top-1 accuracy: the rows whose largest logit is their label (ties: the
/// first class), over the rows not labelled ignore_index.
inline metric_share accuracy(cview<float> logits, cview<std::int32_t> labels) {
  metric_share m;
  const index_t rows = labels.numel();
  if (rows == 0) return m;
  const index_t classes = logits.numel() / rows;
  for (index_t r = 0; r < rows; ++r) {
    if (labels[r] == ignore_index) continue;
    const float* z = logits.data() + r * classes;
    index_t best = 0;
    for (index_t j = 1; j < classes; ++j)
      if (z[j] > z[best]) best = j;
    m.sum += best == labels[r] ? 1.0 : 0.0;
    m.count += 1;
  }
  return m;
}

}  // namespace whale
