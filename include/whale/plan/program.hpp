// A rank's lowered program: what the rank holds (each leaf layer's sharded
// form, its layouts, each parameter range's placement) and the ordered
// operations of one training step, with their FLOPs, bytes and dependencies.
// Plain data and printing; lowering is plan/lower.hpp, nothing here runs.
#pragma once

#include <array>
#include <cstdint>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/comm/mesh.hpp"
#include "whale/nn/layer.hpp"
#include "whale/strategy/layout.hpp"
#include "whale/strategy/schedule.hpp"

namespace whale {

/// One leaf layer (or inserted conversion) as this rank holds it.
struct unit_holding {
  std::string name;      ///< the sharded form ("column_linear<256, 1024>/model", "layer_norm<256>")
  int unit = 0;          ///< index in the model's flat list of units
  int stage = 0;         ///< pipeline stage (pipe rank) that runs it
  int chunk = 0;         ///< which of the rank's model chunks (interleaved schedules; 0 otherwise)
  index_t full_params = 0;   ///< parameters of the unsplit layer
  index_t local_params = 0;  ///< parameters this rank holds
  index_t full_offset = 0;   ///< first parameter in the unsplit model's flat order
  index_t local_offset = 0;  ///< first parameter in this rank's flat buffer
  axes split_over;           ///< axes over which its parameters are divided
  index_t whole_tail = 0;    ///< of a split layer: its last parameters, held whole by every rank of split_over (a row-parallel bias)
  axes replicated_over;      ///< axes over which its (local) parameters are identical copies
  int zero_level = 0;        ///< ZeRO level partitioning its state over the data axis (0: none)
  layout_kind layout_in = layout_kind::R;    ///< layout of its input on its split axis (or replicated)
  bool recompute = false;    ///< its forward runs again during backward
  /// A tied head: the unit of the token table its parameters copy (its
  /// gradients are summed with the table's each step; counted once in the norm); -1 otherwise.
  int ties_to = -1;
  /// Where its local parameters lie in the unsplit layer's (one run unless it is a shard).
  std::vector<param_run> runs;
};

/// What an operation of the step does.
/// (`backward` of a split schedule is the input gradient only; `weight` its weight gradients.)
enum class op_kind : std::uint8_t { forward, backward, recompute, collective, send, recv, optimizer, weight };
/// The collectives a program uses.
enum class coll_kind : std::uint8_t { all_reduce, all_gather, reduce_scatter, broadcast };

inline const char* op_kind_name(op_kind k) {
  constexpr const char* n[] = {"fwd", "bwd", "recompute", "coll", "send", "recv", "optimizer", "bwd-w"};
  return n[static_cast<int>(k)];
}
inline const char* coll_kind_name(coll_kind k) {
  constexpr const char* n[] = {"all-reduce", "all-gather", "reduce-scatter", "broadcast"};
  return n[static_cast<int>(k)];
}

/// One operation of a training step on one rank.
struct op {
  op_kind kind = op_kind::forward;
  int unit = -1;             ///< compute: index of the unit (model's flat list); -1 otherwise
  int micro = -1;            ///< micro-batch, -1 when it concerns the whole step
  coll_kind coll = coll_kind::all_reduce;  ///< collectives only
  axes group;                ///< collectives: the axes of the group; send/recv: pipe
  int group_size = 1;        ///< ranks in the group
  int peer = -1;             ///< send/recv: the other rank (world numbering)
  std::int64_t bytes_sent = 0;      ///< by this rank (ring/chain model of comm_stats)
  std::int64_t bytes_received = 0;  ///< by this rank
  std::int64_t slowest_bytes = 0;   ///< collectives: the most any member sends or receives (the ring's pace)
  std::int64_t even_bytes = 0;      ///< collectives: each member's bytes were the buffer split evenly (0: slowest_bytes)
  std::int64_t elements = 0;        ///< elements of the collective's full buffer (or message)
  std::int64_t mine = 0;            ///< reduce-scatter: the elements this rank keeps of them
  double flops = 0;          ///< compute and optimizer operations
  index_t rows = 0;          ///< compute: rows (samples, or tokens) it runs on
  int bucket = -1;           ///< a data-parallel gradient bucket's all-reduce: its index in program::grad_buckets
  std::string what;          ///< the layer, or why the communication happens
  std::vector<int> deps;     ///< indices of operations that must be done first
};

/// The order one rank runs a pass in, decided once by lowering (pass_order_of,
/// plan/lower.hpp) and run by the executor: the rank's actions, the round of
/// the schedule's replay each runs in, and its pipeline messages in the order
/// every rank issues them. Index 1 is a training pass, index 0 a pass without
/// training (the forwards only, in the same order). Without a pipeline the
/// actions are each micro-batch's forward and backward in turn.
struct pass_order {
  int micro_batches = 0;  ///< m; 0 while none is made
  /// The replay of every stage's training list: activation slots, when each
  /// slot is free, the most micro-batches alive, whether links stay in order.
  schedule_report report;
  std::array<std::vector<pipe_action>, 2> actions;  ///< [training] this rank's actions
  std::array<std::vector<int>, 2> rounds;           ///< [training] per action: its round in the replay
  std::array<std::vector<detail::pipe_op>, 2> messages;     ///< [training] this rank's messages in the order every rank issues them
};

/// One use of a leaf's parameters in a step: its local range, forward
/// (or recompute) or backward. ZeRO-3 gathers each use's parameters.
struct leaf_use {
  index_t local_offset = 0, params = 0;
  bool backward = false;
  friend bool operator==(const leaf_use&, const leaf_use&) = default;
};

/// Totals of a program (per step, this rank).
struct program_totals {
  double flops = 0;
  std::int64_t bytes_sent = 0, bytes_received = 0;
  std::int64_t collectives = 0, messages = 0;
  index_t params_held = 0;      ///< parameters in this rank's buffers
  std::int64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0;  ///< model state (fp32)
};

/// The lowered program of one rank.
struct program {
  std::string plan;            ///< the plan type, as the user wrote it
  mesh_shape mesh;
  int rank = 0;
  std::array<int, axis_count> coords{};
  int stages = 1, stage = 0;   ///< pipeline stages, and this rank's
  int chunks = 1;              ///< model chunks per pipe rank (interleaved schedules)
  int micro_batches = 1;
  std::string schedule;        ///< "gpipe", "1f1b" or empty
  int zero_level = 0;
  bool bf16_reduce = false;    ///< gradients summed in bf16 (buckets and ZeRO reduce-scatters)
  bool bf16 = false;           ///< bf16 mixed precision: fp32 master weights beside the parameters
  bool grad_norm = true;       ///< the trainer computes the global gradient norm every step
  index_t global_batch = 0, seq = 1;  ///< sequences per step and tokens per sequence
  index_t local_sequences = 0;        ///< sequences this rank's replica feeds per step
  index_t full_params = 0;            ///< the unsplit model's parameters
  index_t owned_begin = 0, owned_end = 0;  ///< ZeRO: this rank's range of its local flat buffer
  std::vector<int> stage_blocks;      ///< repeat blocks per stage (cut of a pipelined repeat)
  /// Data-parallel gradient buckets: local ranges all-reduced over the data
  /// axis, in the order they are issued (from the buffer's end, as backward
  /// finishes them). Empty without data parallelism, and at ZeRO 2-3.
  std::vector<std::pair<index_t, index_t>> grad_buckets;
  /// When each is launched, as its all-reduce's dependency says: the local
  /// offset of the unit whose backward (in the step's last micro-batch) it
  /// waits for (every gradient from there on is final by then), or
  /// `after_backward` when it waits for the step's backward to end (without
  /// overlap, split schedules, interleaved chunks). The executor launches
  /// bucket k once the stage reports its gradients final from that offset on
  /// (runtime/grad_sync.hpp).
  std::vector<index_t> bucket_launch;
  static constexpr index_t after_backward = -1;
  std::vector<unit_holding> holds;
  /// The order of the step's passes (ops below lists their operations in it).
  pass_order order;
  std::vector<op> ops;
  int optimizer_bytes_per_param = 8;  ///< state bytes per parameter assumed for the totals (Adam: 8)

  program_totals totals() const {
    program_totals t;
    for (const auto& o : ops) {
      t.flops += o.flops;
      t.bytes_sent += o.bytes_sent;
      t.bytes_received += o.bytes_received;
      if (o.kind == op_kind::collective && o.group_size > 1) ++t.collectives;
      if (o.kind == op_kind::send) ++t.messages;
    }
    for (const auto& h : holds) t.params_held += h.local_params;
    const index_t n = t.params_held;
    const index_t owned = zero_level > 0 ? owned_end - owned_begin : n;
    t.param_bytes = 4 * (zero_level >= 3 ? owned : n);
    t.grad_bytes = 4 * (zero_level >= 2 ? owned : n);
    t.optimizer_bytes = static_cast<std::int64_t>(optimizer_bytes_per_param) * owned;
    return t;
  }
  /// When each data-parallel gradient bucket is summed: the launch points
  /// of grad_buckets (bucket_launch), checked against their all-reduces.
  std::vector<index_t> bucket_launches() const {
    std::size_t k = 0;
    for (const auto& o : ops)
      if (o.bucket >= 0 && o.bucket != static_cast<int>(k++))
        throw std::logic_error("whale::program: gradient bucket " + std::to_string(o.bucket) + " is issued out of order");
    if (k != grad_buckets.size() || bucket_launch.size() != grad_buckets.size())
      throw std::logic_error("whale::program: " + std::to_string(grad_buckets.size()) + " gradient bucket(s), " +
                             std::to_string(bucket_launch.size()) + " launch point(s) and " + std::to_string(k) +
                             " all-reduce(s) of them");
    return bucket_launch;
  }
  /// The uses of this rank's leaves with parameters, in the order the step's
  /// compute operations run them: the order ZeRO-3 gathers in (one leaf
  /// ahead, with prefetch), which its engine follows from the first step.
  std::vector<leaf_use> leaf_uses() const {
    std::vector<const unit_holding*> of;  // by unit
    for (const auto& h : holds) {
      if (h.unit >= static_cast<int>(of.size())) of.resize(static_cast<std::size_t>(h.unit) + 1, nullptr);
      of[static_cast<std::size_t>(h.unit)] = &h;
    }
    std::vector<leaf_use> uses;
    for (const auto& o : ops) {
      if (o.unit < 0 || o.unit >= static_cast<int>(of.size()) ||
          (o.kind != op_kind::forward && o.kind != op_kind::recompute && o.kind != op_kind::backward))
        continue;
      const auto* h = of[static_cast<std::size_t>(o.unit)];
      if (h && h->local_params > 0) uses.push_back({h->local_offset, h->local_params, o.kind == op_kind::backward});
    }
    return uses;
  }
  /// Bytes this rank sends in one step over the given axes (collectives whose
  /// group is exactly `a`, and point-to-point messages when `a` is pipe).
  std::int64_t bytes_sent_over(axes a) const {
    std::int64_t b = 0;
    for (const auto& o : ops)
      if ((o.kind == op_kind::collective || o.kind == op_kind::send) && o.group == a) b += o.bytes_sent;
    return b;
  }

  /// Holdings, then one line per operation, then the totals.
  friend std::ostream& operator<<(std::ostream& os, const program& p) {
    os << "program of rank " << p.rank << " (data " << p.coords[0] << ", pipe " << p.coords[1] << ", model "
       << p.coords[2] << ") of " << p.mesh << ": " << p.plan << "\n";
    os << "  batch " << p.global_batch << " x " << p.seq << ", this replica " << p.local_sequences
       << " sequence(s)";
    if (p.stages > 1 || p.micro_batches > 1)
      os << "; stage " << p.stage << " of " << p.stages << (p.chunks > 1 ? " (" + std::to_string(p.chunks) + " chunks)" : std::string())
         << ", " << p.micro_batches << " micro-batch(es)"
         << (p.schedule.empty() ? "" : " under " + p.schedule);
    if (p.zero_level) os << "; ZeRO-" << p.zero_level << " owns [" << p.owned_begin << ", " << p.owned_end << ")";
    os << "\n  holds:\n";
    for (const auto& h : p.holds) {
      os << "    " << std::left << std::setw(44) << h.name << std::right << std::setw(11) << h.local_params;
      if (h.full_params) os << " of " << std::setw(10) << h.full_params << " @" << h.local_offset;
      if (!h.split_over.empty()) os << "  split over " << h.split_over.name() << " (" << layout_kind_name(h.layout_in) << " in)";
      if (h.full_params && !h.replicated_over.empty()) os << "  replicated over " << h.replicated_over.name();
      if (h.recompute) os << "  recomputed";
      if (h.ties_to >= 0) os << "  tied to unit " << h.ties_to;
      if (p.chunks > 1) os << "  chunk " << h.chunk;
      os << "\n";
    }
    os << "  step (" << p.ops.size() << " operations):\n";
    for (std::size_t i = 0; i < p.ops.size(); ++i) {
      const auto& o = p.ops[i];
      os << "    " << std::setw(4) << i << " " << std::left << std::setw(9) << op_kind_name(o.kind) << std::right;
      if (o.micro >= 0) os << " mb" << o.micro;
      if (o.kind == op_kind::collective)
        os << " " << coll_kind_name(o.coll) << " over " << o.group.name() << ":" << o.group_size;
      if (o.kind == op_kind::send) os << " to " << o.peer;
      if (o.kind == op_kind::recv) os << " from " << o.peer;
      os << "  " << o.what;
      if (o.bytes_sent || o.bytes_received) os << "  [" << o.bytes_sent << " B out, " << o.bytes_received << " B in]";
      if (o.flops > 0) os << "  " << o.flops / 1e6 << " MFLOP";
      if (!o.deps.empty()) {
        os << "  after";
        for (int d : o.deps) os << " " << d;
      }
      os << "\n";
    }
    const auto t = p.totals();
    os << "  totals: " << t.flops / 1e9 << " GFLOP, " << t.bytes_sent << " B sent, " << t.bytes_received
       << " B received, " << t.collectives << " collective(s), " << t.messages << " message(s); holds "
       << t.params_held << " of " << p.full_params << " parameters; model state " << (t.param_bytes + t.grad_bytes + t.optimizer_bytes)
       << " B (params " << t.param_bytes << ", grads " << t.grad_bytes << ", optimizer " << t.optimizer_bytes << ")\n";
    return os;
  }
};

}  // namespace whale
