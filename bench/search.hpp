// The plan search over the reference workloads (shared/workloads.md): every
// plan of a workload on n ranks, lowered for every rank, simulated on a device
// profile and ranked. Shared by whale_plan (--search) and bench_workloads
// (--plan auto); no MPI here.
#pragma once

#include <algorithm>
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

namespace bench::search {

using namespace whale;

/// A plan of a reference workload: the plan's name (as whale_plan and
/// bench_workloads call it), its schedule and options; the mesh is apart.
struct plan_query {
  std::string workload, plan, schedule = "1f1b";
  int zero = -1;          ///< -1: the plan's own ZeRO level
  bool recompute = false;
  int per_node = 0;       ///< ranks per node for the simulation (0: one node)
  lower_options o;        ///< global_batch / seq < 0: the workload's
};

[[noreturn]] inline void plan_error(const std::string& why) { throw std::invalid_argument(why); }

// The whole mesh from a spec whose axes are all given (data defaults to 1).
inline mesh_shape mesh_of(const std::string& spec) {
  long long world = 1;
  for (std::size_t at = 0; at < spec.size();) {
    const auto end = std::min(spec.find(',', at), spec.size());
    const auto item = spec.substr(at, end - at);
    const auto eq = item.find('=');
    if (eq == std::string::npos) plan_error("plan search: --mesh '" + spec + "': '" + item + "' is not axis=size");
    world *= detail::parse_int(item.substr(eq + 1), "--mesh " + item.substr(0, eq), 1, 1 << 20);
    if (world > (1 << 20)) plan_error("plan search: --mesh '" + spec + "' has more than 2^20 ranks");
    at = end + 1;
  }
  if (spec.find("data=") == std::string::npos) return mesh_shape::parse(spec + ",data=1", static_cast<int>(world), "--mesh");
  return mesh_shape::parse(spec, static_cast<int>(world), "--mesh");
}

// gpt with tensor parallelism inside (Megatron: vocabulary-split embedding,
// head-split attention, column/row FFN, class-split head and loss).
constexpr index_t V = 8192, S = 128, D = 256, H = 4, F = 1024;
using block = transformer_block<D, H, F>;
template <class Stack>
using tp_gpt = sequential<split<embedding<V, D>>, position_embedding<S, D>, Stack, layer_norm<D>,
                          split<sequential<linear<D, V>, softmax_cross_entropy>>>;

template <class P> model_desc desc_of() { return describe<P>(); }

inline model_desc plan_desc(const plan_query& a) {
  const auto& w = a.workload;
  const auto& p = a.plan;
  const bool g = a.schedule == "gpipe";
  auto none = [&] { plan_error("plan search: the plan '" + p + "' is not defined for the workload '" + w + "'"); };
  if (w == "mlp" || w == "xc") {
    const bool m = w == "mlp";
    if (p == "single") return m ? desc_of<models::mlp>() : desc_of<models::xc>();
    if (p == "dp") return m ? desc_of<replicate<models::mlp>>() : desc_of<replicate<models::xc>>();
    if (p == "zero1") return m ? desc_of<shard<models::mlp, 1>>() : desc_of<shard<models::xc, 1>>();
    if (p == "zero2") return m ? desc_of<shard<models::mlp, 2>>() : desc_of<shard<models::xc, 2>>();
    if (p == "zero3") return m ? desc_of<shard<models::mlp, 3>>() : desc_of<shard<models::xc, 3>>();
    if (p == "hybrid" && !m) return desc_of<sequential<replicate<models::xc_backbone>, split<models::xc_classifier, axis::data>>>();
    none();
  }
  if (w == "gpt") {
    if (p == "single") return desc_of<models::gpt>();
    if (p == "dp") return desc_of<replicate<models::gpt>>();
    if (p == "hybrid") return desc_of<split<models::gpt, axis::model>>();
    if (p == "zero1") return desc_of<shard<models::gpt, 1>>();
    if (p == "zero2") return desc_of<shard<models::gpt, 2>>();
    if (p == "zero3") return desc_of<shard<models::gpt, 3>>();
    if (p == "pipeline") return g ? desc_of<replicate<pipeline<gpipe, models::gpt>>>() : desc_of<replicate<pipeline<one_f_one_b, models::gpt>>>();
    if (p == "3d") {
      if (a.recompute)
        return g ? desc_of<replicate<pipeline<gpipe, tp_gpt<repeat<4, recompute<split<block>>>>>>>()
                 : desc_of<replicate<pipeline<one_f_one_b, tp_gpt<repeat<4, recompute<split<block>>>>>>>();
      return g ? desc_of<replicate<pipeline<gpipe, tp_gpt<repeat<4, split<block>>>>>>()
               : desc_of<replicate<pipeline<one_f_one_b, tp_gpt<repeat<4, split<block>>>>>>();
    }
    none();
  }
  plan_error("plan search: unknown workload '" + w + "' (have mlp, xc, gpt)");
}

// The global batch of the workload on `mesh` when --batch is not given.
inline index_t default_batch(const plan_query& a, const mesh_shape& mesh) {
  if (a.o.global_batch > 0) return a.o.global_batch;
  const bool gpt = a.workload == "gpt";
  return gpt ? std::max<index_t>(models::gpt_global_batch, 4 * mesh.size(axis::data))
             : a.workload == "mlp" ? models::mlp_global_batch : models::xc_batch_per_rank * mesh.size(axis::data);
}

struct candidate {
  plan_query a;
  std::string mesh;
  bool valid = false, fits = true;
  std::string why;  ///< not valid: the plan's error
  double step = 0, memory_mib = 0;
  rank_time slowest;
  std::string label() const {
    std::string l = a.plan;
    if (a.plan == "pipeline" || a.plan == "3d") l += " " + a.schedule + " m=" + std::to_string(a.o.micro_batches);
    if (a.recompute) l += " recompute";
    return l + " on " + mesh;
  }
};

/// Every plan of the workload on n ranks, lowered for every rank, simulated on
/// `dev` and ranked: runnable plans that fit `memory_limit_mib` (0: no limit)
/// first, by predicted step time; then those over memory; then those that cannot
/// run, with the plan's own error. Throws when none runs and fits.
inline std::vector<candidate> rank_plans(const plan_query& base, int n, const device_profile& dev, double memory_limit_mib) {
  std::vector<candidate> cs;
  auto add = [&](const std::string& plan, const std::string& mesh, const std::string& sched = "1f1b", int micro = 0, bool rec = false) {
    candidate c;
    c.a = base;
    c.a.plan = plan, c.a.schedule = sched, c.a.recompute = rec;
    c.a.o.micro_batches = micro;
    c.mesh = mesh;
    cs.push_back(std::move(c));
  };
  const std::string N = std::to_string(n);
  if (n == 1) add("single", "data=1");
  for (const char* p : {"dp", "zero1", "zero2", "zero3"}) add(p, "data=" + N);
  if (base.workload == "xc") add("hybrid", "data=" + N);
  if (base.workload == "gpt") {
    for (int m = 2; m <= n; m *= 2)
      if (n % m == 0) add("hybrid", "data=" + std::to_string(n / m) + ",model=" + std::to_string(m));
    for (int p = 2; p <= n; p *= 2) {
      if (n % p) continue;
      const std::string mesh = "data=" + std::to_string(n / p) + ",pipe=" + std::to_string(p);
      for (const char* sched : {"1f1b", "gpipe"})
        for (int k : {1, 2, 4}) add("pipeline", mesh, sched, k * p);
      for (int m = 2; p * m <= n; m *= 2)
        if (n % (p * m) == 0) {
          const std::string m3 = "data=" + std::to_string(n / (p * m)) + ",pipe=" + std::to_string(p) + ",model=" + std::to_string(m);
          for (int k : {1, 2, 4}) add("3d", m3, "1f1b", k * p), add("3d", m3, "1f1b", k * p, true);
        }
    }
  }
  for (auto& c : cs) {
    try {
      const auto mesh = mesh_of(c.mesh);
      const auto d = plan_desc(c.a);
      auto o = c.a.o;
      o.global_batch = default_batch(c.a, mesh);
      if (o.seq < 0) o.seq = c.a.workload == "gpt" ? models::gpt_seq : 1;
      o.zero_level = c.a.zero;
      std::vector<program> all;
      std::int64_t mem = 0;
      for (int r = 0; r < mesh.size(); ++r) {
        all.push_back(lower(d, mesh, r, o));
        mem = std::max(mem, predict_memory(d, all.back()).total());
      }
      const auto sim = simulate(d, all, dev, c.a.per_node);
      c.valid = true;
      c.step = sim.step_s;
      c.memory_mib = static_cast<double>(mem) / 1048576.0;
      c.fits = !(memory_limit_mib > 0) || c.memory_mib <= memory_limit_mib;
      for (const auto& r : sim.ranks)
        if (r.end_s >= c.slowest.end_s) c.slowest = r;
    } catch (const std::exception& e) {
      c.why = e.what();
    }
  }
  std::stable_sort(cs.begin(), cs.end(), [](const candidate& x, const candidate& y) {
    if (x.valid != y.valid) return x.valid;
    if (x.fits != y.fits) return x.fits;
    return x.step < y.step;
  });
  if (cs.empty() || !cs.front().valid || !cs.front().fits)
    throw std::invalid_argument("plan search: no plan of " + base.workload + " runs on " + N + " ranks" +
                                (memory_limit_mib > 0 ? " within " + std::to_string(memory_limit_mib) + " MiB" : std::string()));
  return cs;
}

}  // namespace bench::search
