// Where a plan's ranks sit on a cluster's nodes: the pipe-outer placement
// (Megatron's order), and whether replaying the first replica stands for all.
// Used by the simulator (plan/simulate.hpp) and the plan search. Pure.
#pragma once

#include <map>
#include <vector>

#include "whale/comm/mesh.hpp"

namespace whale {

/// Mesh rank r on device devices[r] (Megatron's order: model innermost, then
/// data, pipe outermost), so that a pipeline's stages lie across nodes and each
/// stage's data-parallel group inside one: the placement
/// `context::with_rank_order(pipe_outer_devices(...))` gives a job.
inline std::vector<int> pipe_outer_devices(const mesh_shape& m) {
  std::vector<int> dev(static_cast<std::size_t>(m.size()));
  const int D = m.size(axis::data), M = m.size(axis::model);
  for (int r = 0; r < m.size(); ++r) {
    const auto c = m.coords(r);
    dev[static_cast<std::size_t>(r)] = (c[1] * D + c[0]) * M + c[2];
  }
  return dev;
}

/// Whether every replica along `axes_` (data and/or model) sits on the nodes as
/// the first one does, shifted by whole nodes (so replaying the first stands for
/// all): true when the ranks per node divide the replicas or the replicas divide them.
inline bool replicas_alike(const mesh_shape& m, axes axes_, int ranks_per_node, const std::vector<int>& devices = {}) {
  const int per_node = ranks_per_node > 0 ? ranks_per_node : m.size();
  auto node = [&](int r) { return (devices.empty() ? r : devices[static_cast<std::size_t>(r)]) / per_node; };
  std::map<int, int> shift;  // replica (its coordinates on axes_, flattened) -> node offset from the first replica
  for (int q = 0; q < m.size(); ++q) {
    auto c = m.coords(q);
    int key = 0;
    for (int a = 0; a < axis_count; ++a)
      if ((axes_.bits() >> a) & 1u) key = key * m.size(static_cast<axis>(a)) + c[static_cast<std::size_t>(a)], c[static_cast<std::size_t>(a)] = 0;
    const int off = node(q) - node(m.rank_of(c));
    if (const auto [it, fresh] = shift.emplace(key, off); !fresh && it->second != off) return false;
  }
  return true;
}

}  // namespace whale
