// Every plan on GPUs: trains any plan of docs/compositions.md on one GPU per
// rank (cuda_backend; NCCL for the collectives and pipeline messages), or on
// the guarded backend (the CPU standing in for a GPU, counting host waits),
// and prints one JSON line: tokens/s, MFU against the dense bf16 peak, and the
// bytes each rank sent per step through the device's communicators and MPI.
// --check instead trains a few steps on the device and on the CPU backend and
// compares the losses on every rank (the guarded backend: to the bit).
//
//   mpirun -np N gpu_plans --plan P [--backend cuda|guarded] [--steps S] [--precision bf16|fp32]
//                          [--sequences B] [--seq T] [--micro-batches m] [--blocking] [--staleness D]
//                          [--mesh SPEC] [--check] [--list]
// scripts/bench --backend cuda --plan P --ranks N runs it. Exit status: 0 done (a
// check passed), 1 a check failed, 2 bad arguments or no device (the message
// names how many GPUs this process sees and how many ranks share its node).
#include <cmath>
#include <cstdlib>
#include <memory>
#include <stdexcept>

#include "gpu_plans.hpp"
#include "gpu_plans_data.hpp"
#include "gpu_plans_pipe.hpp"
#include "gpu_plans_zero.hpp"
#include "whale/backend/guarded.hpp"
#if defined(WHALE_HAS_CUDA)
#include "whale/backend/cuda.hpp"
#endif

namespace {

using namespace gpu_plans;

std::vector<entry> all_entries() {
  std::vector<entry> e = data_entries();
  for (auto& z : zero_entries()) e.push_back(z);
  for (auto& p : pipeline_entries()) e.push_back(p);
  return e;
}

struct usage : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

settings parse(int argc, char** argv, bool& list) {
  settings s;
  bool steps_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw usage("gpu_plans: " + a + " needs a value");
      return argv[++i];
    };
    if (a == "--plan") s.plan = next();
    else if (a == "--backend") s.backend = next();
    else if (a == "--precision") s.prec = next();
    else if (a == "--steps") s.steps = static_cast<int>(detail::parse_int(next(), "--steps", 1, 100000)), steps_given = true;
    else if (a == "--sequences") s.sequences = detail::parse_int(next(), "--sequences", 1, 1 << 20);
    else if (a == "--seq") s.seq = detail::parse_int(next(), "--seq", 1, T);
    else if (a == "--micro-batches") s.micro_batches = static_cast<int>(detail::parse_int(next(), "--micro-batches", 1, 1 << 16));
    else if (a == "--staleness") s.staleness = static_cast<int>(detail::parse_int(next(), "--staleness", 0, 1000));
    else if (a == "--check") s.check = true;
    else if (a == "--blocking") s.blocking = true;
    else if (a == "--list") list = true;
    else throw usage("gpu_plans: unknown argument '" + a + "' (see the usage at the top of bench/gpu_plans.cu)");
  }
  if (s.backend != "cuda" && s.backend != "guarded")
    throw usage("gpu_plans: --backend '" + s.backend + "': expected cuda or guarded");
  if (s.prec != "bf16" && s.prec != "fp32") throw usage("gpu_plans: --precision '" + s.prec + "': expected bf16 or fp32");
  if (s.check && !steps_given) s.steps = 3;
  if (!list && s.plan.empty()) throw usage("gpu_plans: --plan is required (--list shows them)");
  return s;
}

/// Ranks of the job, as its launcher says, before MPI starts (for a plan's default mesh).
int launched_ranks() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE", "SLURM_NTASKS"})
    if (const char* e = std::getenv(v)) return static_cast<int>(detail::parse_int(e, v, 1, 1 << 20));
  return 1;
}

std::string json_number(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  // The plan's default mesh, unless --mesh or WHALE_MESH says otherwise: set before the context starts.
  const auto entries = all_entries();
  {
    std::string plan;
    bool mesh = std::getenv("WHALE_MESH") != nullptr;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--plan" && i + 1 < argc) plan = argv[i + 1];
      if (a == "--mesh") mesh = true;
    }
    for (const auto& e : entries)
      if (e.name == plan && !mesh) {
        const std::string m = e.mesh(launched_ranks());
        if (!m.empty()) ::setenv("WHALE_MESH", m.c_str(), 1);
      }
  }
  auto ctx = context::init(argc, argv);
  settings s;
  bool list = false;
  const entry* plan = nullptr;
  try {
    s = parse(argc, argv, list);
    for (const auto& e : entries)
      if (s.plan == e.name) plan = &e;
    if (!list && !plan) {
      std::string have;
      for (const auto& e : entries) have += std::string(have.empty() ? "" : ", ") + e.name;
      throw usage("gpu_plans: unknown plan '" + s.plan + "' (have: " + have + ")");
    }
  } catch (const std::invalid_argument& e) {  // the same on every rank: said once
    if (ctx.rank() == 0) std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  if (list) {
    if (ctx.rank() == 0)
      for (const auto& e : entries) std::printf("%-12s %s (mesh for 8 ranks: %s)\n", e.name, e.help,
                                                e.mesh(8).empty() ? "data=8" : e.mesh(8).c_str());
    return 0;
  }

  // The device, before any communication: no device, or fewer than this node's ranks, is an error on every rank.
  device_backend dev;
  std::unique_ptr<guarded_backend> guarded;
#if defined(WHALE_HAS_CUDA)
  std::unique_ptr<cuda_backend> gpu;
#endif
  std::string failed;
  try {
    if (s.backend == "guarded") {
      guarded = std::make_unique<guarded_backend>();
      dev.ref = backend_ref(*guarded);
      dev.host_waits = [g = guarded.get()] { return g->ledger().host_syncs + g->ledger().device_to_host; };
    } else {
#if defined(WHALE_HAS_CUDA)
      gpu = std::make_unique<cuda_backend>();
      dev.ref = backend_ref(*gpu);
      dev.synchronize = [g = gpu.get()] { g->synchronize(); };
#else
      throw std::runtime_error("this gpu_plans was built without CUDA");
#endif
    }
  } catch (const std::exception& e) {
    failed = e.what();
  }
  int bad = failed.empty() ? 0 : 1;
  all_reduce(ctx.world(), view<int>(&bad, {1}), reduce_op::max);
  if (bad) {
    if (!failed.empty()) std::fprintf(stderr, "gpu_plans: rank %d: %s\n", ctx.rank(), failed.c_str());
    else std::fprintf(stderr, "gpu_plans: rank %d: another rank found no usable device\n", ctx.rank());
    return 2;
  }

  return ctx.guard([&] {
    const index_t global = plan->tokens ? global_sequences(ctx, s) : 0;
    if (s.check) {
      const auto on_dev = plan->run(ctx, dev.ref, s, false, &dev);
      const auto on_cpu = plan->run(ctx, backend_ref{}, s, false, nullptr);
      // the guarded backend computes the CPU's bits; a GPU's sums round differently. Under WSP with
      // several workers the holders add the workers' updates in the order they arrive, on either
      // backend, and bf16's rounding of the weights can magnify a last bit (2 workers: 1.7e-4 seen)
      const bool unordered = s.plan == "wsp" && ctx.mesh().shape().size(axis::data) > 1;
      const double guarded_tol = unordered ? (s.prec == "bf16" ? 2e-3 : 1e-5) : 0.0;
      const double tol = s.backend == "guarded" ? guarded_tol : (s.prec == "bf16" ? 2e-2 : 2e-3);
      double worst = 0;
      for (std::size_t i = 0; i < on_cpu.losses.size() && i < on_dev.losses.size(); ++i)
        worst = std::max(worst, std::abs(on_dev.losses[i] - on_cpu.losses[i]) / std::max(1e-12, std::abs(on_cpu.losses[i])));
      int ok = on_cpu.losses.size() == on_dev.losses.size() && worst <= tol ? 1 : 0;
      all_reduce(ctx.world(), view<int>(&ok, {1}), reduce_op::min);
      all_reduce(ctx.world(), view<double>(&worst, {1}), reduce_op::max);
      if (ctx.rank() == 0)
        std::printf("{\"workload\": \"%s\", \"plan\": \"%s\", \"backend\": \"%s\", \"measure\": \"check_against_cpu\", "
                    "\"mesh\": \"%s\", \"ranks\": %d, \"precision\": \"%s\", \"steps\": %d, \"seq\": %lld, "
                    "\"loss_first\": %s, \"loss_last\": %s, \"worst_relative_loss_difference\": %s, \"tolerance\": %s, "
                    "\"passed\": %s}\n",
                    workload, plan->name, s.backend.c_str(), ctx.mesh().shape().spec().c_str(), ctx.size(), s.prec.c_str(),
                    s.steps, static_cast<long long>(seq_of(s)), json_number(on_dev.losses.front()).c_str(),
                    json_number(on_dev.losses.back()).c_str(), json_number(worst).c_str(), json_number(tol).c_str(),
                    ok ? "true" : "false");
      return ok ? 0 : 1;
    }
    const auto r = plan->run(ctx, dev.ref, s, true, &dev);
    double step = r.step_s;
    double dev_bytes = static_cast<double>(r.device.bytes_sent), host_bytes = static_cast<double>(r.host.bytes_sent);
    double waits = static_cast<double>(r.host_waits);
    all_reduce(ctx.world(), view<double>(&step, {1}), reduce_op::max);  // the slowest rank's step
    all_reduce(ctx.world(), view<double>(&dev_bytes, {1}), reduce_op::max);
    all_reduce(ctx.world(), view<double>(&host_bytes, {1}), reduce_op::max);
    all_reduce(ctx.world(), view<double>(&waits, {1}), reduce_op::max);
    const index_t rows = plan->tokens ? global : (s.sequences > 0 ? s.sequences : detail_data::xc_rows_per_replica * data_replicas(ctx));
    const double flops = plan->flops(rows, seq_of(s));
    const double tokens = plan->tokens ? static_cast<double>(global * seq_of(s)) : 0.0;  // (class-split: samples, not tokens)
    if (ctx.rank() == 0)
      std::printf("{\"workload\": \"%s\", \"plan\": \"%s\", \"backend\": \"%s\", \"mesh\": \"%s\", \"ranks\": %d, "
                  "\"precision\": \"%s\", \"sequences\": %lld, \"seq\": %lld, \"steps\": %d, \"step_s\": %s, "
                  "\"tokens_per_s\": %s, \"model_flops_per_step\": %s, \"mfu_vs_dense_bf16_peak\": %s, "
                  "\"device_bytes_sent_per_rank_step\": %s, \"mpi_bytes_sent_per_rank_step\": %s, "
                  "\"host_waits_per_step\": %s, \"buckets\": \"%s\", \"loss_first\": %s, \"loss_last\": %s}\n",
                  workload, plan->name, s.backend.c_str(), ctx.mesh().shape().spec().c_str(), ctx.size(), s.prec.c_str(),
                  static_cast<long long>(rows), static_cast<long long>(seq_of(s)), s.steps, json_number(step).c_str(),
                  json_number(tokens / step).c_str(), json_number(flops).c_str(),
                  json_number(flops / step / (989e12 * ctx.size())).c_str(), json_number(dev_bytes).c_str(),
                  json_number(host_bytes).c_str(), waits < 0 ? "null" : json_number(waits).c_str(),
                  s.blocking ? "blocking" : "overlapped", json_number(r.losses.front()).c_str(),
                  json_number(r.losses.back()).c_str());
    return 0;
  });
}
