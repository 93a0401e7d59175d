// Tied parameters (tied_head<V, D>): a head whose weight is the token table's
// copy. Each rank that holds one side of a tie keeps the two equal, as
// Megatron-LM keeps the first and last pipeline stages' word embeddings:
//   - at start-up the table's values are copied into the head;
//   - after each step's backward (the gradients summed over the data axis
//     first) both sides receive g_table + g_head, added in that order
//     everywhere, so the optimizer makes the same update to both;
//   - the gradient norm counts the table alone (runtime/grad_norm.hpp skips
//     a tied head's holding).
// Both sides on one rank: one kernel. On two pipe ranks (the table on the
// first stage, the head on the last): an exchange between them. ZeRO 2-3
// (gradients reduce-scattered over data, so each data rank holds its owned
// pieces of the two sides): the pieces are summed into one buffer over the
// data axis, exchanged between the stages if they differ, and each rank keeps
// its owned pieces. Non-template, compiled once.
#pragma once

#include <algorithm>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/kernels/elementwise.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/plan/program.hpp"

namespace whale::detail {

/// One tie as this rank holds it: local offsets (this rank's flat buffer) of
/// the table's and the head's slices, -1 for a side another pipe rank holds
/// (`peer`, its pipe coordinate). `unit`: the head's unit (ties are kept in its order).
struct tie_pair {
  index_t table = -1, head = -1, count = 0;
  int peer = -1;
  int unit = -1;
};

/// The ties this rank takes part in. `program_of(pipe)`: the program of the
/// rank with this rank's data and model coordinates at pipe coordinate
/// `pipe`. Every tie of the model is checked on every rank, so that all fail
/// together: its two sides must be split alike (both by vocabulary over the
/// same axis, or neither). In the head's unit order on every rank, so that
/// two ranks exchange their ties in one order.
inline std::vector<tie_pair> ties_of(const program& prog, const std::function<program(int)>& program_of) {
  std::vector<program> stage(static_cast<std::size_t>(prog.stages));
  for (int s = 0; s < prog.stages; ++s) stage[static_cast<std::size_t>(s)] = s == prog.stage ? prog : program_of(s);
  auto same_runs = [](const unit_holding& a, const unit_holding& b) {
    if (a.local_params != b.local_params || a.runs.size() != b.runs.size()) return false;
    for (std::size_t i = 0; i < a.runs.size(); ++i)
      if (a.runs[i].local != b.runs[i].local || a.runs[i].count != b.runs[i].count || a.runs[i].full != b.runs[i].full)
        return false;
    return true;
  };
  std::vector<tie_pair> out;
  for (int hs = 0; hs < prog.stages; ++hs)
    for (const auto& h : stage[static_cast<std::size_t>(hs)].holds) {
      if (h.ties_to < 0) continue;
      const unit_holding* table = nullptr;
      int ts = -1;
      for (int s = 0; s < prog.stages && !table; ++s)
        for (const auto& t : stage[static_cast<std::size_t>(s)].holds)
          if (t.unit == h.ties_to) table = &t, ts = s;
      if (!table) throw std::logic_error("whale: no pipe rank holds the token table " + h.name + " is tied to");
      if (!same_runs(*table, h))
        throw std::invalid_argument("whale: " + h.name + " is tied to " + table->name + ", but the two are split differently (" +
                                    std::to_string(h.local_params) + " and " + std::to_string(table->local_params) +
                                    " parameters on a rank); split both by vocabulary over the same axis, or neither");
      if (h.local_params == 0 || (hs != prog.stage && ts != prog.stage)) continue;
      tie_pair t;
      t.count = h.local_params, t.unit = h.unit;
      if (hs == prog.stage) t.head = h.local_offset;
      if (ts == prog.stage) t.table = table->local_offset;
      if (hs != ts) t.peer = hs == prog.stage ? ts : hs;
      out.push_back(t);
    }
  std::sort(out.begin(), out.end(), [](const tie_pair& a, const tie_pair& b) { return a.unit < b.unit; });
  return out;
}

/// The tie's exchange tag between pipe ranks (above the pipeline's 2j, 2j + 1 with j < 16000).
inline constexpr int tie_tag = 32700;

/// The other side's values of a pipe-split tie: `mine` (host) sent and the
/// peer's received, the lower pipe rank sending first.
inline std::vector<float> exchange_with_peer(world_comm& pipe, int stage, const tie_pair& t, const std::vector<float>& mine) {
  std::vector<float> theirs(mine.size());
  const cview<float> out(mine.data(), {static_cast<index_t>(mine.size())});
  const view<float> in(theirs.data(), {static_cast<index_t>(theirs.size())});
  if (stage < t.peer) {
    send(pipe, out, t.peer, tie_tag);
    recv(pipe, in, t.peer, tie_tag);
  } else {
    recv(pipe, in, t.peer, tie_tag);
    send(pipe, out, t.peer, tie_tag);
  }
  return theirs;
}

/// At start-up: every tied head's parameters := its table's. `params`: this
/// rank's whole flat buffer, in host memory. Collective over the pipe ranks of
/// a split tie (the table's side sends, the head's receives).
inline void tie_params(const std::vector<tie_pair>& ties, float* params, world_comm* pipe) {
  for (const auto& t : ties) {
    const auto n = static_cast<std::size_t>(t.count);
    if (t.peer < 0) {
      std::memcpy(params + t.head, params + t.table, n * sizeof(float));
    } else if (t.table >= 0) {
      send(*pipe, cview<float>(params + t.table, {t.count}), t.peer, tie_tag);
    } else {
      recv(*pipe, view<float>(params + t.head, {t.count}), t.peer, tie_tag);
    }
  }
}

/// After backward, the gradients whole on this rank (no ZeRO 2-3): both sides
/// of every tie := g_table + g_head. `grads`: this rank's flat buffer, in `be`'s memory.
inline void tie_grads(const std::vector<tie_pair>& ties, float* grads, const backend_ref& be, world_comm* pipe, int stage) {
  for (const auto& t : ties) {
    if (t.peer < 0) {
      be.launch(t.count, kernels::tie_sum{grads + t.table, grads + t.head});
      continue;
    }
    float* g = grads + (t.table >= 0 ? t.table : t.head);
    std::vector<float> keep;
    const auto h = be.host_readable(cview<float>(g, {t.count}), keep);
    const std::vector<float> mine(h.data(), h.data() + t.count);
    const auto theirs = exchange_with_peer(*pipe, stage, t, mine);
    std::vector<float> sum(mine.size());
    for (std::size_t i = 0; i < sum.size(); ++i)  // table + head on both sides
      sum[i] = t.table >= 0 ? mine[i] + theirs[i] : theirs[i] + mine[i];
    be.copy(g, sum.data(), sum.size() * sizeof(float));
    be.synchronize();
  }
}

/// ZeRO 2-3: this rank holds the gradients of [begin, end) of its flat buffer
/// (`owned`, in `be`'s memory). Both sides of every tie := g_table + g_head,
/// each rank keeping its owned pieces. Collective over the data axis (and the
/// pipe ranks of a split tie).
inline void tie_owned_grads(const std::vector<tie_pair>& ties, float* owned, index_t begin, index_t end, const backend_ref& be,
                            world_comm& data, world_comm* pipe, int stage) {
  std::vector<float> host;
  const auto* g = be.host_readable(cview<float>(owned, {end - begin}), host).data();
  auto owned_part = [&](index_t side, index_t count) -> std::pair<index_t, index_t> {  // [lo, hi) of the side, owned here
    if (side < 0) return {0, 0};
    return {std::clamp(begin - side, index_t{0}, count), std::clamp(end - side, index_t{0}, count)};
  };
  bool changed = false;
  std::vector<float> out(g, g + (end - begin));
  for (const auto& t : ties) {
    std::vector<float> sum(static_cast<std::size_t>(t.count), 0.f);
    for (const index_t side : {t.table, t.head}) {  // table first, then head
      const auto [lo, hi] = owned_part(side, t.count);
      for (index_t i = lo; i < hi; ++i) sum[static_cast<std::size_t>(i)] += g[side + i - begin];
    }
    all_reduce(data, view<float>(sum.data(), {t.count}));
    if (t.peer >= 0) {
      const auto theirs = exchange_with_peer(*pipe, stage, t, sum);
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = t.table >= 0 ? sum[i] + theirs[i] : theirs[i] + sum[i];
    }
    for (const index_t side : {t.table, t.head}) {
      const auto [lo, hi] = owned_part(side, t.count);
      for (index_t i = lo; i < hi; ++i) out[static_cast<std::size_t>(side + i - begin)] = sum[static_cast<std::size_t>(i)];
      changed = changed || hi > lo;
    }
  }
  if (changed) {
    be.copy(owned, out.data(), out.size() * sizeof(float));
    be.synchronize();
  }
}

}  // namespace whale::detail
