// Lowers a reference workload's plan (shared/workloads.md) for any mesh, in
// one process and without MPI, and prints one rank's program (what it holds,
// each operation of a step with its bytes) and totals over every rank.
//   whale_plan --workload mlp|xc|gpt|bert-large|resnet50-100k|gpt-gpu|gpt-7b|gpt-13b --plan P --mesh data=64,pipe=4,model=4 [--rank R]
//              [--batch B] [--seq T] [--micro-batches M] [--schedule gpipe|1f1b] [--zero 0..3]
//              [--recompute] [--no-grad-norm] [--bucket-mib X] [--stage-blocks 1,2,..] [--precision fp32|bf16] [--summary] [--json]
// scripts/plan builds and runs it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/detail/parse.hpp"
#include "whale/models/gpt.hpp"
#include "whale/models/mlp.hpp"
#include "whale/models/xc.hpp"
#include "whale/nn/recompute.hpp"
#include "whale/plan/lower.hpp"
#include "whale/plan/memory.hpp"
#include "whale/plan/simulate.hpp"
#include "whale/detail/io.hpp"
#include "paper_workloads.hpp"
#include "search.hpp"

using namespace whale;
using bench::search::default_batch;
using bench::search::mesh_of;
using bench::search::plan_desc;

namespace {

struct args : bench::search::plan_query {
  std::string mesh = "data=1";
  int rank = 0;
  bool summary = false, json = false;
  std::string profile, trace;  ///< --simulate PROFILE: replay every rank's program on it; --trace: its spans
  int search = 0;              ///< --search N: every plan of the workload on N ranks, simulated and ranked
  double memory_limit_mib = 0; ///< --memory-limit-mib X: plans over it are refused (0: no limit)
  bool pipe_outer = false;     ///< --stages-across-nodes: simulate with pipe_outer_devices (the stages on other nodes)
  bool tie_given = false;      ///< --plan-tie F given (it belongs to --search)
};

[[noreturn]] void usage(const std::string& why) {
  throw std::invalid_argument(
      why + "\nusage: whale_plan --workload mlp|xc|gpt|bert-large|resnet50-100k|gpt-gpu|gpt-7b|gpt-13b --plan single|dp|hybrid|pipeline|zero1|zero2|zero3|3d "
            "--mesh data=D,pipe=P,model=M [--rank R] [--batch B] [--seq T] [--micro-batches M] "
            "[--schedule gpipe|1f1b] [--zero 0..3] [--recompute] [--no-grad-norm] [--bucket-mib X] "
            "[--stage-blocks 1,2,...] [--precision fp32|bf16] [--summary] [--json] [--optimizer-bytes 8|4|0] [--simulate PROFILE [--ranks-per-node K] [--stages-across-nodes] [--trace FILE]] "
            "[--search N --simulate PROFILE [--memory-limit-mib X] [--plan-tie F]] (with --search, --plan and --mesh are chosen)");
}

args parse(int argc, char** argv) {
  args a;
  a.o.global_batch = -1;
  a.o.seq = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage("whale_plan: " + f + " needs a value");
      return argv[++i];
    };
    if (f == "--workload") a.workload = value();
    else if (f == "--plan") a.plan = value();
    else if (f == "--mesh") a.mesh = value();
    else if (f == "--rank") a.rank = static_cast<int>(detail::parse_int(value(), "--rank", 0, 1 << 20));
    else if (f == "--batch") a.o.global_batch = detail::parse_int(value(), "--batch", 1, 1 << 24);
    else if (f == "--seq") a.o.seq = detail::parse_int(value(), "--seq", 1, 1 << 20);
    else if (f == "--micro-batches") a.o.micro_batches = static_cast<int>(detail::parse_int(value(), "--micro-batches", 1, 1 << 16));
    else if (f == "--schedule") a.schedule = value();
    else if (f == "--zero") a.zero = static_cast<int>(detail::parse_int(value(), "--zero", 0, 3));
    else if (f == "--bucket-mib") a.o.bucket_mib = detail::parse_double(value(), "--bucket-mib", 0, 1 << 16, true);
    else if (f == "--stage-blocks") {
      const std::string v = value();
      for (std::size_t at = 0; at <= v.size();) {
        const auto end = std::min(v.find(',', at), v.size());
        a.o.stage_blocks.push_back(static_cast<int>(detail::parse_int(v.substr(at, end - at), "--stage-blocks", 0, 1 << 16)));
        at = end + 1;
      }
    } else if (f == "--recompute") a.recompute = true;
    else if (f == "--clip") a.o.grad_norm = true;  // the default: the trainer computes the norm every step
    else if (f == "--no-grad-norm") a.o.grad_norm = false;
    else if (f == "--simulate") a.profile = value();
    else if (f == "--search") a.search = static_cast<int>(detail::parse_int(value(), "--search", 1, 1 << 16));
    else if (f == "--plan-tie") a.plan_tie = detail::parse_double(value(), "--plan-tie", 0, 1), a.tie_given = true;  // 1 itself: the search's error
    else if (f == "--memory-limit-mib") a.memory_limit_mib = detail::parse_double(value(), "--memory-limit-mib", 0, 1 << 30, true);
    else if (f == "--optimizer-bytes") a.o.optimizer_bytes_per_param = static_cast<int>(detail::parse_int(value(), "--optimizer-bytes", 0, 64));
    else if (f == "--trace") a.trace = value();
    else if (f == "--stages-across-nodes") a.pipe_outer = true;
    else if (f == "--ranks-per-node") a.per_node = static_cast<int>(detail::parse_int(value(), "--ranks-per-node", 1, 1 << 20));
    else if (f == "--precision") a.trains_in = parse_precision(value(), "whale_plan: --precision");
    else if (f == "--summary") a.summary = true;
    else if (f == "--json") a.json = true;
    else if (f == "--help" || f == "-h") usage("whale_plan: lowers a reference workload's plan for a mesh");
    else usage("whale_plan: unknown option '" + f + "'");
  }
  if (a.tie_given && !a.search) usage("whale_plan: --plan-tie is the search's (give --search N)");
  if (a.search && a.profile.empty()) usage("whale_plan: --search needs --simulate PROFILE (the device to price the plans on)");
  if (a.search && a.zero >= 0)
    usage("whale_plan: --zero is not for --search: the search prices the ZeRO levels itself (dp and ZeRO 1-3, "
          "and 3-D plans with the lowest level that fits)");
  if (a.search) a.plan = "dp";  // each candidate sets its own
  if (a.workload.empty() || a.plan.empty()) usage("whale_plan: --workload and --plan are required");
  if (!a.trace.empty() && a.profile.empty()) usage("whale_plan: --trace needs --simulate PROFILE");
  if (a.pipe_outer && a.profile.empty()) usage("whale_plan: --stages-across-nodes needs --simulate PROFILE");
  if (const auto& w = bench::search::workload_of(a.workload); a.o.seq > w.max_seq)
    usage("whale_plan: --seq " + std::to_string(a.o.seq) + " is longer than the " + std::to_string(w.max_seq) +
          " positions of the workload '" + a.workload + "'");
  if (a.schedule != "gpipe" && a.schedule != "1f1b") usage("whale_plan: --schedule must be gpipe or 1f1b (got '" + a.schedule + "')");
  return a;
}

/// --search N: every plan of the workload on N ranks, simulated and ranked (search.hpp), printed.
int search(const args& base) {
  const device_profile dev = device_profile::load(base.profile);
  const int n = base.search;
  const auto cs = bench::search::rank_plans(base, n, dev, base.memory_limit_mib);
  const auto& best = cs.front();
  if (base.json) {
    for (const auto& c : cs)
      if (c.valid) {
        const auto& w = bench::search::workload_of(base.workload);
        const index_t batch = default_batch(c.a, mesh_of(c.mesh)), seq = c.a.o.seq > 0 ? c.a.o.seq : w.seq;
        const double mfu = dev.peak_flops > 0 ? bench::search::model_flops(plan_desc(c.a), batch, seq) / c.step_s / (dev.peak_flops * n) : 0.0;
        std::printf("{\"workload\": \"%s\", \"candidate\": \"%s\", \"ranks\": %d, \"profile\": \"%s\", \"predicted_step_s\": %.6f, "
                    "\"predicted_tokens_per_s\": %.1f, \"predicted_memory_mib\": %.2f, \"fits\": %s, \"chosen\": %s, \"tie\": %s%s}\n",
                    base.workload.c_str(), c.label().c_str(), n, dev.name.c_str(), c.step_s,
                    static_cast<double>(batch * seq) / c.step_s, c.memory_mib, c.fits ? "true" : "false",
                    &c == &best ? "true" : "false", c.tie ? "true" : "false",
                    mfu > 0 ? (", \"predicted_mfu\": " + std::to_string(mfu)).c_str() : "");
      }
    return 0;
  }
  std::cout << "searched " << cs.size() << " plans of " << base.workload << " on " << n << " ranks with the profile '" << dev.name << "'"
            << (base.memory_limit_mib > 0 ? " and at most " + std::to_string(base.memory_limit_mib) + " MiB per rank" : std::string()) << ":\n";
  std::cout << "  chosen: " << best.label() << ": predicted " << best.step_s << " s per step, " << best.memory_mib
            << " MiB on the largest rank (its slowest rank computes " << best.slowest.compute_s << " s, communicates "
            << best.slowest.comm_s << " s, waits " << best.slowest.wait_s << " s)\n";
  if (best.tie && cs.size() > 1)
    std::cout << "  (" << cs[1].label() << " is predicted " << (1.0 - cs[1].step_s / best.step_s) * 100
              << "% faster: within the tie band of " << base.plan_tie * 100 << "%, so "
              << (best.order < cs[1].order ? "the simpler plan is chosen" : "the plan that leaves 10% of the memory limit free is chosen")
              << ")\n";
  int shown = 0, over = 0, broken = 0;
  for (const auto& c : cs) {
    if (&c == &best) continue;
    if (!c.valid) {
      if (++broken <= 4) std::cout << "  cannot run: " << c.label() << ": " << c.why << "\n";
      continue;
    }
    if (!c.fits) {
      if (++over <= 4) std::cout << "  over memory: " << c.label() << ": " << c.memory_mib << " MiB\n";
      continue;
    }
    if (++shown > 8) continue;
    const double behind = (c.step_s / best.step_s - 1) * 100;  // negative: faster, chosen against by a tie
    std::cout << "  " << c.label() << ": " << c.step_s << " s (" << (behind >= 0 ? "+" : "") << behind << "%: compute "
              << (c.slowest.compute_s - best.slowest.compute_s >= 0 ? "+" : "") << c.slowest.compute_s - best.slowest.compute_s
              << " s, communication " << (c.slowest.comm_s - best.slowest.comm_s >= 0 ? "+" : "") << c.slowest.comm_s - best.slowest.comm_s
              << " s, waiting " << (c.slowest.wait_s - best.slowest.wait_s >= 0 ? "+" : "") << c.slowest.wait_s - best.slowest.wait_s
              << " s), " << c.memory_mib << " MiB\n";
  }
  if (shown > 8 || over > 4 || broken > 4)
    std::cout << "  (" << std::max(0, shown - 8) << " more that run, " << std::max(0, over - 4) << " more over memory, "
              << std::max(0, broken - 4) << " more that cannot run; --json lists every plan that runs)\n";
  return 0;
}

int run(int argc, char** argv) {
  bench::paper::add_workloads();
  auto a = parse(argc, argv);
  if (a.search) return search(a);
  const auto mesh = mesh_of(a.mesh);
  const auto d = plan_desc(a);
  if (a.o.seq < 0) a.o.seq = bench::search::workload_of(a.workload).seq;
  a.o.balance_seq = a.o.seq;
  a.o.global_batch = default_batch(a, mesh);
  a.o.zero_level = a.zero;
  if (a.rank >= mesh.size()) usage("whale_plan: --rank " + std::to_string(a.rank) + " is not in a mesh of " + std::to_string(mesh.size()) + " ranks");

  const auto t0 = std::chrono::steady_clock::now();
  std::int64_t max_sent = 0, sum_sent = 0, max_state = 0, max_memory = 0;
  index_t max_held = 0;
  double max_flops = 0;
  program mine;
  const bool simulating = !a.profile.empty();
  const device_profile dev = simulating ? device_profile::load(a.profile) : device_profile{};
  a.o.bf16 = bench::search::prices_bf16(a, dev, "whale_plan");  // the job's precision: its master weights, its refusals
  if (!a.trace.empty()) {
    if (const auto why = detail::output_path_problem(a.trace); !why.empty()) usage("whale_plan: --trace '" + a.trace + "': " + why);
  }
  std::vector<program> all;
  for (int r = 0; r < mesh.size(); ++r) {
    auto p = lower(d, mesh, r, a.o);
    if (simulating) all.push_back(p);
    const auto t = p.totals();
    max_sent = std::max(max_sent, t.bytes_sent);
    sum_sent += t.bytes_sent;
    max_held = std::max(max_held, t.params_held);
    max_state = std::max(max_state, t.param_bytes + t.grad_bytes + t.optimizer_bytes);
    max_flops = std::max(max_flops, t.flops);
    max_memory = std::max(max_memory, predict_memory(d, p).total());
    if (r == a.rank) mine = std::move(p);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (simulating) {
    const auto sim = simulate(d, all, dev, a.per_node, a.pipe_outer ? pipe_outer_devices(mesh) : std::vector<int>{});
    if (!a.trace.empty()) write_trace(a.trace, sim.spans);
    const auto& rt = sim.ranks[static_cast<std::size_t>(a.rank)];
    const double tokens = static_cast<double>(a.o.global_batch * a.o.seq);
    const double flops = bench::search::model_flops(d, a.o.global_batch, a.o.seq);
    const double mfu = dev.peak_flops > 0 ? flops / sim.step_s / (dev.peak_flops * mesh.size()) : 0.0;
    if (a.json) {
      std::printf("{\"workload\": \"%s\", \"plan\": \"%s\", \"mesh\": \"%s\", \"ranks\": %d, \"profile\": \"%s\", "
                  "\"precision\": \"%s\", \"trains_in\": \"%s\", \"predicted_step_s\": %.6f, \"predicted_bubble\": %.4f, \"rank\": %d, \"compute_s\": %.6f, "
                  "\"comm_s\": %.6f, \"wait_s\": %.6f, \"max_predicted_memory_mib_per_rank\": %.2f, \"tokens_per_step\": %.0f, "
                  "\"predicted_tokens_per_s\": %.1f, \"model_flops_per_step\": %.6g%s}\n",
                  a.workload.c_str(), a.plan.c_str(), mesh.spec().c_str(), mesh.size(), dev.name.c_str(),
                  dev.kernel_precision.empty() ? "analytic" : dev.kernel_precision.c_str(), a.o.bf16 ? "bf16" : "fp32", sim.step_s, sim.bubble(), a.rank,
                  rt.compute_s, rt.comm_s, rt.wait_s, static_cast<double>(max_memory) / 1048576.0, tokens, tokens / sim.step_s, flops,
                  mfu > 0 ? (", \"predicted_mfu\": " + std::to_string(mfu)).c_str() : "");
      return 0;
    }
    std::cout << "simulated step of " << a.workload << " " << a.plan << " on " << mesh.spec() << " with profile '" << dev.name
              << "': " << sim.step_s << " s (busiest rank idle " << sim.bubble() * 100 << "%), " << tokens / sim.step_s
              << " tokens/s" << (mfu > 0 ? ", MFU " + std::to_string(mfu) : std::string()) << "\n";
    for (int r = 0; r < mesh.size() && r < 16; ++r) {
      const auto& q = sim.ranks[static_cast<std::size_t>(r)];
      std::cout << "  rank " << r << ": compute " << q.compute_s << " s, communication " << q.comm_s << " s, waiting " << q.wait_s << " s";
      for (const auto& [what, t] : q.comm_by_what) std::cout << "; " << what << " " << t << " s";
      std::cout << "\n";
    }
    if (mesh.size() > 16) std::cout << "  (" << mesh.size() - 16 << " more ranks)\n";
    return 0;
  }
  if (a.json) {
    std::printf("{\"workload\": \"%s\", \"plan\": \"%s\", \"mesh\": \"%s\", \"ranks\": %d, \"zero\": %d, "
                "\"micro_batches\": %d, \"schedule\": \"%s\", \"lower_s\": %.4f, \"max_bytes_sent_per_rank_per_step\": %lld, "
                "\"total_bytes_sent_per_step\": %lld, \"max_params_per_rank\": %lld, \"max_model_state_bytes_per_rank\": %lld, "
                "\"max_gflop_per_rank_per_step\": %.4f, \"max_predicted_memory_mib_per_rank\": %.2f, \"trains_in\": \"%s\"}\n",
                a.workload.c_str(), a.plan.c_str(), mesh.spec().c_str(), mesh.size(), mine.zero_level,
                mine.micro_batches, mine.schedule.c_str(), secs, static_cast<long long>(max_sent),
                static_cast<long long>(sum_sent), static_cast<long long>(max_held), static_cast<long long>(max_state),
                max_flops / 1e9, static_cast<double>(max_memory) / 1048576.0, a.o.bf16 ? "bf16" : "fp32");
    return 0;
  }
  if (!a.summary) std::cout << mine << "  predicted memory: " << predict_memory(d, mine) << "\n";
  std::cout << "all " << mesh.size() << " ranks lowered (training in " << (a.o.bf16 ? "bf16" : "fp32") << ") in " << secs << " s: at most " << max_sent
            << " B sent per rank per step (" << sum_sent << " B in all), at most " << max_held
            << " parameters and " << max_state << " B of model state per rank, at most " << max_flops / 1e9
            << " GFLOP per rank per step, at most " << static_cast<double>(max_memory) / 1048576.0
            << " MiB of predicted memory per rank\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
