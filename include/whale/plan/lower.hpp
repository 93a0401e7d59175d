// `lower(desc, mesh, rank, options)`: a plan (read by describe<P>()) for one
// rank of a mesh, as that rank's program — what it holds and the operations
// of one training step with their bytes and FLOPs. Pure and non-template: no
// MPI, no model tensors; the same answer on every machine. Bytes follow the
// traffic model of comm_stats (comm/detail/cost.hpp), so a program's bytes are
// what the communicators count when the plan runs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "whale/comm/collectives.hpp"
#include "whale/comm/detail/cost.hpp"
#include "whale/detail/compiled.hpp"
#include "whale/plan/check.hpp"
#include "whale/plan/describe.hpp"
#include "whale/strategy/split_loss.hpp"
#include "whale/plan/partition.hpp"
#include "whale/plan/program.hpp"
#include "whale/plan/traffic.hpp"

namespace whale {

/// The order pipe rank `stage` of `stages` runs a pass of plan `d` in, over `m`
/// micro-batches (program::order): every rank's list checked and replayed
/// (check_schedule's rules: throws std::invalid_argument naming the stages if a
/// list is malformed or the lists deadlock), this rank's actions, and its
/// messages in the order every rank issues them, for a training pass and a
/// pass without training. Without a pipeline: 1F1B on one stage (F and B of each
/// micro-batch in turn). Lowering stores it in the program; the executor runs it.
WHALE_CORE_INLINE pass_order pass_order_of(const model_desc& d, int stage, int stages, int m);

/// Rank `rank`'s program for plan `d` on `mesh`. Throws std::invalid_argument,
/// naming the plan and the rule, when the plan cannot run on that mesh.
WHALE_CORE_INLINE program lower(const model_desc& d, const mesh_shape& mesh, int rank, const lower_options& o);
/// describe<P>() then lower.
template <class P> program lower(const mesh_shape& mesh, int rank, const lower_options& o) {
  return lower(describe<P>(), mesh, rank, o);
}

}  // namespace whale

#if WHALE_CORE_DEFINITIONS  // header-only, or the compiled core's own unit (detail/compiled.hpp)
#include "whale/plan/lower_impl.hpp"
#endif
