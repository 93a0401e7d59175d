// The reference-workload benchmark (shared/workloads.md): trains `mlp`, `xc`
// or `gpt` under a plan and prints one JSON line per measurement on stdout.
// Usage: bench_workloads --workload mlp|xc|gpt --plan single [--steps S] [--threads T]
// (scripts/bench builds it and launches mpirun for several ranks).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "bench_common.hpp"
#include "whale/models/gpt.hpp"
#include "whale/models/mlp.hpp"
#include "whale/models/xc.hpp"
#include "whale/nn/network.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;

namespace {

struct options {
  std::string workload = "mlp";
  std::string plan = "single";
  int steps = 7;  // 2 warm-up + 5 timed
  int threads = 1;
};

options parse(int argc, char** argv) {
  options o;
  if (const char* e = std::getenv("WHALE_THREADS")) o.threads = std::atoi(e);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument("bench: " + a + " needs a value");
      return argv[++i];
    };
    if (a == "--workload") o.workload = next();
    else if (a == "--plan") o.plan = next();
    else if (a == "--steps") o.steps = std::atoi(next().c_str());
    else if (a == "--threads" || a == "--threads-per-rank") o.threads = std::atoi(next().c_str());
    else throw std::invalid_argument("bench: unknown option " + a);
  }
  if (o.steps < 3) throw std::invalid_argument("bench: --steps must be at least 3 (2 are warm-up)");
  return o;
}

template <class M, class Data>
void run_single(const options& o, Data& data, const char* name, double params_counted, bool tokens) {
  network<M> net(seed{42});
  trainer_options to;
  to.progress = false;
  trainer t(net, sgd{.lr = 0.01f, .momentum = 0.9f}, to);
  std::vector<double> secs, losses;
  std::vector<cpu::gemm_call> log;
  for (int s = 0; s < o.steps; ++s) {
    auto b = t.fetch(data, s);
    if (s == 2) reset_memory_peaks();
    if (s == 0) cpu::set_gemm_log(&log);
    const auto t0 = std::chrono::steady_clock::now();
    losses.push_back(t.step_on(b, data.global_batch(), s));
    secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (s == 0) cpu::set_gemm_log(nullptr);
  }
  const double step_s = bench::median(std::vector<double>(secs.begin() + 2, secs.end()));
  const auto gl = bench::time_gemms(log);
  const double samples = static_cast<double>(data.global_batch());
  const double toks = samples * static_cast<double>(data.seq());
  const double mf = model_flops<M>(static_cast<index_t>(toks), data.seq());
  bench::json_line j;
  j.add("workload", name).add("plan", "single").add("ranks", 1).add("threads_per_rank", cpu::threads());
  j.add("step_s", step_s).add("samples_per_s", samples / step_s);
  if (tokens) j.add("tokens_per_s", toks / step_s);
  j.add("model_flops_per_step", mf).add("achieved_gflops_per_rank", mf / step_s / 1e9);
  j.add("sgemm_gflops", gl.gflops()).add("gemm_only_step_s", gl.seconds);
  j.add("step_over_gemm", step_s / gl.seconds);
  j.add("compute_only_step_s", step_s);
  j.add("comm_bytes_per_rank_per_step", 0LL);
  j.add("peak_rss_mib_per_rank", bench::peak_rss_mib());
  j.raw("memory_mib", bench::memory_json(memory_snapshot()));
  j.add("params", params_counted);
  j.add("loss_first", losses.front()).add("loss_last", losses.back());
  j.print();
}

}  // namespace

int main(int argc, char** argv) try {
  const auto o = parse(argc, argv);
  cpu::set_threads(o.threads);
  if (o.plan != "single")
    throw std::invalid_argument("bench: plan '" + o.plan + "' is not supported yet by bench_workloads (have: single)");
  if (o.workload == "mlp") {
    auto data = models::mlp_data(seed{7});
    run_single<models::mlp>(o, data, "mlp", static_cast<double>(models::mlp::cost().params), false);
  } else if (o.workload == "xc") {
    auto data = models::xc_data(seed{7});
    run_single<models::xc>(o, data, "xc", static_cast<double>(models::xc::cost().params), false);
  } else if (o.workload == "gpt") {
    auto data = models::gpt_data(seed{7});
    run_single<models::gpt>(o, data, "gpt", static_cast<double>(models::gpt::cost().params), true);
  } else {
    throw std::invalid_argument("bench: unknown workload '" + o.workload + "' (have: mlp, xc, gpt)");
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 2;
}
