// The run-time choices of a plan, one struct per concern: where the rank
// computes (placement), pipelines, data parallelism, ZeRO, debugging,
// heterogeneous devices and the planner (ZeRO's group, which the memory
// model reads too, is in plan/zero_options.hpp). `plan_options` (runtime/options.hpp)
// is all of them; each part of the runtime takes the group it reads. Each
// group reads its own environment variables (`read_env`) and command-line
// flags (`take_flag`) with strict parsing: an error names the flag or
// variable, its value and what is allowed.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/detail/environment.hpp"
#include "whale/detail/parse.hpp"
#include "whale/plan/precision_rule.hpp"
#include "whale/plan/zero_options.hpp"
#include "whale/tensor/tensor.hpp"

namespace whale {

/// Where this rank computes, keeps its state and sends its messages.
struct placement_options {
  /// Where this rank computes and keeps its parameters, gradients, optimizer
  /// state and activations: the CPU (the default), or a device backend
  /// (`backend_ref(gpu)`, or the guarded backend). On a device every strategy
  /// runs (not yet: worker_cuts, minibatches in flight; bf16_reduce only with
  /// device_collectives); its
  /// collectives over the data and model axes and its pipeline messages take
  /// the device's buffers (device_collectives; docs/device.md). The
  /// trainer's bf16 and checkpoints work on it too. The backend must
  /// outlive the plan and its optimizer state (they free into its memory).
  backend_ref backend;
  /// On a device: collectives over the data and model axes run on the device's
  /// buffers through its own communicator (make_device_comm: NCCL on a GPU),
  /// and pipeline messages through its communicator over the pipe group (in one
  /// order every rank agrees on); false: both through host copies around MPI.
  bool device_collectives = true;
  /// The number format of the plan's steps: fp32, or bf16 mixed precision
  /// (emulated on the CPU; docs/precision.md). The one setting: make<P> checks
  /// the plan with it (bf16 with ZeRO-3 is refused) and counts bf16's fp32
  /// master weights in its memory checks, auto_plan prices and ranks its
  /// candidates in it, and the trainer trains in it.
  whale::precision precision = whale::precision::fp32;

  /// WHALE_PRECISION (fp32 or bf16).
  void read_env() {
    if (auto v = env::string("WHALE_PRECISION")) precision = parse_precision(*v, "WHALE_PRECISION");
  }
  /// --precision fp32|bf16; false: not this group's flag.
  template <class Value> bool take_flag(const std::string& a, Value&& value) {
    if (a != "--precision") return false;
    precision = parse_precision(value(), "--precision");
    return true;
  }
};

/// Pipelines and gradient accumulation: micro-batches and stage cuts.
struct pipeline_options {
  /// Micro-batches per step (m). 0: 1 without a pipeline; with one, the largest
  /// divisor of the per-replica batch that is at most 4 × stages (1 with one stage of one chunk).
  int micro_batches = 0;
  /// pipeline<S, M>: blocks of the repeat on each stage (one count per stage,
  /// summing to N; inner stages need at least one). Empty: balanced by cost.
  std::vector<int> blocks;
  index_t balance_seq = 128;  ///< tokens of context assumed when weighing attention for balancing

  /// WHALE_MICRO_BATCHES, WHALE_STAGE_BLOCKS ("1,3").
  void read_env() {
    if (auto v = env::integer("WHALE_MICRO_BATCHES", 0, 16000)) micro_batches = static_cast<int>(*v);
    if (const char* e = env::text("WHALE_STAGE_BLOCKS")) blocks = parse_list(e, "WHALE_STAGE_BLOCKS");
  }
  /// --micro-batches M, --stage-blocks 1,3; false: not this group's flag.
  template <class Value> bool take_flag(const std::string& a, Value&& value) {
    if (a == "--micro-batches") micro_batches = static_cast<int>(detail::parse_int(value(), "--micro-batches", 0, 16000));
    else if (a == "--stage-blocks") blocks = parse_list(value(), "--stage-blocks");
    else return false;
    return true;
  }
  /// "1,3,0": comma-separated counts.
  static std::vector<int> parse_list(const std::string& v, const char* origin) {
    std::vector<int> r;
    for (std::size_t at = 0; at <= v.size();) {
      auto end = v.find(',', at);
      if (end == std::string::npos) end = v.size();
      r.push_back(static_cast<int>(detail::parse_int(v.substr(at, end - at), origin, 0, 1 << 20)));
      at = end + 1;
    }
    return r;
  }
};

/// Data parallelism: how gradients are summed over the data axis.
struct data_parallel_options {
  double bucket_mib = 25.0;   ///< gradient bucket size (MiB)
  bool overlap = true;        ///< reduce buckets during backward; false: all after backward
  /// Each bucket in one blocking all-reduce as soon as it is ready (true), or a
  /// non-blocking one that overlaps backward and is joined after it (false). Unset:
  /// by backend. Blocking on the CPU backend: nothing progresses a non-blocking
  /// all-reduce while backward keeps every core busy, and Open MPI's blocking
  /// algorithms measured ~2.7x faster at 25 MiB (docs/bench.md). Non-blocking on a
  /// device with its own communicator (NCCL on a GPU): the sums run on the
  /// communicator's stream while backward computes, and the device's queue, not
  /// the host, waits for them before the optimizer.
  std::optional<bool> blocking;
  /// Sum gradient buckets over the data axis in bf16: each bucket is rounded to
  /// bf16, all-reduced as bf16 (half the bytes; each partial sum rounded to
  /// bf16) and widened back to fp32 before the optimizer, as DDP's bf16
  /// compression hook and DeepSpeed's communication_data_type do. ZeRO 2-3
  /// reduce-scatter each leaf's gradients in bf16 the same way.
  bool bf16_reduce = false;

  /// WHALE_BUCKET_MIB, WHALE_DP_OVERLAP, WHALE_DP_BLOCKING, WHALE_BF16_REDUCE.
  void read_env() {
    if (auto v = env::real("WHALE_BUCKET_MIB", 0, 1 << 20, true)) bucket_mib = *v;
    if (auto v = env::boolean("WHALE_DP_OVERLAP")) overlap = *v;
    if (auto v = env::boolean("WHALE_DP_BLOCKING")) blocking = *v;
    if (auto v = env::boolean("WHALE_BF16_REDUCE")) bf16_reduce = *v;
  }
  /// --bucket-mib X, --bf16-reduce; false: not this group's flag.
  template <class Value> bool take_flag(const std::string& a, Value&& value) {
    if (a == "--bucket-mib") bucket_mib = detail::parse_double(value(), "--bucket-mib", 0, 1 << 20, true);
    else if (a == "--bf16-reduce") bf16_reduce = true;
    else return false;
    return true;
  }
};

/// Debugging: the timeline and the finite-value checks.
struct debug_options {
  bool trace = false;      ///< record a timeline (spans per micro-batch, messages, all-reduce, optimizer)
  std::string trace_path;  ///< write the merged Chrome trace JSON here at the end (implies trace)
  /// Check every leaf layer's output (forward) and input gradient (backward)
  /// for NaN/Inf and fail naming the layer (a pass over every activation).
  bool check_finite = false;

  /// WHALE_TRACE (a path), WHALE_CHECK_FINITE.
  void read_env() {
    if (auto v = env::string("WHALE_TRACE")) trace_path = *v;
    if (auto v = env::boolean("WHALE_CHECK_FINITE")) check_finite = *v;
  }
  /// --trace PATH, --check-finite; false: not this group's flag.
  template <class Value> bool take_flag(const std::string& a, Value&& value) {
    if (a == "--trace") trace_path = value();
    else if (a == "--check-finite") check_finite = true;
    else return false;
    return true;
  }
};

/// Heterogeneous devices (docs/hetero.md): emulated speeds and memory, and
/// how the batch and the pipeline follow them.
struct hetero_options {
  /// Emulated slowness of each world rank (one factor >= 1 per rank, empty: all 1):
  /// a rank of factor f runs each layer's forward and backward, then waits
  /// (f - 1) times as long, as a device f times slower would.
  std::vector<double> speeds;
  /// Split each global batch over the data replicas in proportion to their
  /// speed (1 / the largest factor among a replica's ranks) instead of evenly;
  /// gradients stay those of the global batch (each row weighs 1 / global rows).
  bool balance = false;
  /// Emulated memory of each world rank in MiB (one value per rank, empty: none): a
  /// pipeline of a repeat is cut so that every stage fits the smallest cap among its
  /// ranks (parameters, gradients, AdamW state, and with plan_batch the activations
  /// 1F1B keeps), and a rank whose share does not fit its cap is an error at make time.
  std::vector<double> memory_caps_mib;
  /// Each data replica (a virtual worker under wsp_trainer) cuts its pipeline
  /// for its own ranks' speeds and caps instead of all sharing the worst case
  /// per pipe position. Replicas then hold different layers at one position, so
  /// gradients cannot be summed over the data axis: only wsp_trainer (which
  /// never does) trains such a plan.
  bool worker_cuts = false;
  /// N_m when wsp_trainer will run waves of N_m minibatches in flight
  /// (wsp_options::in_flight; it checks that the two agree): memory caps then
  /// count the activations of min(N_m, p - s) whole minibatches on stage s
  /// instead of the plan's micro-batches. 0: not in flight.
  int in_flight = 0;

  /// WHALE_SPEEDS ("1,1,2,4"), WHALE_BALANCE, WHALE_MEMORY_CAPS, WHALE_WORKER_CUTS.
  void read_env() {
    if (const char* e = env::text("WHALE_SPEEDS")) speeds = parse_speeds(e, "WHALE_SPEEDS");
    if (auto v = env::boolean("WHALE_BALANCE")) balance = *v;
    if (const char* e = env::text("WHALE_MEMORY_CAPS")) memory_caps_mib = parse_caps(e, "WHALE_MEMORY_CAPS");
    if (auto v = env::boolean("WHALE_WORKER_CUTS")) worker_cuts = *v;
  }
  /// --speeds 1,1,2,4, --balance, --memory-caps, --worker-cuts; false: not this group's flag.
  template <class Value> bool take_flag(const std::string& a, Value&& value) {
    if (a == "--speeds") speeds = parse_speeds(value(), "--speeds");
    else if (a == "--balance") balance = true;
    else if (a == "--memory-caps") memory_caps_mib = parse_caps(value(), "--memory-caps");
    else if (a == "--worker-cuts") worker_cuts = true;
    else return false;
    return true;
  }
  /// "1,1,2,4": comma-separated slowness factors, each in [1, 1000].
  static std::vector<double> parse_speeds(const std::string& v, const char* origin) { return parse_reals(v, origin, 1, 1000); }
  /// "4096,4096,1024,1024": comma-separated MiB, each in [1e-6, 2^30].
  static std::vector<double> parse_caps(const std::string& v, const char* origin) { return parse_reals(v, origin, 1e-6, 1 << 30); }
  /// This rank's factor; the list, when given, must have one per world rank.
  double speed_of(int rank, int world) const { return per_rank(speeds, rank, world, "--speeds/WHALE_SPEEDS", 1.0); }
  /// This rank's memory cap in MiB (0: none); the list, when given, must have one per world rank.
  double memory_cap_of(int rank, int world) const {
    return per_rank(memory_caps_mib, rank, world, "--memory-caps/WHALE_MEMORY_CAPS", 0.0);
  }

 private:
  // Comma-separated numbers, each parsed whole and within [lo, hi].
  static std::vector<double> parse_reals(const std::string& v, const char* origin, double lo, double hi) {
    std::vector<double> r;
    for (std::size_t at = 0; at <= v.size();) {
      auto end = v.find(',', at);
      if (end == std::string::npos) end = v.size();
      r.push_back(detail::parse_double(v.substr(at, end - at), origin, lo, hi));
      at = end + 1;
    }
    return r;
  }
  // Entry `rank` of a per-rank list (`dflt` when the list is empty); another length than the world is an error.
  static double per_rank(const std::vector<double>& list, int rank, int world, const char* what, double dflt) {
    if (list.empty()) return dflt;
    if (static_cast<int>(list.size()) != world)
      throw std::invalid_argument(std::string("whale: ") + what + " gives " + std::to_string(list.size()) +
                                  " value(s) but the job has " + std::to_string(world) + " rank(s); give one per rank");
    return list[static_cast<std::size_t>(rank)];
  }
};

/// auto_plan's planner (docs/plan-search.md): the profile it prices with, the
/// batch it prices and the memory the choice must fit.
struct planner_options {
  /// The device profile file auto_plan prices plans with (scripts/profile writes one);
  /// empty: one measured at start and cached, or cached earlier (runtime/profile_cache.hpp).
  std::string profile;
  /// Each rank's memory the chosen plan must fit, predicted (MiB; 0: no limit).
  double memory_limit_mib = 0;
  /// The global batch (sequences or samples) and tokens per sequence auto_plan prices.
  index_t plan_batch = 0, plan_seq = 1;
  /// auto_plan: candidates predicted within this fraction of the fastest are a
  /// tie, and the simplest of them runs (dp, then ZeRO 1-3, pipelines, tensor
  /// parallelism, the class-split head). 0: the fastest prediction always wins.
  double plan_tie = 0.02;

  /// WHALE_PROFILE (a device profile file).
  void read_env() {
    if (auto v = env::string("WHALE_PROFILE")) profile = *v;
  }
  /// --profile PATH; false: not this group's flag.
  template <class Value> bool take_flag(const std::string& a, Value&& value) {
    if (a != "--profile") return false;
    profile = value();
    return true;
  }
};

}  // namespace whale
