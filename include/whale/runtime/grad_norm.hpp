// The squares of the gradients one rank counts for the global gradient norm
// (clipping, and the trainer's non-finite check), from its lowered program's
// holdings: each parameter once over the mesh. Non-template, compiled once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/cpu.hpp"
#include "whale/plan/program.hpp"

namespace whale::detail {

/// The ranges of the gradients this rank counts for the global norm: each
/// parameter once over the mesh (the first rank of every axis it is replicated
/// over counts it; a split layer's whole tail, e.g. a row-parallel bias, on the
/// first rank of its split axis). Sum over the world to get the norm squared.
/// `within_replica`: once over this rank's data replica instead (every replica
/// counts its own copy; sum over the replica's pipe and model ranks).
inline std::vector<std::pair<index_t, index_t>> owned_ranges(const program& prog, bool within_replica = false) {
  std::vector<std::pair<index_t, index_t>> r;  // (offset, count) in the stage's flat gradients
  auto first = [&](axes a) {
    for (axis x : all_axes)
      if (a.contains(x) && !(within_replica && x == axis::data) && prog.coords[static_cast<std::size_t>(x)] != 0) return false;
    return true;
  };
  for (const auto& h : prog.holds) {
    if (h.local_params == 0 || h.ties_to >= 0 || !first(h.replicated_over)) continue;  // a tied head: its table counts
    const index_t whole = first(h.split_over) ? 0 : h.whole_tail;
    r.push_back({h.local_offset, h.local_params - whole});
  }
  return r;
}
/// The squares of owned_ranges(), added in their order.
inline double owned_squares(const program& prog, const float* grads, bool within_replica = false,
                            const backend_ref& be = {}) {
  double sq = 0;
  for (auto [at, n] : owned_ranges(prog, within_replica)) sq += be.sum_squares(n, grads + at);
  return sq;
}
/// ZeRO 2–3: the ranges of the owned range [begin, end) of the stage's flat
/// gradients (`owned` holds them), each parameter once over the model axis; the
/// owned ranges partition the stage over the data axis, so every data rank counts its own.
inline std::vector<std::pair<index_t, index_t>> owned_range_ranges(const program& prog, index_t begin, index_t end) {
  const int m = prog.coords[static_cast<std::size_t>(axis::model)];
  std::vector<std::pair<index_t, index_t>> r;  // (offset, count) in the owned range
  auto add = [&](index_t b, index_t e) {
    b = std::max(b, begin), e = std::min(e, end);
    if (e > b) r.push_back({b - begin, e - b});
  };
  for (const auto& h : prog.holds) {
    if (h.local_params == 0 || h.ties_to >= 0) continue;  // a tied head: its table counts
    const bool copy_over_model = h.replicated_over.contains(axis::model);
    if (copy_over_model && m != 0) continue;
    const index_t whole = h.split_over.contains(axis::model) && m != 0 ? h.whole_tail : 0;
    add(h.local_offset, h.local_offset + h.local_params - whole);
  }
  return r;
}
/// The squares of owned_range_ranges(), added in their order.
inline double owned_range_squares(const program& prog, const float* owned, index_t begin, index_t end,
                                  const backend_ref& be = {}) {
  double sq = 0;
  for (auto [at, n] : owned_range_ranges(prog, begin, end)) sq += be.sum_squares(n, owned + at);
  return sq;
}
/// The smallest unit index among this rank's holdings whose gradients in
/// [begin, end) of its local flat buffer (`g` holds that range) are not all
/// finite; max() if none.
inline std::int64_t first_nonfinite_unit(const program& prog, const float* g, index_t begin, index_t end) {
  std::int64_t first = std::numeric_limits<std::int64_t>::max();
  for (const auto& h : prog.holds) {
    const index_t b = std::max(begin, h.local_offset), e = std::min(end, h.local_offset + h.local_params);
    for (index_t i = b; i < e; ++i) {
      const float x = g[i - begin];
      if (x - x != 0.f) {
        first = std::min<std::int64_t>(first, h.unit);
        break;
      }
    }
  }
  return first;
}

}  // namespace whale::detail
