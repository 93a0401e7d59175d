// The run-time choices of every plan, `plan_options`: its groups by concern
// (runtime/option_groups.hpp) read from the environment and the command line,
// and `lowering_of`, the one place where they meet lowering's options.
#pragma once

#include <string>

#include "whale/detail/parse.hpp"
#include "whale/plan/check.hpp"
#include "whale/runtime/option_groups.hpp"

namespace whale {

/// Options of `make<P>(ctx, seed, options)`, as users of DDP, Megatron and
/// DeepSpeed expect them: one group per concern (runtime/option_groups.hpp),
/// whose fields read as plan_options' own (`o.micro_batches`, `o.bucket_mib`).
struct plan_options : placement_options,
                      pipeline_options,
                      data_parallel_options,
                      zero_options,
                      debug_options,
                      hetero_options,
                      planner_options {
  /// Every group's variables: WHALE_PRECISION (fp32 or bf16), WHALE_MICRO_BATCHES, WHALE_STAGE_BLOCKS ("1,3"), WHALE_TRACE (a path),
  /// WHALE_BUCKET_MIB, WHALE_DP_OVERLAP, WHALE_DP_BLOCKING, WHALE_BF16_REDUCE, WHALE_ZERO_PREFETCH,
  /// WHALE_CHECK_FINITE, WHALE_BALANCE (booleans: true/false, 1/0, yes/no, on/off), WHALE_SPEEDS
  /// ("1,1,2,4"), WHALE_MEMORY_CAPS, WHALE_WORKER_CUTS (a boolean), WHALE_PROFILE (a device profile
  /// file, for auto_plan).
  static plan_options from_env() {
    plan_options o;
    o.placement_options::read_env();
    o.pipeline_options::read_env();
    o.debug_options::read_env();
    o.data_parallel_options::read_env();
    o.zero_options::read_env();
    o.hetero_options::read_env();
    o.planner_options::read_env();
    return o;
  }
  /// from_env(), then every group's flags: --precision fp32|bf16, --micro-batches M, --stage-blocks 1,3, --trace PATH,
  /// --bucket-mib X, --bf16-reduce, --check-finite, --speeds 1,1,2,4, --balance, --memory-caps,
  /// --worker-cuts and --profile PATH, which are removed from argv (argv[argc] stays nullptr).
  static plan_options from_args(int& argc, char** argv) {
    plan_options o = from_env();
    int out = argc > 0 ? 1 : 0;
    for (int i = out; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw detail::parse_error("whale: " + a + " needs a value");
        return argv[++i];
      };
      const bool taken = o.placement_options::take_flag(a, value) || o.pipeline_options::take_flag(a, value) || o.debug_options::take_flag(a, value) ||
                         o.data_parallel_options::take_flag(a, value) || o.hetero_options::take_flag(a, value) ||
                         o.planner_options::take_flag(a, value);
      if (!taken) argv[out++] = argv[i];
    }
    argc = out;
    if (argv) argv[argc] = nullptr;
    return o;
  }
};

/// The options lowering takes, from a plan's options: the one place where
/// plan_options meets lower_options (micro-batches, stage blocks, the
/// balancer's context length, buckets, when and in what precision they are summed, the steps' precision). The caller sets
/// the rows (`global_batch`, `seq`) and whatever it prices differently.
inline lower_options lowering_of(const plan_options& o, index_t global_batch, index_t seq = 1) {
  lower_options lo;
  lo.global_batch = global_batch;
  lo.seq = seq;
  lo.micro_batches = o.micro_batches;
  lo.stage_blocks = o.blocks;
  lo.balance_seq = o.balance_seq;
  lo.bucket_mib = o.bucket_mib;
  lo.overlap_buckets = o.overlap;
  lo.bf16_reduce = o.bf16_reduce;
  lo.zero_prefetch = o.prefetch;
  lo.bf16 = o.precision == precision::bf16;
  return lo;
}

}  // namespace whale
