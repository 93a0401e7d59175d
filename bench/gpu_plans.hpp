// Every plan of docs/compositions.md on a device: the shared part of the
// gpu_plans driver (gpu_plans.cu, one unit with the three headers that
// instantiate the plans, one family each). Compiled by nvcc.
//
// The model is a GPT whose embedding, blocks and head are split over the model
// axis (tensor parallelism where the mesh has a model axis, the whole layer
// where it has none), of one shape per target (WHALE_GPU_PLANS_SHAPE):
// gpt-gpu's (workloads.md) in gpu_plans, workloads.md's gpt in gpu_plans_gpt,
// and a tiny one in gpu_plans_small, which CI builds and runs on the guarded
// backend. Sequences may be shorter than the model's context (--seq).
#pragma once

#include <chrono>
#include <functional>
#include <cstdio>
#include <string>
#include <vector>

#include <whale/whale.hpp>  // (no backend here: the plans take a backend_ref; gpu_plans.cu makes the backends)

namespace gpu_plans {

using namespace whale;

// The shape, by WHALE_GPU_PLANS_SHAPE: 0 gpt-gpu (workloads.md), 1 gpt (workloads.md), 2 gpt-tiny (CI's checks).
#ifndef WHALE_GPU_PLANS_SHAPE
#define WHALE_GPU_PLANS_SHAPE 0
#endif
#if WHALE_GPU_PLANS_SHAPE == 2
inline constexpr const char* workload = "gpt-tiny";
inline constexpr index_t V = 512, T = 64, D = 64, H = 8, F = 256;
inline constexpr std::size_t L = 8;  // (8 heads and 8 blocks: tensor parallel and pipelines up to 8 GPUs)
inline constexpr index_t default_sequences = 4, default_seq = 32;  // per data replica
#elif WHALE_GPU_PLANS_SHAPE == 1
inline constexpr const char* workload = "gpt";
inline constexpr index_t V = 8192, T = 128, D = 256, H = 4, F = 1024;
inline constexpr std::size_t L = 4;
inline constexpr index_t default_sequences = 4, default_seq = 128;  // per data replica (16 in all on 4 replicas)
#else
inline constexpr const char* workload = "gpt-gpu";
inline constexpr index_t V = 32768, T = 1024, D = 1024, H = 16, F = 4096;
inline constexpr std::size_t L = 12;
inline constexpr index_t default_sequences = 8, default_seq = 1024;  // per data replica
#endif

using block = transformer_block<D, H, F>;
template <class Block>
using gpt_of = sequential<split<embedding<V, D>>, position_embedding<T, D>, repeat<L, Block>, layer_norm<D>,
                          split<linear<D, V>>, softmax_cross_entropy>;
using tp_gpt = gpt_of<split<block>>;                ///< every block split over the model axis
using tp_gpt_recompute = gpt_of<recompute<split<block>>>;  ///< and recomputed in backward

/// What a run is asked.
struct settings {
  std::string plan, backend = "cuda", prec = "bf16";
  int steps = 20;
  index_t sequences = 0, seq = 0;  ///< global sequences (0: default_sequences per data replica), tokens each
  int micro_batches = 0;           ///< plan_options::micro_batches (0: the plan's default)
  bool check = false;              ///< also train on the CPU backend and compare the losses
  bool blocking = false;           ///< gradient buckets blocking (the CPU's default), not overlapped
  int staleness = 0;               ///< wsp: D
  precision precision_kind() const { return prec == "bf16" ? precision::bf16 : precision::fp32; }
};

/// One run's figures, on this rank.
struct outcome {
  std::vector<double> losses;  ///< per step (the timed run: first and last only)
  double step_s = 0;           ///< wall time per timed step
  comm_stats device, host;     ///< per timed step: the device's own communicators, and MPI's
  /// Per timed step, where the backend counts its own (the guarded one): those and the waits for
  /// the device's communicators (each a spin on a GPU).
  std::int64_t host_waits = -1;
};

/// The backend a run computes on: made once per process, before any plan.
struct device_backend {
  backend_ref ref;
  std::function<std::int64_t()> host_waits = [] { return std::int64_t{-1}; };
  std::function<void()> synchronize = [] {};
};

/// How each plan is run: its type, its mesh and its options.
struct entry {
  const char* name;
  const char* help;
  /// The mesh for `n` ranks when --mesh is not given ("" : every rank on data).
  std::string (*mesh)(int n);
  /// Trains the plan `steps` times on `be` (CPU: backend_ref{}); `timed`: warm-up first, then one timed run.
  outcome (*run)(context& ctx, const backend_ref& be, const settings& s, bool timed, const device_backend* dev);
  /// Model FLOPs of one step on `global` sequences (samples) of `seq` tokens (workloads.md).
  double (*flops)(index_t global, index_t seq);
  bool tokens = true;  ///< the batch is of sequences (tokens/s), not samples
};
// The entries, one header per family (gpu_plans_data.hpp: dp, tp, class-split, wsp;
// gpu_plans_zero.hpp: zero1-3, recompute; gpu_plans_pipe.hpp: 1f1b, 3d, gpipe, interleaved, zbh1).

inline index_t data_replicas(const context& ctx) { return ctx.mesh().shape().size(axis::data); }
inline index_t global_sequences(const context& ctx, const settings& s) {
  return s.sequences > 0 ? s.sequences : default_sequences * data_replicas(ctx);
}
inline index_t seq_of(const settings& s) { return s.seq > 0 ? s.seq : default_seq; }

inline plan_options options_for(const backend_ref& be, const settings& s) {
  plan_options o;
  o.backend = be;
  o.micro_batches = s.micro_batches;
  o.blocking = s.blocking;
  o.precision = s.precision_kind();  // the plan's precision, which the trainer trains in
  return o;
}
inline trainer_options trainer_for(int steps) {
  trainer_options t;
  t.progress = false;
  t.max_grad_norm = 1.0;
  t.log_every = steps;
  return t;
}

/// A trainer's run. The check (not timed): on the CPU, each step read at once;
/// on the device, the steps queued in one run and read at its end (the figures
/// kept on the device, trainer_options::log_every), so the check also holds
/// the two ways to each other. Timed: 2 warm-up steps, then `steps` in one run.
template <class Trainer, class Data, class Traffic, class Waits>
outcome drive(context& ctx, Trainer& t, Data& data, const settings& s, bool timed, const device_backend* dev, Traffic&& traffic,
              Waits&& comm_waits) {
  outcome r;
  if (!timed) {
    if (dev) r.losses = t.run(data, whale::steps{s.steps}).losses;
    else
      for (int i = 0; i < s.steps; ++i) r.losses.push_back(t.step(data, i));
    return r;
  }
  t.run(data, whale::steps{2});
  if (dev) dev->synchronize();
  barrier(ctx.world());
  const comm_stats dev0 = traffic(), host0 = ctx.world().stats();
  const std::int64_t waits0 = dev ? dev->host_waits() : -1, comm0 = comm_waits();
  const auto t0 = std::chrono::steady_clock::now();
  const auto run = t.run(data, whale::steps{s.steps});
  if (dev) dev->synchronize();
  r.step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / s.steps;
  r.losses = {run.loss_first(), run.loss_last()};
  comm_stats d = traffic(), h = ctx.world().stats();
  auto per_step = [&](comm_stats a, const comm_stats& b) {
    a.bytes_sent = (a.bytes_sent - b.bytes_sent) / s.steps;
    a.bytes_received = (a.bytes_received - b.bytes_received) / s.steps;
    a.operations = (a.operations - b.operations) / s.steps;
    return a;
  };
  r.device = per_step(d, dev0), r.host = per_step(h, host0);
  if (dev && waits0 >= 0) r.host_waits = (dev->host_waits() - waits0 + comm_waits() - comm0) / s.steps;
  return r;
}

/// A plan of type P on the GPT, trained by the trainer with AdamW and clipping.
template <class P> outcome train_gpt(context& ctx, const backend_ref& be, const settings& s, bool timed, const device_backend* dev) {
  auto p = make<P>(ctx, seed{42}, options_for(be, s));
  markov_data data(seed{7}, V, seq_of(s), global_sequences(ctx, s));
  trainer t(p, adamw{.lr = 1e-4f}, trainer_for(s.steps));
  return drive(ctx, t, data, s, timed, dev, [&] { return p.device_traffic(); }, [&] { return p.device_host_waits(); });
}

/// Model FLOPs of one step (workloads.md): 6 x non-embedding parameters x tokens + 12 L T^2 D B.
inline double gpt_flops(index_t sequences, index_t seq) {
  const double params = static_cast<double>(tp_gpt::cost().params - embedding<V, D>::param_count() -
                                            position_embedding<T, D>::param_count());
  const double tokens = static_cast<double>(sequences * seq);
  return 6.0 * params * tokens + 12.0 * static_cast<double>(L) * static_cast<double>(seq * seq * D) * static_cast<double>(sequences);
}

// ---- mesh rules ----
inline std::string on_data(int) { return ""; }
inline std::string on_model(int n) { return "model=" + std::to_string(n); }
inline std::string on_pipe(int n) { return "pipe=" + std::to_string(n); }
/// 3-D: pipe 2 and model 2 where 4 divides the ranks (the rest on data), else every rank on pipe.
inline std::string three_d(int n) {
  return n % 4 == 0 ? "pipe=2,model=2" : "pipe=" + std::to_string(n);
}

}  // namespace gpu_plans
