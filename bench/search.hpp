// The plan search over the reference workloads (shared/workloads.md): every
// plan of a workload on n ranks, lowered for every rank, simulated on a device
// profile and ranked. Shared by whale_plan (--search) and bench_workloads
// (--plan auto); no MPI here.
#pragma once

#include <algorithm>
#include <map>
#include <optional>
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
#include "whale/plan/precision_rule.hpp"
#include "whale/plan/probe.hpp"
#include "whale/plan/simulate.hpp"
#include "whale/plan/tie.hpp"

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
  double plan_tie = 0.02; ///< the search: near-ties within this fraction go to the simpler plan (plan/tie.hpp)
  /// The precision the job trains in (--precision); unset: the profile's
  /// `kernels` line's, fp32 without one.
  std::optional<precision> trains_in;
};

/// Whether plans of `q` are priced in bf16 on `dev`: the job's precision, which
/// a profile timing its kernels in the other one cannot price (refused, naming both).
/// `who` begins the message.
inline bool prices_bf16(const plan_query& q, const device_profile& dev, const std::string& who = "plan search") {
  if (!q.trains_in) return dev.prices_bf16();
  if (const auto why = profile_precision_refusal(dev.kernel_precision, *q.trains_in, "--precision"); !why.empty())
    throw std::invalid_argument(who + ": " + why);
  return *q.trains_in == precision::bf16;
}

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

// Plans of any model: one process, data parallel, ZeRO 1-3.
template <class M> struct dense_plans {
  static model_desc of(const plan_query& a) {
    const auto& p = a.plan;
    if (p == "single") return describe_kernels<M>();
    if (p == "dp") return describe_kernels<replicate<M>>();
    if (p == "zero1") return describe_kernels<shard<M, 1>>();
    if (p == "zero2") return describe_kernels<shard<M, 2>>();
    if (p == "zero3") return describe_kernels<shard<M, 3>>();
    plan_error("plan search: the plan '" + p + "' is not defined for the workload '" + a.workload + "'");
  }
};
// A GPT-shaped workload's plans (models::gpt_model<...> as G): tensor
// parallelism inside is Megatron's (vocabulary-split embedding, head-split
// attention, column/row FFN, class-split head and loss).
template <class G> struct gpt_plans {
  static constexpr index_t V = G::vocab, S = G::max_seq, D = G::width;
  using block = transformer_block<D, G::heads, G::ffn>;
  template <class Stack>
  using tp = sequential<split<embedding<V, D>>, position_embedding<S, D>, Stack, layer_norm<D>,
                        split<sequential<linear<D, V>, softmax_cross_entropy>>>;
  static constexpr std::size_t L = G::layers;
  /// G with every block recomputed in backward (its boundaries kept, the rest redone)
  using G_rec = sequential<embedding<V, D>, position_embedding<S, D>, repeat<L, recompute<block>>, layer_norm<D>,
                           linear<D, V>, softmax_cross_entropy>;

  static model_desc of(const plan_query& a) {
    const auto& p = a.plan;
    const bool g = a.schedule == "gpipe";
    if (a.recompute && p != "3d") return dense_plans<G_rec>::of(a);
    if (p == "single") return describe_kernels<G>();
    if (p == "dp") return describe_kernels<replicate<G>>();
    if (p == "hybrid") return describe_kernels<split<G, axis::model>>();
    if (p == "zero1") return describe_kernels<shard<G, 1>>();
    if (p == "zero2") return describe_kernels<shard<G, 2>>();
    if (p == "zero3") return describe_kernels<shard<G, 3>>();
    if (p == "pipeline") return g ? describe_kernels<replicate<pipeline<gpipe, G>>>() : describe_kernels<replicate<pipeline<one_f_one_b, G>>>();
    if (p == "3d") {
      if (a.recompute)
        return g ? describe_kernels<replicate<pipeline<gpipe, tp<repeat<L, recompute<split<block>>>>>>>()
                 : describe_kernels<replicate<pipeline<one_f_one_b, tp<repeat<L, recompute<split<block>>>>>>>();
      return g ? describe_kernels<replicate<pipeline<gpipe, tp<repeat<L, split<block>>>>>>()
               : describe_kernels<replicate<pipeline<one_f_one_b, tp<repeat<L, split<block>>>>>>();
    }
    plan_error("plan search: the plan '" + p + "' is not defined for the workload '" + a.workload + "'");
  }
};

// An xc-shaped workload's plans: Backbone then Classifier (ending in the loss);
// hybrid = replicated backbone, class-split classifier over the data ranks.
template <class Backbone, class Classifier> struct classifier_plans {
  static model_desc of(const plan_query& a) {
    if (a.plan == "hybrid") return describe_kernels<sequential<replicate<Backbone>, split<Classifier, axis::data>>>();
    return dense_plans<sequential<Backbone, Classifier>>::of(a);
  }
};

/// What the search and whale_plan need of a workload: its plans as
/// descriptions, its global batch on a mesh, its context length, and which
/// plan families it has beyond dp and ZeRO.
struct workload {
  std::string name;
  model_desc (*describe)(const plan_query&) = nullptr;  ///< throws for a plan it lacks
  index_t (*batch)(const mesh_shape&) = nullptr;        ///< the global batch (sequences or samples) on a mesh
  index_t seq = 1;          ///< tokens per sequence (1: not a sequence model)
  index_t max_seq = 1;      ///< the longest context its position table holds
  bool blocks = false;      ///< a block stack: tensor x data, pipelines and 3-D plans
  bool class_split = false; ///< a classifier split by class: the hybrid plan
  /// Also dp and ZeRO with every block recomputed and with gradient accumulation
  /// (plans bench_workloads does not run: for the large models judged on paper).
  bool accumulate = false;
};

/// Every workload the search knows: the reference ones (shared/workloads.md), then those added.
inline std::vector<workload>& workloads() {
  static std::vector<workload> all = [] {
    std::vector<workload> w;
    w.push_back({"mlp", &dense_plans<models::mlp>::of,
                 [](const mesh_shape&) { return models::mlp_global_batch; }, 1, 1, false, false});
    w.push_back({"xc", &classifier_plans<models::xc_backbone, models::xc_classifier>::of,
                 [](const mesh_shape& m) { return models::xc_batch_per_rank * m.size(axis::data); }, 1, 1, false, true});
    // gpt: the workload's 16 sequences, or 4 per data rank on meshes with more than 4 data ranks
    w.push_back({"gpt", &gpt_plans<models::gpt>::of,
                 [](const mesh_shape& m) { return std::max<index_t>(models::gpt_global_batch, 4 * m.size(axis::data)); },
                 models::gpt_seq, models::gpt::max_seq, true, false});
    return w;
  }();
  return all;
}
inline void add_workload(workload w) { workloads().push_back(std::move(w)); }
inline const workload& workload_of(const std::string& name) {
  std::string have;
  for (const auto& w : workloads()) {
    if (w.name == name) return w;
    have += (have.empty() ? "" : ", ") + w.name;
  }
  plan_error("plan search: unknown workload '" + name + "' (have " + have + ")");
}

inline model_desc plan_desc(const plan_query& a) { return workload_of(a.workload).describe(a); }

// The global batch of the workload on `mesh` when --batch is not given.
inline index_t default_batch(const plan_query& a, const mesh_shape& mesh) {
  if (a.o.global_batch > 0) return a.o.global_batch;
  return workload_of(a.workload).batch(mesh);
}

/// Model FLOPs of one step of `batch` sequences of `seq` tokens (shared/workloads.md):
/// 6 x the parameters (the token and position tables left out, a tied head
/// counted) x tokens, plus attention's products, 3 x its forward's 4 D T
/// FLOPs per token (12 x layers x T^2 x D x sequences).
inline double model_flops(const model_desc& d, index_t batch, index_t seq) {
  double params = 0, attention = 0;
  for (const auto& u : d.units) {
    if (u.kind != unit_kind::layer && u.kind != unit_kind::loss) continue;
    if (u.token_table || u.unsplit.starts_with("position_embedding")) continue;
    params += static_cast<double>(u.ties_to >= 0 ? u.table_rows * u.table_cols : u.full_params);
    attention += u.cost.seq_flops;
  }
  const double tokens = static_cast<double>(batch) * static_cast<double>(seq);
  return 6.0 * params * tokens + 3.0 * attention * static_cast<double>(seq) * tokens;
}

struct candidate {
  plan_query a;
  std::string mesh;
  bool pipe_outer = false;  ///< placed with the stages across nodes (pipe_outer_devices)
  bool valid = false, fits = true;
  std::string why;  ///< not valid: the plan's error
  double step_s = 0, memory_mib = 0;
  rank_time slowest;
  int order = 0;     ///< simplicity: the order candidates are listed in (dp first)
  bool tie = false;  ///< the choice: predicted within plan_tie of a faster candidate, and simpler or leaving memory free (prefer_simpler)
  std::string label() const {
    std::string l = a.plan;
    if (a.plan == "pipeline" || a.plan == "3d") l += " " + a.schedule + " m=" + std::to_string(a.o.micro_batches);
    if (a.plan != "pipeline" && a.plan != "3d" && a.o.micro_batches > 1) l += " m=" + std::to_string(a.o.micro_batches);
    if (a.plan == "3d" && a.zero > 0) l += " zero" + std::to_string(a.zero);
    if (a.recompute) l += " recompute";
    return l + " on " + mesh + (pipe_outer ? " (stages across nodes)" : "");
  }
};

/// Every plan of the workload on n ranks, lowered for every rank, simulated on
/// `dev` and ranked: runnable plans that fit `memory_limit_mib` (0: no limit)
/// first, by predicted step time, except that the simplest predicted within
/// `base.plan_tie` of the fastest comes first (prefer_simpler; simplicity is
/// the order listed: single, dp, ZeRO 1-3, their gradient accumulation and
/// recompute, pipelines, tensor parallelism, the class-split head, 3-D); then
/// those over memory; then those that cannot run, with the plan's own error.
/// Throws when none runs and fits.
inline std::vector<candidate> rank_plans(const plan_query& base, int n, const device_profile& dev, double memory_limit_mib) {
  check_plan_tie(base.plan_tie, "plan search: the tie band (--plan-tie)");
  const bool bf16 = prices_bf16(base, dev);
  std::vector<candidate> cs;
  auto add = [&](const std::string& plan, const std::string& mesh, const std::string& sched = "1f1b", int micro = 0,
                 bool rec = false, int zero = -1) {
    candidate c;
    c.a = base;
    c.a.plan = plan, c.a.schedule = sched, c.a.recompute = rec, c.a.zero = zero;
    c.a.o.micro_batches = micro;
    c.mesh = mesh;
    c.order = static_cast<int>(cs.size());
    cs.push_back(std::move(c));
  };
  const std::string N = std::to_string(n);
  const workload& w = workload_of(base.workload);
  if (n == 1) add("single", "data=1");
  for (const char* p : {"dp", "zero1", "zero2", "zero3"}) add(p, "data=" + N);
  if (w.accumulate)
    for (const char* p : {"dp", "zero1", "zero2", "zero3"})
      for (int k : {1, 4, 16}) {
        if (k > 1) add(p, "data=" + N, "1f1b", k);
        add(p, "data=" + N, "1f1b", k, true);
      }
  // listed from the simplest (the order near-ties are broken by)
  if (w.blocks) {
    for (int p = 2; p <= n; p *= 2) {
      if (n % p) continue;
      const std::string mesh = "data=" + std::to_string(n / p) + ",pipe=" + std::to_string(p);
      for (const char* sched : {"1f1b", "gpipe"})
        for (int k : {1, 2, 4}) add("pipeline", mesh, sched, k * p);
    }
    for (int m = 2; m <= n; m *= 2)
      if (n % m == 0) add("hybrid", "data=" + std::to_string(n / m) + ",model=" + std::to_string(m));
  }
  if (w.class_split) add("hybrid", "data=" + N);
  if (w.blocks)
    for (int p = 2; p <= n; p *= 2)
      for (int m = 2; p * m <= n; m *= 2)
        if (n % (p * m) == 0) {
          const std::string m3 = "data=" + std::to_string(n / (p * m)) + ",pipe=" + std::to_string(p) + ",model=" + std::to_string(m);
          for (int k : {1, 2, 4}) add("3d", m3, "1f1b", k * p), add("3d", m3, "1f1b", k * p, true);
          // with ZeRO 1-3 over the data axis (over one data rank it shards nothing)
          if (n / (p * m) > 1)
            for (int z = 1; z <= 3; ++z)
              for (int k : {1, 2, 4}) add("3d", m3, "1f1b", k * p, false, z), add("3d", m3, "1f1b", k * p, true, z);
        }
  // over several nodes, a pipeline beside data parallelism can also run with its
  // stages across nodes and each stage's data-parallel group inside one
  const int per_node = base.per_node > 0 ? base.per_node : dev.ranks_per_node > 0 ? dev.ranks_per_node : n;
  if (per_node < n)
    for (std::size_t i = 0, e = cs.size(); i < e; ++i)
      if (const auto m = mesh_of(cs[i].mesh); m.size(axis::pipe) > 1 && m.size(axis::data) > 1) {
        auto c = cs[i];
        c.pipe_outer = true;
        cs.push_back(std::move(c));
      }
  // The lowest ZeRO level that fits: a 3-D plan with ZeRO level L >= 1 is priced only where
  // the same plan at level L - 1 was priced, runs, and is over the memory limit or within
  // tie_headroom of it (plan/tie.hpp), and is not listed otherwise. ZeRO-1 computes and sends
  // what the plain plan does, in less memory; ZeRO 2-3 inside a pipeline reduce-scatter (and
  // gather) every layer once per micro-batch, where ZeRO-1 sums each gradient once a step.
  // (At 1,024 GPUs, pricing every level of every 3-D plan took 18 s instead of 4.)
  std::map<std::string, std::size_t> place;  // a 3-D plan -> its place in cs
  auto with_zero = [](candidate c, int level) {
    c.a.zero = level;
    return c.label();
  };
  for (std::size_t i = 0; i < cs.size(); ++i)
    if (cs[i].a.plan == "3d") place[with_zero(cs[i], std::max(cs[i].a.zero, 0))] = i;
  std::vector<bool> unpriced(cs.size(), false);
  for (std::size_t i = 0; i < cs.size(); ++i) {
    auto& c = cs[i];
    if (c.a.plan == "3d" && c.a.zero >= 1) {
      const auto below = place.at(with_zero(c, c.a.zero - 1));  // listed (and so priced) before c
      // "fits" as prefer_simpler weighs it: within the limit with tie_headroom of it free (a
      // plan that fits with less may lose a near-tie to a higher level that leaves room)
      const bool roomy = cs[below].fits && (!(memory_limit_mib > 0) || cs[below].memory_mib <= (1.0 - tie_headroom) * memory_limit_mib);
      if (unpriced[below] || !cs[below].valid || roomy) {
        unpriced[i] = true;
        continue;
      }
    }
    try {
      const auto mesh = mesh_of(c.mesh);
      const auto d = plan_desc(c.a);
      auto o = c.a.o;
      o.global_batch = default_batch(c.a, mesh);
      if (o.seq < 0) o.seq = w.seq;
      o.balance_seq = o.seq;  // the stage balancer prices attention at the context it runs
      o.zero_level = c.a.zero;
      o.bf16 = bf16;  // the job's precision: its master weights, its refusals
      o.placement = false;  // priced, not run
      std::vector<program> all;
      std::int64_t mem = 0;
      // equal replicas and equal tensor-parallel shards: one rank per pipeline stage
      // stands for all (simulate's symmetry; its memory is theirs, to a few elements
      // of an uneven ZeRO partition); balanced rows make replicas differ
      const int per_node_here = c.a.per_node > 0 ? c.a.per_node : dev.ranks_per_node;
      const auto placed = c.pipe_outer ? pipe_outer_devices(mesh) : std::vector<int>{};
      const bool equal = o.replica_weights.empty() && o.global_batch % mesh.size(axis::data) == 0 &&
                         replicas_alike(mesh, axes(axis::data) | axes(axis::model), per_node_here, placed);
      for (int r = 0; r < mesh.size(); ++r) {
        if (equal && (mesh.coord(r, axis::data) != 0 || mesh.coord(r, axis::model) != 0)) continue;
        all.push_back(lower(d, mesh, r, o));
        mem = std::max(mem, predict_memory(d, all.back()).total());
      }
      const auto sim = simulate(d, all, dev, c.a.per_node, placed);
      c.valid = true;
      c.step_s = sim.step_s;
      c.memory_mib = static_cast<double>(mem) / 1048576.0;
      c.fits = !(memory_limit_mib > 0) || c.memory_mib <= memory_limit_mib;
      for (const auto& r : sim.ranks)
        if (r.end_s >= c.slowest.end_s) c.slowest = r;
    } catch (const std::exception& e) {
      c.why = e.what();
    }
  }
  for (std::size_t i = cs.size(); i-- > 0;)
    if (unpriced[i]) cs.erase(cs.begin() + static_cast<std::ptrdiff_t>(i));
  std::stable_sort(cs.begin(), cs.end(), [](const candidate& x, const candidate& y) {
    if (x.valid != y.valid) return x.valid;
    if (x.fits != y.fits) return x.fits;
    return x.step_s < y.step_s;
  });
  if (cs.empty() || !cs.front().valid || !cs.front().fits) {
    std::string why;  // the first reason given, where none was valid (e.g. a profile without net figures)
    for (const auto& c : cs)
      if (!c.valid && !c.why.empty()) {
        why = " (" + c.label() + ": " + c.why + ")";
        break;
      }
    throw std::invalid_argument("plan search: no plan of " + base.workload + " runs on " + N + " ranks" +
                                (memory_limit_mib > 0 ? " within " + std::to_string(memory_limit_mib) + " MiB" : std::string()) +
                                (cs.empty() || !cs.front().valid ? why : std::string()));
  }
  prefer_simpler(cs, base.plan_tie, memory_limit_mib);
  return cs;
}

}  // namespace bench::search
