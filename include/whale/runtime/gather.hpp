// executor<P>'s parameter gathers (runtime/executor.hpp): this stage's unsplit
// parameters from its shards, and the whole model on
// every rank (pipelines and interleaved chunks put back in flat order).
#pragma once

#include <array>
#include <cstring>
#include <span>
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
  auto mine = stage_params();
  if (stages_ == 1) return mine;  // (interleaved on one rank: the chunks are already in flat order)
  // every rank's chunk sizes, then every rank's chunks, put in virtual-stage order (chunk c of rank r is c·p + r)
  std::array<index_t, chunks_per_rank> sizes{};
  for (int ch = 0; ch < chunks_per_rank; ++ch) sizes[static_cast<std::size_t>(ch)] = parts_[static_cast<std::size_t>(ch)].full_end() - parts_[static_cast<std::size_t>(ch)].full_begin();
  std::vector<index_t> all_sizes(static_cast<std::size_t>(stages_ * chunks_per_rank)), counts(static_cast<std::size_t>(stages_)), starts(counts.size());
  all_gather(*pipe_, view<index_t>(sizes.data(), {chunks_per_rank}), view<index_t>(all_sizes.data(), {stages_ * chunks_per_rank}));
  index_t total = 0;
  for (int r = 0; r < stages_; ++r) {
    starts[static_cast<std::size_t>(r)] = total;
    for (int ch = 0; ch < chunks_per_rank; ++ch) counts[static_cast<std::size_t>(r)] += all_sizes[static_cast<std::size_t>(r * chunks_per_rank + ch)];
    total += counts[static_cast<std::size_t>(r)];
  }
  tensor<float> all({total}, mem_kind::workspace);
  all_gather_v(*pipe_, cview<float>(mine.v()), all.v(), std::span<const index_t>(counts));
  if constexpr (chunks_per_rank == 1) {
    return all;
  } else {
    tensor<float> ordered({total}, mem_kind::workspace);
    index_t at = 0;
    for (int vs = 0; vs < stages_ * chunks_per_rank; ++vs) {
      const int r = vs % stages_, ch = vs / stages_;
      index_t from = starts[static_cast<std::size_t>(r)];
      for (int c2 = 0; c2 < ch; ++c2) from += all_sizes[static_cast<std::size_t>(r * chunks_per_rank + c2)];
      const index_t k = all_sizes[static_cast<std::size_t>(r * chunks_per_rank + ch)];
      std::memcpy(ordered.data() + at, all.data() + from, static_cast<std::size_t>(k) * sizeof(float));
      at += k;
    }
    return ordered;
  }
}

}  // namespace whale
