// The squares of the gradients one rank counts for the global gradient norm
// (clipping, and the trainer's non-finite check), from its lowered program's
// holdings: each parameter once over the mesh. Non-template, compiled once.
#pragma once

#include <algorithm>

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/cpu.hpp"
#include "whale/plan/program.hpp"

namespace whale::detail {

/// Squares of the gradients this rank counts for the global norm: each
/// parameter once over the mesh (the first rank of every axis it is replicated
/// over counts it; a split layer's whole tail, e.g. a row-parallel bias, on the
/// first rank of its split axis). Sum over the world to get the norm squared.
/// `within_replica`: once over this rank's data replica instead (every replica
/// counts its own copy; sum over the replica's pipe and model ranks).
inline double owned_squares(const program& prog, const float* grads, bool within_replica = false,
                            const backend_ref& be = {}) {
  double sq = 0;
  auto first = [&](axes a) {
    for (axis x : all_axes)
      if (a.contains(x) && !(within_replica && x == axis::data) && prog.coords[static_cast<std::size_t>(x)] != 0) return false;
    return true;
  };
  for (const auto& h : prog.holds) {
    if (h.local_params == 0 || h.ties_to >= 0 || !first(h.replicated_over)) continue;  // a tied head: its table counts
    const index_t whole = first(h.split_over) ? 0 : h.whole_tail;
    sq += be.sum_squares(h.local_params - whole, grads + h.local_offset);
  }
  return sq;
}
/// ZeRO 2–3: the squares of the owned range [begin, end) of the stage's flat
/// gradients (`owned` holds them), each parameter once over the model axis; the
/// owned ranges partition the stage over the data axis, so every data rank counts its own.
inline double owned_range_squares(const program& prog, const float* owned, index_t begin, index_t end,
                                  const backend_ref& be = {}) {
  const int m = prog.coords[static_cast<std::size_t>(axis::model)];
  double sq = 0;
  auto add = [&](index_t b, index_t e) {
    b = std::max(b, begin), e = std::min(e, end);
    if (e > b) sq += be.sum_squares(e - b, owned + (b - begin));
  };
  for (const auto& h : prog.holds) {
    if (h.local_params == 0 || h.ties_to >= 0) continue;  // a tied head: its table counts
    const bool copy_over_model = h.replicated_over.contains(axis::model);
    if (copy_over_model && m != 0) continue;
    const index_t whole = h.split_over.contains(axis::model) && m != 0 ? h.whole_tail : 0;
    add(h.local_offset, h.local_offset + h.local_params - whole);
  }
  return sq;
}
}  // namespace whale::detail
