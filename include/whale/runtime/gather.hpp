// executor<P>'s parameter gathers (runtime/executor.hpp): this stage's unsplit
// parameters from its shards, and the whole model on
// every rank (pipelines and interleaved chunks put back in flat order).
#pragma once

#include <vector>

#include "whale/runtime/executor.hpp"

namespace whale {

template <class P> tensor<float> executor<P>::stage_params() {
  tensor<float> local({param_count()}, mem_kind::workspace);
  if constexpr (level == 3) zero_.gather_params(local.v());
  else {  // on a device: copied to the host through its backend
    be_.copy(local.data(), params_.data(), params_.v().bytes());
    be_.synchronize();
  }
  index_t n = 0;
  for (const auto& part : parts_) n += part.full_end() - part.full_begin();
  tensor<float> full({n}, mem_kind::workspace);
  index_t at = 0;
  for (int ch = 0; ch < chunks_per_rank; ++ch) {  // interleaved: the chunks' unsplit parameters one after another
    auto& part = parts_[static_cast<std::size_t>(ch)];
    part.gather_full(local.data() + chunk_at_[static_cast<std::size_t>(ch)], full.data() + at);
    at += part.full_end() - part.full_begin();
  }
  return full;
}
template <class P> tensor<float> executor<P>::full_params() {
  std::vector<index_t> sizes;  // each chunk's unsplit parameters
  for (const auto& part : parts_) sizes.push_back(part.full_end() - part.full_begin());
  return all_stages_params(stage_params(), sizes);
}

}  // namespace whale
