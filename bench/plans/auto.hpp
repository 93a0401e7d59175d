// Plan `auto`: the plan search (search.hpp) chooses, on this machine's device
// profile (bench/profiles/vm-<ranks>.txt unless --profile), the plan with the
// smallest predicted step time that fits, or the simplest predicted within
// --plan-tie (default 2%) of it; then that plan runs as its own benchmark,
// and its JSON line carries the choice, the prediction and the runners-up.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "../bench_common.hpp"
#include "../inter_node.hpp"
#include "../search.hpp"

namespace bench::plans {

struct auto_choice {
  static constexpr const char* name = "auto";
  static constexpr const char* help =
      "the plan search chooses the plan (fastest predicted that fits, or the simplest within --plan-tie F of it, "
      "default 0.02) on --profile FILE (default "
      "bench/profiles/vm-<ranks>.txt; --ranks-per-node K for a cluster's profile; on several hosts, checked against "
      "where the ranks are, and taken from them if not given), optionally under --memory-limit-mib X, "
      "and runs it; the line adds "
      "auto_plan, predicted_step_s, auto_tie, predicted_memory_mib and the runners-up";
  template <class W> static constexpr bool supports = !W::time_to_loss;

  template <class W> static void run(config& c) {
    using namespace whale;
    const std::string profile = c.args.text("--profile", "bench/profiles/vm-" + std::to_string(c.ranks()) + ".txt");
    const double limit = c.args.value("--memory-limit-mib", 0);
    const int per_node = static_cast<int>(c.args.count("--ranks-per-node", 0, 1, 1000000));
    const double tie = c.args.value("--plan-tie", 0.02);
    c.args.done(name);
    if (::access(profile.c_str(), R_OK) != 0)
      throw usage_error("bench: --plan auto: cannot read the device profile '" + profile +
                        "'; measure this machine with scripts/profile --ranks " + std::to_string(c.ranks()) +
                        " or give --profile FILE");
    if (const auto env = plan_options::from_env().precision; env != precision::fp32)
      throw usage_error("bench: --plan auto runs its choice in fp32 (WHALE_PRECISION says " + std::string(to_string(env)) +
                        "); bf16 mixed precision is measured with --plan single or dp --precision bf16");
    const auto dev = device_profile::load(profile);
    if (const auto why = profile_precision_refusal(dev.kernel_precision, precision::fp32, "bench --plan auto trains its choice in fp32", true);
        !why.empty())
      throw usage_error("bench: --plan auto: " + profile + ": " + why);
    const int planned = placed_per_node(c, per_node, dev);
    search::plan_query q;
    q.workload = W::name;
    q.o.global_batch = -1;
    q.o.seq = -1;
    q.o.optimizer_bytes_per_param = 4;  // the benchmarks' SGD with momentum
    q.per_node = planned;               // 0: the profile's node line, else one node
    q.plan_tie = tie;
    q.trains_in = precision::fp32;  // the plans the bench runs train in fp32
    const auto cs = search::rank_plans(q, c.ranks(), dev, limit);
    const auto& best = cs.front();

    // the bench plan that runs the chosen one, with its options
    std::string plan = best.a.plan;
    std::vector<std::string> args;
    const auto mesh = search::mesh_of(best.mesh);
    if (plan == "pipeline" || plan == "3d") {
      args = {"--schedule", best.a.schedule, "--micro-batches", std::to_string(best.a.o.micro_batches)};
      if (best.a.recompute) args.push_back("--recompute");
      if (best.a.zero > 0) {
        if (best.a.recompute)
          throw usage_error("bench: --plan auto: the search chose '" + best.label() +
                            "', which bench_workloads does not build (its 3-D plan takes --zero only without "
                            "--recompute, to keep its build small); scripts/plan --search lists the runners-up");
        args.insert(args.end(), {"--zero", std::to_string(best.a.zero)});
      }
      // a pipeline beside data parallelism runs as the 3-D plan with one model rank (the same arithmetic)
      if (plan == "pipeline" && mesh.size(axis::data) > 1) plan = "3d";
    }
    const std::string spec = plan == "3d" ? mesh.spec() : best.mesh;
    // stages across nodes: mesh rank r runs on launched rank pipe_outer_devices(mesh)[r]
    std::optional<context> meshed;
    if (best.pipe_outer) meshed.emplace(c.ctx->with_mesh(spec));
    auto ctx = best.pipe_outer ? meshed->with_rank_order(pipe_outer_devices(mesh)) : c.ctx->with_mesh(spec);
    const plan_entry* entry = find_plan(plan);
    if (!entry) throw std::logic_error("bench: --plan auto chose '" + plan + "', which bench_workloads does not have");

    // what the choice adds to the chosen plan's line
    char num[64];
    auto& extra = extra_fields();
    extra.clear();
    extra.emplace_back("auto_plan", "\"" + best.label() + "\"");
    extra.emplace_back("auto_profile", "\"" + dev.name + "\"");
    if (planned > 0) extra.emplace_back("auto_ranks_per_node", std::to_string(planned));
    std::snprintf(num, sizeof num, "%.6g", best.step_s);
    extra.emplace_back("predicted_step_s", num);
    extra.emplace_back("auto_tie", best.tie ? "true" : "false");
    std::snprintf(num, sizeof num, "%.2f", best.memory_mib);
    extra.emplace_back("predicted_memory_mib_total", num);
    std::string runners = "[";
    int shown = 0;
    for (const auto& r : cs) {
      if (&r == &best || !r.valid || !r.fits || shown == 3) continue;
      std::snprintf(num, sizeof num, "%.6g", r.step_s);
      runners += std::string(shown++ ? ", " : "") + "{\"plan\": \"" + r.label() + "\", \"predicted_step_s\": " + num + "}";
    }
    extra.emplace_back("auto_runners_up", runners + "]");

    config chosen = c;
    chosen.ctx = &ctx;
    chosen.plan = plan;
    chosen.args = plan_args(args);
    entry->run(chosen);
    extra.clear();
  }

  /// The ranks per node the search assumes (0: the profile's node line, else
  /// one node), checked against where the ranks are: on several hosts, the
  /// ranks must sit host by host, as many on each as the search assumes
  /// (--ranks-per-node K, else the profile's node line); without either, the
  /// hosts' count is taken. On one host the search's placement is not checked
  /// (a cluster's profile may be tried here). Collective over the world.
  static int placed_per_node(config& c, int given, const whale::device_profile& dev) {
    const auto hosts = gather_hosts(*c.ctx);
    if (hosts.hosts < 2) return given;
    bool by_host = true;
    for (std::size_t r = 0; r < hosts.devices.size(); ++r) by_host = by_host && hosts.devices[r] == static_cast<int>(r);
    by_host = by_host && static_cast<int>(hosts.devices.size()) == hosts.hosts * hosts.per_node;
    if (!by_host)
      throw usage_error("bench: --plan auto: the ranks are not placed host by host (rank r on host r / " + std::to_string(hosts.per_node) +
                        "), which the plan search assumes; launch with mpirun --map-by slot and the same number of ranks on each host");
    const int assumed = given > 0 ? given : dev.ranks_per_node;
    const char* from = given > 0 ? "--ranks-per-node" : "the profile's node line";
    if (assumed > 0 && assumed != hosts.per_node)
      throw usage_error("bench: --plan auto: " + std::string(from) + " says " + std::to_string(assumed) + " ranks a node, but the " +
                        std::to_string(c.ranks()) + " ranks sit " + std::to_string(hosts.per_node) + " on each of " +
                        std::to_string(hosts.hosts) + " hosts");
    return hosts.per_node;
  }
};

}  // namespace bench::plans
