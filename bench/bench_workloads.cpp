// The reference-workload benchmark (shared/workloads.md): trains `mlp`, `xc` or
// `gpt` under a plan and prints one JSON line (rank 0 only) on stdout.
//   bench_workloads --workload mlp|xc|gpt|deep-mlp|llama-small|gpt2-small --plan P [--steps S] [--threads-per-rank T]
//                   [--simulate PROFILE] [plan options]
// --simulate (plans dp and pipeline): also the simulator's step on that device
// profile, for where the ranks are (predicted_step_s).
// scripts/bench builds it and launches mpirun for several ranks; use that.
//
// Adding a plan (hybrid, pipeline, zero1/2/3, ...):
//   1. write bench/plans/<name>.hpp: a struct in bench::plans with
//        static constexpr const char* name, help;
//        template <class W> static constexpr bool supports = ...;   // W: mlp/xc/gpt_workload
//        template <class W> static void run(bench::config&);          // rank 0 prints one JSON line
//      read its own options from config::args (value/text/flag), then call
//      args.done(name) before any work; see plans/dp.hpp for a full one;
//   2. add its table entry to one of plans/entries_*.cpp (translation units that
//      compile in parallel), declare it below and add one line to `plan_table`.
// Nothing else changes: parsing, workload dispatch and errors are shared
// (bench_common.hpp), and an unsupported workload is a clear error.
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "whale/detail/parse.hpp"
#include "whale/plan/device_text.hpp"

namespace bench {  // plans/entries_*.cpp
plan_entry entry_single();
plan_entry entry_dp();
plan_entry entry_hybrid();
plan_entry entry_hetpipe();
plan_entry entry_auto();
plan_entry entry_pipeline();
plan_entry entry_threed();
plan_entry entry_zero1();
plan_entry entry_zero2();
plan_entry entry_zero3();
}  // namespace bench

namespace {

// ---- the plan table: one line per plan ----
const bench::plan_entry plan_table[] = {
    bench::entry_single(), bench::entry_dp(),    bench::entry_hybrid(), bench::entry_pipeline(),
    bench::entry_zero1(),  bench::entry_zero2(), bench::entry_zero3(),  bench::entry_threed(),
    bench::entry_hetpipe(), bench::entry_auto(),
};

}  // namespace

const bench::plan_entry* bench::find_plan(const std::string& name) {
  for (const auto& p : plan_table)
    if (name == p.name) return &p;
  return nullptr;
}

namespace {

std::string plan_list() {
  std::string s;
  for (const auto& p : plan_table) s += std::string("\n  ") + p.name + ": " + p.help;
  return s;
}

// Common options; the rest go to the plan (config::args). --threads and --mesh
// are taken earlier by whale::context::init.
bench::config parse(int argc, char** argv, whale::context& ctx) {
  bench::config c;
  c.ctx = &ctx;
  std::vector<std::string> rest;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw bench::usage_error("bench: " + a + " needs a value");
      return argv[++i];
    };
    if (a == "--workload") c.workload = next();
    else if (a == "--plan") c.plan = next();
    else if (a == "--steps") c.steps = static_cast<int>(whale::detail::parse_int(next(), "--steps", 3, 1000000));
    else if (a == "--simulate") {
      const std::string path = next();
      try {  // every rank reads it before any work: a bad file is a usage error on each
        c.simulate = whale::device_profile::load(path);
      } catch (const std::exception& e) {
        throw bench::usage_error(std::string("bench: --simulate: ") + e.what());
      }
    } else if (a == "--threads-per-rank")
      whale::cpu::set_threads(static_cast<int>(whale::detail::parse_int(next(), "--threads-per-rank", 1, 4096)));
    else if (a == "--help" || a == "-h")
      throw bench::usage_error("usage: bench_workloads --workload mlp|xc|gpt|deep-mlp|llama-small|gpt2-small --plan P [--steps S] "
                               "[--threads-per-rank T] [--simulate PROFILE] [plan options]\nplans:" + plan_list());
    else rest.push_back(a);
  }
  if (c.workload.empty() || c.plan.empty()) throw bench::usage_error("bench: --workload and --plan are required");
  if (c.steps < 3) throw bench::usage_error("bench: --steps must be at least 3 (2 are warm-up)");
  if (c.simulate && c.plan != "dp" && c.plan != "pipeline")
    throw bench::usage_error("bench: --simulate is for --plan dp and --plan pipeline (this is '" + c.plan + "')");
  c.args = bench::plan_args(std::move(rest));
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  // --plan pipeline puts every rank on the pipe axis unless a mesh is given: one
  // context for the whole run, so that every error prints its own message.
  bool pipeline = false, mesh = std::getenv("WHALE_MESH") != nullptr;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--plan" && i + 1 < argc && std::string(argv[i + 1]) == "pipeline") pipeline = true;
    if (a == "--mesh") mesh = true;
  }
  if (pipeline && !mesh) {
    const char* n = std::getenv("OMPI_COMM_WORLD_SIZE");  // set by mpirun; one process without it
    ::setenv("WHALE_MESH", (std::string("pipe=") + (n ? n : "1")).c_str(), 1);
  }
  auto ctx = whale::context::init(argc, argv);
  std::string usage;
  ctx.guard([&] {
    // Usage errors come from the command line, so every rank throws the same one,
    // before the plan communicates: report once and exit 2 (no job abort).
    try {
      bench::config c;
      try {
        c = parse(argc, argv, ctx);
      } catch (const whale::detail::parse_error& e) {  // a bad value of a common option
        throw bench::usage_error(e.what());
      }
      const bench::plan_entry* p = nullptr;
      for (const auto& e : plan_table)
        if (c.plan == e.name) p = &e;
      if (!p) throw bench::usage_error("bench: unknown plan '" + c.plan + "'; have:" + plan_list());
      p->run(c);
    } catch (const bench::usage_error& e) {
      usage = e.what();
    }
  });
  if (!usage.empty() && ctx.rank() == 0) std::fprintf(stderr, "%s\n", usage.c_str());
  return usage.empty() ? 0 : 2;
}
