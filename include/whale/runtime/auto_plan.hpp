// The runtime of auto_plan<M>: `rank_auto_plans` prices every candidate plan
// of M on a mesh (lowered for every rank, replayed on a device profile,
// memory predicted) and `auto_executor<M>` builds the fastest that fits and
// forwards the API every plan has to it. Candidates: replicate<M> and
// shard<M, 1|2|3> on a data-only mesh; replicate<pipeline<one_f_one_b, M>>
// with m = p, 2p, 4p micro-batches on a data x pipe mesh (M with one repeat),
// and on a data-only mesh also on every data x pipe reshaping of the world;
// split<M> (tensor parallel) on a mesh with a model axis and on every data x
// model reshaping of a data-only one, when M is made of plain layers; and for
// M = sequential<Backbone, Head>, the backbone replicated and the head split by
// class over the data axis (Whale's 100k-class plan); and 3-D plans,
// replicate<pipeline<one_f_one_b, M'>> with M' = M with its embeddings, fully
// connected layers and repeated block each split over the model axis, on a
// data x pipe x model mesh (the job's, or every reshaping of a data-only one),
// and shard<that, 1|2|3> (ZeRO 1-3) where the data axis has 2 ranks or more.
// Where M has one repeat<N, Block>, each of these is also priced with the
// block recomputed in backward (M with repeat<N, recompute<Block>>, whose
// tensor-parallel form has recompute<split<Block>>); a model with a recompute
// inside, which split<M> refuses, gets that per-element tensor-parallel form.
// Checkpoints go through the chosen plan (a checkpoint names the concrete
// plan it was saved by).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "whale/plan/device.hpp"
#include "whale/plan/lower.hpp"
#include "whale/plan/memory.hpp"
#include "whale/plan/probe.hpp"
#include "whale/plan/simulate.hpp"
#include "whale/plan/tie.hpp"
#include "whale/runtime/auto_candidates.hpp"
#include "whale/runtime/executor.hpp"
#include "whale/runtime/profile_cache.hpp"
#include "whale/strategy/auto_plan.hpp"
#include "whale/strategy/pipeline.hpp"
#include "whale/strategy/replicate.hpp"
#include "whale/strategy/shard.hpp"
#include "whale/strategy/split.hpp"

namespace whale {

/// One candidate of auto_plan, priced.
struct plan_choice {
  std::string label;      ///< e.g. "zero2", "pipeline 1f1b m=8", "pipeline 1f1b m=4 on data=1,pipe=2,model=1"
  std::size_t index = 0;  ///< which candidate type
  int micro_batches = 0;
  std::string mesh;       ///< the mesh it runs on: the job's, or a reshaping of it (data x pipe, data x model, data x pipe x model)
  bool valid = false;     ///< lowered on every rank (else `why` says what the plan refused)
  bool fits = true;       ///< predicted peak memory within the limit
  std::string why;
  double step_s = 0, memory_mib = 0;
  rank_time slowest;      ///< the simulated slowest rank (compute, communication, waits)
  int order = 0;          ///< simplicity: the order candidates are listed in (dp first)
  bool tie = false;       ///< the choice: predicted within plan_tie of a faster candidate, and simpler or leaving memory free (prefer_simpler)
};

namespace detail {
/// A candidate's description as the pricing reads it: with each leaf's kernel
/// probe where the profile prices a GPU's kernels (`kernels`), else describe<P>().
using plan_describer = model_desc (*)(bool kernels);
template <class P> model_desc describe_for_pricing(bool kernels) { return kernels ? describe_kernels<P>() : describe<P>(); }
template <class... P> constexpr std::array<plan_describer, sizeof...(P)> describers_of(plan_list<P...>) {
  return {&describe_for_pricing<P>...};
}
/// Prices candidate `c` of description `d` on `mesh` with c.micro_batches
/// micro-batches: lowered for every rank, its memory predicted, its step
/// replayed on `dev`; throws what the plan refuses (rank_auto_plans keeps it
/// in c.why). Not a template: compiled once per program, whatever the
/// candidates and the model; only the description is the plan's.
inline void price_plan(plan_choice& c, const model_desc& d, const mesh_shape& mesh, const plan_options& o, const device_profile& dev) {
  lower_options lo = lowering_of(o, o.plan_batch, o.plan_seq);  // in the plan's precision (plan_options::precision)
  lo.micro_batches = c.micro_batches;
  lo.stage_blocks.clear();  // each candidate is cut by cost
  lo.placement = false;     // priced, not run: the chosen plan lowers its own program
  std::vector<program> all;
  std::int64_t mem = 0;
  for (int r = 0; r < mesh.size(); ++r) {
    all.push_back(lower(d, mesh, r, lo));
    mem = std::max(mem, predict_memory(d, all.back()).total());
  }
  const auto sim = simulate(d, all, dev, 0);
  c.valid = true;
  c.step_s = sim.step_s;
  c.memory_mib = static_cast<double>(mem) / 1048576.0;
  c.fits = !(o.memory_limit_mib > 0) || c.memory_mib <= o.memory_limit_mib;
  for (const auto& r : sim.ranks)
    if (r.end_s >= c.slowest.end_s) c.slowest = r;
}
}  // namespace detail

/// The candidates of auto_plan<M> on `job` (the job's mesh), priced on `dev`, best
/// first: runnable plans that fit `o.memory_limit_mib` (0: no limit) by predicted
/// step time — except that the simplest candidate within `o.plan_tie` of the
/// fastest comes first (prefer_simpler, plan/tie.hpp) — then those over memory, then
/// those that cannot run (with the reason).
/// On a data-only mesh of N ranks the pipeline also competes on every data=N/p x
/// pipe=p (every p > 1 dividing N), tensor parallelism on every data x model and
/// the 3-D plan on every data x pipe x model reshaping (pipe, model > 1). Pure:
/// every rank computes the same ranking. Prices
/// with the global batch o.plan_batch of o.plan_seq tokens and AdamW's optimizer
/// state (8 bytes a parameter).
template <class M, plan_space S = plan_space{}>
std::vector<plan_choice> rank_auto_plans(const mesh_shape& job, const plan_options& o, const device_profile& dev) {
  std::vector<plan_choice> cs;
  check_plan_tie(o.plan_tie, "whale::" + auto_plan<M, S>::name() + ": plan_options::plan_tie");
  // a profile of a GPU's kernels times them in one precision: the plan's
  if (const auto why = profile_precision_refusal(dev.kernel_precision, o.precision, "plan_options::precision, --precision");
      !why.empty())
    throw std::invalid_argument("whale::" + auto_plan<M, S>::name() + ": " + why);
  // each candidate type's description, read once (a GPU profile (`kernels`) prices
  // each layer's kernels, plan/probe.hpp, in its precision)
  constexpr auto describers = detail::describers_of(detail::auto_candidates<M, S>{});
  std::array<std::optional<model_desc>, describers.size()> descs;
  const bool kernels = !dev.kernel_precision.empty();
  auto price = [&](std::size_t index, const mesh_shape& mesh, const std::string& label, int micro) {
    plan_choice c;
    c.label = label, c.index = index, c.micro_batches = micro, c.mesh = mesh.spec();
    c.order = static_cast<int>(cs.size());
    try {
      if (!descs[index]) descs[index] = describers[index](kernels);
      detail::price_plan(c, *descs[index], mesh, o, dev);
    } catch (const std::exception& e) {
      c.why = e.what();
    }
    cs.push_back(std::move(c));
  };
  using L = detail::auto_candidates<M, S>;
  using R = detail::variant_r<M, S>;  // M with its blocks recomputed (void: none, or left out by S)
  // prices plan P (void: none) on `mesh`, when P is a candidate
  auto price_if = [&]<class P>(std::type_identity<P>, const mesh_shape& mesh, const std::string& label, int micro) {
    if constexpr (!std::is_void_v<P> && detail::index_in<P, L>::found) price(detail::index_in<P, L>::value, mesh, label, micro);
  };
  // every model variant, plain first: X = M, then R (labels " recompute")
  auto variants = [&](auto&& f) {
    f(std::type_identity<M>{}, std::string());
    if constexpr (!std::is_void_v<R>) f(std::type_identity<R>{}, std::string(" recompute"));
  };
  const int n = job.size();
  const bool data_only = job.size(axis::pipe) == 1 && job.size(axis::model) == 1;
  // the reshapings of a data-only world into data x pipe (q = pipe) or data x model (q = model)
  auto reshapings = [&](auto&& f) {
    if (data_only)
      for (int q = 2; q <= n; ++q)
        if (n % q == 0) f(q);
  };
  variants([&]<class X>(std::type_identity<X>, const std::string& rec) {
    price_if(std::type_identity<typename detail::dense_of<X>::dp>{}, job, "dp" + rec, 0);
    price_if(std::type_identity<typename detail::dense_of<X>::template zero<1>>{}, job, "zero1" + rec, 0);
    price_if(std::type_identity<typename detail::dense_of<X>::template zero<2>>{}, job, "zero2" + rec, 0);
    price_if(std::type_identity<typename detail::dense_of<X>::template zero<3>>{}, job, "zero3" + rec, 0);
  });
  variants([&]<class X>(std::type_identity<X>, const std::string& rec) {
    using P = typename detail::family<X>::pipe;
    const int p = job.size(axis::pipe);
    for (int k : {1, 2, 4})
      price_if(std::type_identity<P>{}, job, "pipeline 1f1b m=" + std::to_string(k * p) + rec, k * p);
    reshapings([&](int q) {
      const mesh_shape reshaped(n / q, q, 1);
      for (int k : {1, 2, 4})
        price_if(std::type_identity<P>{}, reshaped, "pipeline 1f1b m=" + std::to_string(k * q) + rec + " on " + reshaped.spec(),
                 k * q);
    });
  });
  variants([&]<class X>(std::type_identity<X>, const std::string& rec) {
    using P = typename detail::family<X>::tensor;  // model innermost: neighbouring ranks
    if (job.size(axis::model) > 1) price_if(std::type_identity<P>{}, job, "tensor parallel" + rec, 0);
    reshapings([&](int q) {
      const mesh_shape reshaped(n / q, 1, q);
      price_if(std::type_identity<P>{}, reshaped, "tensor parallel" + rec + " on " + reshaped.spec(), 0);
    });
  });
  price_if(std::type_identity<typename detail::family<M>::head>{}, job, "class-split head", 0);
  // 3-D: data x pipe x model, m = p, 2p, 4p; with ZeRO 1-3 where data > 1 (over one data
  // rank ZeRO shards nothing); plain first, so that a near-tie goes to the simplest
  variants([&]<class X>(std::type_identity<X>, const std::string& rec) {
    using F = detail::family<X>;
    if constexpr (F::three_d)
      for (const int zero : {0, 1, 2, 3}) {
        auto price_3d = [&](const mesh_shape& mesh, const std::string& on) {
          const int p = mesh.size(axis::pipe);
          if (zero > 0 && mesh.size(axis::data) < 2) return;
          for (int k : {1, 2, 4}) {
            const std::string label = "3-D 1f1b m=" + std::to_string(k * p) +
                                      (zero > 0 ? " zero" + std::to_string(zero) : "") + rec + on;
            if (zero == 0) price_if(std::type_identity<typename F::three_d_type>{}, mesh, label, k * p);
            if (zero == 1) price_if(std::type_identity<typename F::template three_d_zero<1>>{}, mesh, label, k * p);
            if (zero == 2) price_if(std::type_identity<typename F::template three_d_zero<2>>{}, mesh, label, k * p);
            if (zero == 3) price_if(std::type_identity<typename F::template three_d_zero<3>>{}, mesh, label, k * p);
          }
        };
        if (job.size(axis::pipe) > 1 && job.size(axis::model) > 1) price_3d(job, "");
        if (data_only)
          for (int q = 2; q <= n; ++q)
            for (int t = 2; q * t <= n; ++t) {
              if (n % (q * t)) continue;
              const mesh_shape reshaped(n / (q * t), q, t);
              price_3d(reshaped, " on " + reshaped.spec());
            }
      }
  });
  std::stable_sort(cs.begin(), cs.end(), [](const plan_choice& x, const plan_choice& y) {
    if (x.valid != y.valid) return x.valid;
    if (x.fits != y.fits) return x.fits;
    return x.step_s < y.step_s;
  });
  if (!cs.front().valid || !cs.front().fits) {
    std::ostringstream why;
    why << "whale::" << auto_plan<M, S>::name() << ": no candidate plan runs on the mesh " << job
        << (o.memory_limit_mib > 0 ? " within " + std::to_string(o.memory_limit_mib) + " MiB per rank" : std::string())
        << ":";
    for (const auto& c : cs)
      why << "\n  " << c.label << ": "
          << (c.valid ? "needs " + std::to_string(c.memory_mib) + " MiB per rank" : c.why);
    throw std::invalid_argument(why.str());
  }
  prefer_simpler(cs, o.plan_tie, o.memory_limit_mib);
  return cs;
}

/// The plan auto_plan<M, S> chose, running; the API every plan has, forwarded.
template <class M, plan_space S = plan_space{}>
class auto_executor {
  using V = detail::auto_variant<detail::auto_candidates<M, S>>;

 public:
  using model_type = auto_plan<M, S>;
  using input_type = typename M::input_type;

  /// Needs o.plan_batch (the global batch it prices); o.memory_limit_mib caps each
  /// rank's predicted memory. Prices with o.profile (a device profile file,
  /// WHALE_PROFILE); without one, with the profile cached for this host, job shape
  /// and build, or one measured now on every rank and cached (profile_at_start,
  /// runtime/profile_cache.hpp: a few seconds; rank 0 says which on stderr).
  auto_executor(const context& ctx, seed s, plan_options o) {
    const std::string who = "whale::make<" + auto_plan<M, S>::name() + ">: ";
    if (o.plan_batch <= 0)
      throw std::invalid_argument(who + "plan_options::plan_batch (the global batch the planner prices, in sequences "
                                  "or samples) must be set; plan_seq gives the tokens per sequence");
    std::optional<device_profile> at_start;  // collective, on every rank alike
    if (o.profile.empty()) {
      auto sp = profile_at_start(ctx, o.backend, who);
      profile_origin_ = sp.note;
      at_start = std::move(sp.profile);
    } else {
      profile_origin_ = "the profile file " + o.profile;
    }
    // a profile that one node cannot read, or a ranking that fails there, fails every rank (no collective is entered alone)
    std::string err;
    try {
      const device_profile dev = at_start ? *at_start : device_profile::load(o.profile);
      if (!dev.kernel_precision.empty()) priced_bf16_ = dev.prices_bf16();
      ranking_ = rank_auto_plans<M, S>(ctx.mesh().shape(), o, dev);
    } catch (const std::exception& e) {
      err = e.what();
    }
    int failed = err.empty() ? 0 : 1, any = failed;
    all_reduce(ctx.world(), view<int>(&any, {1}), reduce_op::max);
    if (any) throw std::invalid_argument(failed ? err : who + "another rank could not rank the plans (its message says why)");
    // every rank must have made the same choice before a collective of the chosen plan (profiles can differ by node)
    const auto h = static_cast<std::int64_t>(std::hash<std::string>{}(ranking_.front().label) % 1000000007u);
    std::int64_t lo = h, hi = h;
    all_reduce(ctx.world(), view<std::int64_t>(&lo, {1}), reduce_op::min);
    all_reduce(ctx.world(), view<std::int64_t>(&hi, {1}), reduce_op::max);
    if (lo != hi)
      throw std::invalid_argument(who + "the ranks chose different plans (this rank: " + ranking_.front().label +
                                  "); give every rank the same profile file and options");
    // ... and priced in one precision (each rank's profile agreed with the plan's precision)
    std::int64_t prec[2] = {priced_bf16_ ? 1 + static_cast<std::int64_t>(*priced_bf16_) : 0, 0};
    prec[1] = -prec[0];
    all_reduce(ctx.world(), view<std::int64_t>(prec, {2}), reduce_op::max);
    if (prec[0] != -prec[1])
      throw std::invalid_argument(who + "the ranks' device profiles price in different precisions (a 'kernels bf16' line, "
                                  "'kernels fp32', or none); give every rank the same profile file");
    precision_ = o.precision;
    o.micro_batches = ranking_.front().micro_batches;
    // a reshaped mesh: the chosen plan runs in a context of its own over the same ranks, in their order
    if (ranking_.front().mesh != ctx.mesh().shape().spec())
      reshaped_ = std::make_unique<context>(ctx.with_mesh(ranking_.front().mesh));
    build(std::make_index_sequence<V::size>{}, ranking_.front().index, reshaped_ ? *reshaped_ : ctx, s, o);
  }

  /// Every candidate, best first, with its predicted step time and memory (or why it cannot run).
  const std::vector<plan_choice>& ranking() const noexcept { return ranking_; }
  const plan_choice& choice() const noexcept { return ranking_.front(); }
  /// Where the profile the plans were priced with came from: "the profile file PATH", or
  /// the line rank 0 printed when it was measured at start or loaded from the cache.
  const std::string& profile_origin() const noexcept { return profile_origin_; }
  /// Whether the plans' kernels were priced in bf16 (a profile's `kernels bf16`) or fp32
  /// (`kernels fp32`), which is the plan's precision (make refuses a profile of the other);
  /// unset: compute priced from the layers' analytic costs (the precision still sets each
  /// candidate's memory and what it refuses).
  std::optional<bool> priced_bf16() const noexcept { return priced_bf16_; }
  /// The number format of the chosen plan's steps (plan_options::precision): the trainer trains in it.
  whale::precision precision() const noexcept { return precision_; }
  /// The ZeRO level of the plan that runs (0 for dp and the pipeline).
  int zero_level_now() const {
    return std::visit([](const auto& e) { return std::remove_cvref_t<decltype(*e)>::zero_level; }, v_);
  }

  // what the chosen executor's model-independent core answers (one runtime, whichever candidate runs)
  std::pair<index_t, index_t> local_batch(index_t g) const { return core_->local_batch(g); }
  double train_step(step_ctx& c, cview<input_type> x, cview<std::int32_t> y) {
    return visit([&](auto& e) { return e.train_step(c, x, y); });
  }
  double evaluate(step_ctx& c, cview<input_type> x, cview<std::int32_t> y) {
    return visit([&](auto& e) { return e.evaluate(c, x, y); });
  }
  tensor<float> forward(step_ctx& c, cview<input_type> x) { return visit([&](auto& e) { return e.forward(c, x); }); }
  double reduce_loss(double share) { return core_->reduce_loss(share); }
  std::string first_nonfinite_grad() const { return core_->first_nonfinite_grad(); }
  double grad_norm() const { return core_->grad_norm(); }
  /// The backend the chosen plan computes on (plan_options::backend).
  const backend_ref& backend() const { return core_->backend(); }
  int rank() const { return core_->rank(); }
  int world_size() const { return core_->world_size(); }
  template <class O> typename O::state make_optimizer_state(const O& opt) const { return core_->make_optimizer_state(opt); }
  template <class O> void apply_optimizer(const O& opt, typename O::state& st, float scale) { core_->apply_optimizer(opt, st, scale); }
  view<float> params() const { return core_->params(); }
  index_t param_count() const { return core_->param_count(); }
  /// What this rank holds and where (checkpoints save and load through the chosen plan's placement).
  const program& placement() const { return core_->placement(); }
  std::pair<index_t, index_t> range() const { return core_->range(); }
  world_comm& world() const { return core_->world(); }
  /// Every parameter of the model, gathered (collective under ZeRO-3 and pipelines).
  tensor<float> full_params() const { return visit([&](auto& e) { return e.full_params(); }); }

  /// The choice, its prediction, the runners-up and why they lost; then the chosen plan.
  friend std::ostream& operator<<(std::ostream& os, const auto_executor& a) {
    const auto& b = a.ranking_.front();
    char line[256];
    std::snprintf(line, sizeof line, "auto_plan: chose %s (predicted step %.3f s, %.0f MiB per rank)\n",
                  b.label.c_str(), b.step_s, b.memory_mib);
    os << line;
    if (b.tie && a.ranking_.size() > 1) {
      const bool simpler = b.order < a.ranking_[1].order;  // else chosen for the memory it leaves free
      std::snprintf(line, sizeof line, "  (%s is predicted %.1f%% faster: within plan_tie, so %s)\n",
                    a.ranking_[1].label.c_str(), 100.0 * (1.0 - a.ranking_[1].step_s / b.step_s),
                    simpler ? "the simpler plan runs" : "the plan that leaves 10% of the memory limit free runs");
      os << line;
    }
    for (std::size_t i = 1; i < a.ranking_.size(); ++i) {
      const auto& c = a.ranking_[i];
      if (!c.valid) std::snprintf(line, sizeof line, "  %-20s cannot run here: %.180s\n", c.label.c_str(), c.why.c_str());
      else if (!c.fits)
        std::snprintf(line, sizeof line, "  %-20s over the memory limit: %.0f MiB per rank\n", c.label.c_str(), c.memory_mib);
      else
        std::snprintf(line, sizeof line, "  %-20s %.1f%% %s (%.3f s; its slowest rank: compute %.3f s, "
                      "communication %.3f s, waiting %.3f s), %.0f MiB per rank\n", c.label.c_str(),
                      100.0 * std::abs(c.step_s / b.step_s - 1.0), c.step_s < b.step_s ? "faster, a tie" : "slower",
                      c.step_s, c.slowest.compute_s, c.slowest.comm_s, c.slowest.wait_s, c.memory_mib);
      os << line;
    }
    a.core_->print(os);  // the chosen plan, as its executor prints itself
    return os;
  }

 private:
  template <class F> decltype(auto) visit(F&& f) const {
    return std::visit([&](auto& e) -> decltype(auto) { return f(*e); }, v_);
  }
  template <std::size_t... I>
  void build(std::index_sequence<I...>, std::size_t which, const context& ctx, seed s, const plan_options& o) {
    ((which == I ? (v_.template emplace<I>(std::make_unique<executor<typename V::template at<I>>>(ctx, s, o)), 0) : 0), ...);
    core_ = std::visit([](auto& e) -> detail::executor_core* { return e.get(); }, v_);
  }
  std::vector<plan_choice> ranking_;
  std::string profile_origin_;
  std::optional<bool> priced_bf16_;  // the precision the plans were priced in (unset: analytic)
  whale::precision precision_ = whale::precision::fp32;  // plan_options::precision
  // the chosen plan's context when its mesh is not the job's: on the heap, so that the
  // executor's pointer to it survives a move of this object; destroyed after v_
  std::unique_ptr<context> reshaped_;
  typename V::type v_;
  detail::executor_core* core_ = nullptr;  // the chosen executor's core (in v_'s executor, on the heap)
};

}  // namespace whale
