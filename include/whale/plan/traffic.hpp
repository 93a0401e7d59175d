// What the collective a layout conversion needs costs one rank: its kind,
// the elements of its full buffer and the bytes this rank sends and receives,
// under the traffic model of comm_stats (comm/detail/cost.hpp). Pure arithmetic.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "whale/comm/detail/cost.hpp"
#include "whale/plan/partition.hpp"
#include "whale/plan/program.hpp"
#include "whale/strategy/layout.hpp"

namespace whale::detail {

struct conversion_traffic {
  bool moves = false;  ///< false: no communication (no conversion, a slice, one rank)
  coll_kind kind = coll_kind::all_reduce;
  traffic t;
  std::int64_t elements = 0;
  std::int64_t mine = 0;  ///< a reduce-scatter: the elements this rank keeps
};

/// Conversion `k` on an axis of `p` ranks, for rank `r`: the tensor has full
/// width `w` and `rows_in` / `rows_out` rows on this rank before and after; a
/// row split (split<0>) divides a global batch of `global_batch` sequences of `seq` rows.
inline conversion_traffic conversion_cost(conv_op k, int p, int r, index_t rows_in, index_t rows_out, index_t w,
                                          index_t global_batch, index_t seq) {
  conversion_traffic c;
  if (p == 1 || k == conv_op::none || k == conv_op::slice_rows || k == conv_op::slice_cols || k == conv_op::impossible)
    return c;
  constexpr std::int64_t e = 4;
  c.moves = true;
  switch (k) {
    case conv_op::all_reduce:
      c.elements = rows_out * w;
      c.t = all_reduce_traffic(c.elements * e, p);
      break;
    case conv_op::gather_rows:
    case conv_op::reduce_scatter_rows: {
      std::vector<index_t> counts(static_cast<std::size_t>(p));
      for (int i = 0; i < p; ++i) counts[static_cast<std::size_t>(i)] = even_slice(global_batch, p, i).second * seq * w;
      for (auto n : counts) c.elements += n;
      const bool gather = k == conv_op::gather_rows;
      c.kind = gather ? coll_kind::all_gather : coll_kind::reduce_scatter;
      c.t = gather ? all_gather_traffic(std::span<const index_t>(counts), r, p, e)
                   : reduce_scatter_traffic(std::span<const index_t>(counts), r, p, e);
      if (!gather) c.mine = counts[static_cast<std::size_t>(r)];
      break;
    }
    case conv_op::gather_cols:
      c.elements = rows_in * w;
      c.kind = coll_kind::all_gather;
      c.t = all_gather_traffic(rows_in * (w / p) * e, p);
      break;
    case conv_op::reduce_scatter_cols:
      c.elements = rows_in * w;
      c.kind = coll_kind::reduce_scatter;
      c.t = reduce_scatter_traffic(rows_in * (w / p) * e, p);
      c.mine = rows_in * (w / p);
      break;
    default:
      c.moves = false;
  }
  return c;
}

}  // namespace whale::detail
