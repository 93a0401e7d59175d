// Partitioners: how a repeat's blocks are cut into pipeline stages (balanced
// by cost), and how a flat parameter range is divided among ranks. Pure
// arithmetic, shared by lowering and the runtimes; no model types here.
#pragma once

#include <algorithm>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "whale/nn/layer.hpp"

namespace whale::detail {

/// Per-row cost of a layer of cost `c` receiving `width` features in
/// sequences of `seq` tokens: the weight a stage balancer gives it.
inline double balance_weight(cost_info c, index_t width, index_t seq) {
  const auto s = c.scaled(width == any_features ? 0.0 : static_cast<double>(width));
  return s.fwd_flops + s.bwd_flops + 3.0 * s.seq_flops * static_cast<double>(seq);
}

/// Balanced cut of N equal blocks (cost `blk` each) over p stages, stage 0
/// also carrying `pre` and stage p-1 `post`, every inner stage at least one
/// block: minimises the most expensive stage (exact dynamic programme). With
/// `slowness` (one factor per stage, e.g. its device's emulated or measured
/// slowness), a stage's cost is its work times its factor: slow stages get less.
/// With `fits` (fits(stage, blocks): whether a stage holding that many blocks
/// stays within its device's memory), only cuts that fit are considered; none
/// fitting is an error saying so.
inline std::vector<int> balance_blocks(int N, int p, double pre, double post, double blk,
                                       const std::vector<double>& slowness = {},
                                       const std::function<bool(int, int)>& fits = {}) {
  auto f = [&](int s) { return slowness.empty() ? 1.0 : slowness.at(static_cast<std::size_t>(s)); };
  auto ok = [&](int s, int n) { return !fits || fits(s, n); };
  if (p <= 1) {
    if (!ok(0, N)) throw std::invalid_argument("whale: the model does not fit the memory of its one stage");
    return {N};
  }
  const double inf = std::numeric_limits<double>::infinity();
  const auto P = static_cast<std::size_t>(p), K = static_cast<std::size_t>(N) + 1;
  std::vector<double> best(P * K, inf);  // best[s*K + k]: first k blocks on stages 0..s, worst stage
  std::vector<int> choice(P * K, 0);     // blocks on stage s in that optimum
  for (int k = 0; k <= N; ++k)
    if (ok(0, k)) best[static_cast<std::size_t>(k)] = (pre + k * blk) * f(0);
  for (int s = 1; s < p; ++s) {
    const bool inner = s < p - 1;
    const auto row = static_cast<std::size_t>(s) * K, prev = row - K;
    for (int k = 0; k <= N; ++k)
      for (int n = inner ? 1 : 0; n <= k; ++n) {
        if (!ok(s, n)) continue;
        const double mine = (n * blk + (s == p - 1 ? post : 0.0)) * f(s);
        const double v = std::max(best[prev + static_cast<std::size_t>(k - n)], mine);
        if (v < best[row + static_cast<std::size_t>(k)] - 1e-9) {
          best[row + static_cast<std::size_t>(k)] = v;
          choice[row + static_cast<std::size_t>(k)] = n;
        }
      }
  }
  if (best[(P - 1) * K + static_cast<std::size_t>(N)] == inf)
    throw std::invalid_argument("whale: no cut of the " + std::to_string(N) + " blocks over " + std::to_string(p) +
                                " pipeline stages gives every stage a layer within its memory cap (--memory-caps, "
                                "WHALE_MEMORY_CAPS, where given); raise the caps, or change the stage count");
  std::vector<int> r(P);
  int k = N;
  for (int s = p - 1; s > 0; --s) {
    r[static_cast<std::size_t>(s)] = choice[static_cast<std::size_t>(s) * K + static_cast<std::size_t>(k)];
    k -= r[static_cast<std::size_t>(s)];
  }
  r[0] = k;
  return r;
}

/// Gradient buckets of at most `per` elements over sorted, disjoint `ranges`,
/// from the end of the buffer (the last layer's gradients are final first) to its start.
inline std::vector<std::pair<index_t, index_t>> bucket_ranges(const std::vector<std::pair<index_t, index_t>>& ranges,
                                                              index_t per) {
  std::vector<std::pair<index_t, index_t>> b;
  for (auto it = ranges.rbegin(); it != ranges.rend(); ++it)
    for (index_t end = it->second; end > it->first; end -= per) b.push_back({std::max(it->first, end - per), end});
  return b;
}

/// [0, n) minus `holes` (unsorted, possibly overlapping): sorted disjoint ranges.
inline std::vector<std::pair<index_t, index_t>> complement(std::vector<std::pair<index_t, index_t>> holes, index_t n) {
  std::sort(holes.begin(), holes.end());
  std::vector<std::pair<index_t, index_t>> r;
  index_t at = 0;
  for (const auto& [b, e] : holes) {
    if (b > at) r.push_back({at, b});
    at = std::max(at, e);
  }
  if (at < n) r.push_back({at, n});
  return r;
}

/// Elements per bucket of `mib` MiB of floats (at least one).
inline index_t bucket_elements(double mib) {
  return std::max<index_t>(1, static_cast<index_t>(mib * 1048576.0 / sizeof(float)));
}

/// Rows [begin, begin + count) of a global batch of `global` rows that part
/// `part` of `parts` feeds: as even as possible, the first global % parts get one more.
inline std::pair<index_t, index_t> even_slice(index_t global, int parts, int part) {
  const index_t q = global / parts, r = global % parts;
  return {part * q + std::min<index_t>(part, r), q + (part < r ? 1 : 0)};
}

/// Rows [begin, begin + count) of a global batch of `global` rows that part
/// `part` of `parts` feeds, in proportion to `weights` (one per part, > 0;
/// empty: even_slice). Largest remainders round; every part gets at least one
/// row when global >= parts. With `quantum` > 1 (e.g. the micro-batch count)
/// and global a multiple of parts x quantum, every slice is a multiple of it.
/// A pure function: every rank computes every slice alike.
inline std::pair<index_t, index_t> weighted_slice(index_t global, int parts, int part, const std::vector<double>& weights,
                                                  index_t quantum = 1) {
  if (weights.empty()) return even_slice(global, parts, part);
  if (quantum > 1 && global % quantum == 0 && global / quantum >= parts) {
    const auto [b, n] = weighted_slice(global / quantum, parts, part, weights);
    return {b * quantum, n * quantum};
  }
  const auto n = static_cast<std::size_t>(parts);
  double total = 0;
  for (std::size_t i = 0; i < n; ++i) total += weights.at(i);
  const index_t floor_each = global >= parts ? 1 : 0;  // one row each first, the rest by weight
  const index_t rest = global - floor_each * parts;
  std::vector<index_t> count(n);
  std::vector<std::pair<double, std::size_t>> frac(n);
  index_t given = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double exact = static_cast<double>(rest) * weights[i] / total;
    count[i] = floor_each + static_cast<index_t>(exact);
    given += count[i];
    frac[i] = {exact - static_cast<double>(static_cast<index_t>(exact)), i};
  }
  std::stable_sort(frac.begin(), frac.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (std::size_t k = 0; given < global; ++k, ++given) ++count[frac[k % n].second];
  index_t begin = 0;
  for (int i = 0; i < part; ++i) begin += count[static_cast<std::size_t>(i)];
  return {begin, count[static_cast<std::size_t>(part)]};
}

/// How ranks of unequal speed are grouped into virtual workers (HetPipe §5):
/// `np` keeps the launch order (consecutive ranks, usually one node's devices,
/// form a worker); `ed` gives every worker one device of each speed class (the
/// k-th slowest ranks spread over the workers); `hd` balances the workers'
/// total speed greedily (fastest ranks first, each to the worker with the least
/// speed so far that has room).
enum class worker_policy { np, ed, hd };

/// The rank order that groups `slowness.size()` ranks (factor >= 1 each) into
/// `workers` workers by `policy`: order[i] is the rank that takes mesh rank i,
/// so worker w is order[w·S .. w·S + S) with S = ranks / workers; inside a
/// worker ranks go fastest first (stage 0 first). Pure.
inline std::vector<int> worker_order(const std::vector<double>& slowness, int workers, worker_policy policy) {
  const int n = static_cast<int>(slowness.size());
  if (workers < 1 || n % workers != 0)
    throw std::invalid_argument("whale::worker_order: " + std::to_string(n) + " ranks do not form " + std::to_string(workers) +
                                " equal workers");
  const int S = n / workers;
  std::vector<int> order(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
  if (policy == worker_policy::np) return order;
  auto slow = [&](int r) { return slowness[static_cast<std::size_t>(r)]; };
  std::vector<int> by_speed = order;  // fastest first; equal speeds keep launch order
  std::stable_sort(by_speed.begin(), by_speed.end(), [&](int a, int b) { return slow(a) < slow(b); });
  std::vector<std::vector<int>> group(static_cast<std::size_t>(workers));
  if (policy == worker_policy::ed) {
    for (int k = 0; k < n; ++k) group[static_cast<std::size_t>(k % workers)].push_back(by_speed[static_cast<std::size_t>(k)]);
  } else {
    std::vector<double> speed(static_cast<std::size_t>(workers), 0.0);
    for (int r : by_speed) {
      int best = -1;
      for (int w = 0; w < workers; ++w)
        if (static_cast<int>(group[static_cast<std::size_t>(w)].size()) < S &&
            (best < 0 || speed[static_cast<std::size_t>(w)] < speed[static_cast<std::size_t>(best)]))
          best = w;
      group[static_cast<std::size_t>(best)].push_back(r);
      speed[static_cast<std::size_t>(best)] += 1.0 / slow(r);
    }
  }
  for (int w = 0; w < workers; ++w) {
    auto& g = group[static_cast<std::size_t>(w)];
    std::stable_sort(g.begin(), g.end(), [&](int a, int b) { return slow(a) < slow(b); });
    std::copy(g.begin(), g.end(), order.begin() + static_cast<std::ptrdiff_t>(w) * S);
  }
  return order;
}

/// Default micro-batch count of a pipeline: the largest divisor of the
/// per-replica batch (sequences) that is at most 4 × stages.
inline int default_micro_batches(index_t batch, int stages) {
  int best = 1;
  for (int m = 1; m <= std::min<index_t>(batch, 4 * stages); ++m)
    if (batch % m == 0) best = m;
  return best;
}

/// Micro-batches of one replica's `batch` sequences a step: `requested` when
/// given (it must divide the batch), else the pipeline's default
/// (default_micro_batches over `stages`) or, without a pipeline or with one
/// stage of one chunk (no bubble to fill: smaller GEMMs would only cost), 1. The one
/// rule lowering and the executor both apply. Throws std::invalid_argument
/// saying why; the caller names the plan.
inline int micro_batch_count(index_t batch, int requested, bool pipelined, int stages, int chunks = 1) {
  if (requested > 0) {
    if (batch % requested != 0 || batch < requested)
      throw std::invalid_argument(std::to_string(requested) + " micro-batches do not divide the per-replica batch of " +
                                  std::to_string(batch) + " sequences; choose a micro-batch count that divides it");
    return requested;
  }
  return pipelined && stages * chunks > 1 ? default_micro_batches(batch, stages) : 1;
}

/// `ranges` sorted, with touching or overlapping ranges joined.
inline std::vector<std::pair<index_t, index_t>> merged_ranges(std::vector<std::pair<index_t, index_t>> ranges) {
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<index_t, index_t>> r;
  for (const auto& x : ranges) {
    if (x.second <= x.first) continue;
    if (!r.empty() && x.first <= r.back().second) r.back().second = std::max(r.back().second, x.second);
    else r.push_back(x);
  }
  return r;
}

}  // namespace whale::detail
