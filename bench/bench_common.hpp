// Shared pieces of whale's benchmarks: a flat JSON line writer, peak RSS, the
// GEMM-alone measurement (the compute limit) at a step's own GEMM shapes, and
// the plumbing of bench_workloads' plans (config, plan options, workloads, table
// entries). No plan lives here: each is a header of bench/plans/.
#pragma once

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <stdexcept>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "whale/backend/cpu.hpp"
#include "whale/comm/context.hpp"
#include "whale/models/deep_mlp.hpp"
#include "whale/models/gpt.hpp"
#include "whale/models/gpt2.hpp"
#include "whale/models/llama.hpp"
#include "whale/models/mlp.hpp"
#include "whale/models/xc.hpp"
#include "whale/plan/device.hpp"
#include "whale/plan/lower.hpp"
#include "whale/plan/memory.hpp"
#include "whale/tensor/memory.hpp"
#include "whale/tensor/tensor.hpp"
#include "whale/train/trainer.hpp"
#include "whale/detail/parse.hpp"

namespace bench {

/// One JSON object on one line, fields in insertion order.
class json_line {
 public:
  json_line& add(const std::string& k, const std::string& v) {
    field(k) << '"' << v << '"';
    return *this;
  }
  json_line& add(const std::string& k, const char* v) { return add(k, std::string(v)); }
  json_line& add(const std::string& k, double v) {
    char b[64];
    std::snprintf(b, sizeof b, "%.6g", v);
    field(k) << b;
    return *this;
  }
  json_line& add(const std::string& k, long long v) {
    field(k) << v;
    return *this;
  }
  json_line& add(const std::string& k, int v) { return add(k, static_cast<long long>(v)); }
  json_line& raw(const std::string& k, const std::string& json) {
    field(k) << json;
    return *this;
  }
  std::string str() const {
    std::string out = "{";  // appended, not "{" + ...: GCC 12's -Wrestrict false positive
    out += s_.str();
    out += '}';
    return out;
  }
  void print() const { std::printf("%s\n", str().c_str()); std::fflush(stdout); }

 private:
  std::ostringstream& field(const std::string& k) {
    if (n_++) s_ << ", ";
    s_ << '"' << k << "\": ";
    return s_;
  }
  std::ostringstream s_;
  int n_ = 0;
};

/// Peak resident set size of this process in MiB.
inline double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

/// Memory by category, peak MiB, as a JSON object.
inline std::string memory_json(const whale::memory_stats& m) {
  std::string s = "{";
  for (int i = 0; i < whale::mem_kind_count; ++i) {
    char b[96];
    std::snprintf(b, sizeof b, "%s\"%s\": %.2f", i ? ", " : "", whale::to_string(static_cast<whale::mem_kind>(i)),
                  static_cast<double>(m.peak[static_cast<std::size_t>(i)]) / 1048576.0);
    s += b;
  }
  return s + "}";
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

struct gemm_limit {
  double seconds = 0;  ///< time of one step's GEMMs, each shape timed alone
  double flops = 0;    ///< their FLOPs
  double gflops() const { return seconds > 0 ? flops / seconds / 1e9 : 0; }
};

/// Time every distinct GEMM of `calls` alone (median of `reps` after one warm-up
/// run), and add them up with their multiplicities; `calls` holds `steps`
/// steps' GEMMs, and the result is per step.
inline gemm_limit time_gemms(const std::vector<whale::cpu::gemm_call>& calls, int steps = 1, int reps = 3) {
  using key = std::tuple<bool, bool, whale::index_t, whale::index_t, whale::index_t>;
  std::map<key, int> count;
  for (const auto& c : calls) ++count[key{c.ta, c.tb, c.M, c.N, c.K}];
  gemm_limit r;
  whale::tensor<float> a, b, c;
  for (const auto& [k, n] : count) {
    const auto [ta, tb, M, N, K] = k;
    a.resize({M * K});
    b.resize({K * N});
    c.resize({M * N});
    for (auto& x : a) x = 0.5f;
    for (auto& x : b) x = 0.25f;
    auto run = [&] {
      whale::cpu::gemm(ta ? whale::cpu::trans::yes : whale::cpu::trans::no,
                       tb ? whale::cpu::trans::yes : whale::cpu::trans::no, M, N, K, 1.f, a.data(),
                       b.data(), 0.f, c.data());
    };
    run();
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      run();
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    const double per_step = static_cast<double>(n) / steps;
    r.seconds += median(t) * per_step;
    r.flops += 2.0 * static_cast<double>(M) * N * K * per_step;
  }
  return r;
}

// ---------------------------------------------------------------------------
// Plans: configuration, plan options, workloads, the table entry.
// ---------------------------------------------------------------------------

/// A user error (bad option, unsupported plan): the same on every rank, reported
/// once by rank 0, exit status 2, before any communication of the plan.
struct usage_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// The plan's own options (`--bucket-mib 25`, `--no-overlap`, ...): whatever the
/// common parser did not take. A plan reads them with value()/flag(); done()
/// rejects any it did not read, so a typo is an error, not a silent default.
class plan_args {
 public:
  plan_args() = default;
  explicit plan_args(std::vector<std::string> a) : a_(std::move(a)), used_(a_.size(), false) {}

  /// `--name V`: V parsed as double; `dflt` when absent.
  double value(const std::string& name, double dflt) {
    for (std::size_t i = 0; i < a_.size(); ++i)
      if (a_[i] == name) {
        if (i + 1 >= a_.size()) throw usage_error("bench: " + name + " needs a value");
        used_[i] = used_[i + 1] = true;
        try {  // whole, finite, not negative: every plan option is a size, a count or a rate
          return whale::detail::parse_double(a_[i + 1], "bench: " + name, 0, 1e12);
        } catch (const whale::detail::parse_error& e) {
          throw usage_error(e.what());
        }
      }
    return dflt;
  }
  /// `--name V`: V a whole number in [lo, hi]; `dflt` when absent.
  long long count(const std::string& name, long long dflt, long long lo, long long hi) {
    for (std::size_t i = 0; i < a_.size(); ++i)
      if (a_[i] == name) {
        if (i + 1 >= a_.size()) throw usage_error("bench: " + name + " needs a value");
        used_[i] = used_[i + 1] = true;
        try {
          return whale::detail::parse_int(a_[i + 1], "bench: " + name, lo, hi);
        } catch (const whale::detail::parse_error& e) {
          throw usage_error(e.what());
        }
      }
    return dflt;
  }
  /// `--name V` as a string.
  std::string text(const std::string& name, const std::string& dflt) {
    for (std::size_t i = 0; i < a_.size(); ++i)
      if (a_[i] == name) {
        if (i + 1 >= a_.size()) throw usage_error("bench: " + name + " needs a value");
        used_[i] = used_[i + 1] = true;
        return a_[i + 1];
      }
    return dflt;
  }
  /// `--name` present?
  bool flag(const std::string& name) {
    for (std::size_t i = 0; i < a_.size(); ++i)
      if (a_[i] == name) return used_[i] = true;
    return false;
  }
  /// Every option read? Call once the plan has read its options, before any work.
  void done(std::string_view plan) const {
    for (std::size_t i = 0; i < a_.size(); ++i)
      if (!used_[i])
        throw usage_error("bench: option " + a_[i] + " is not understood by plan '" + std::string(plan) + "'");
  }

 private:
  std::vector<std::string> a_;
  std::vector<bool> used_;
};

/// What every plan gets.
struct config {
  whale::context* ctx = nullptr;
  std::string workload, plan;
  int steps = 7;  ///< 2 warm-up steps + the timed ones
  /// --simulate PROFILE (plans dp and pipeline): the simulator's step on that
  /// profile, for where the ranks really are, printed as predicted_step_s.
  std::optional<whale::device_profile> simulate;
  plan_args args;
  int rank() const { return ctx->rank(); }
  int ranks() const { return ctx->size(); }
};

// The reference workloads (shared/workloads.md): the model type, its data and
// its global batch for a given data-parallel degree.
struct mlp_workload {
  using model = whale::models::mlp;
  static constexpr const char* name = "mlp";
  static constexpr bool tokens = false, time_to_loss = false;
  static whale::index_t global_batch(int /*data_ranks*/) { return whale::models::mlp_global_batch; }
  static auto data(whale::index_t global) { return whale::models::mlp_data(whale::seed{7}, global); }
};
struct xc_workload {
  using model = whale::models::xc;
  static constexpr const char* name = "xc";
  static constexpr bool tokens = false, time_to_loss = false;
  static whale::index_t global_batch(int data_ranks) { return whale::models::xc_batch_per_rank * data_ranks; }
  static auto data(whale::index_t global) { return whale::models::xc_data(whale::seed{7}, global); }
};
struct gpt_workload {
  using model = whale::models::gpt;
  static constexpr const char* name = "gpt";
  static constexpr bool tokens = true, time_to_loss = false;
  static whale::index_t global_batch(int /*data_ranks*/) { return whale::models::gpt_global_batch; }
  static auto data(whale::index_t global) { return whale::models::gpt_data(whale::seed{7}, global); }
};

/// A small Llama at gpt's scale (width 256, 4 layers, vocabulary 8192, 128
/// tokens, 16 sequences): 4 query heads sharing 2 key/value heads, a SwiGLU
/// MLP of 704 (about gpt's MLP parameters), on gpt's Markov-chain tokens.
/// Plans single and dp only (the CPU baseline; scripts/reference --bench runs
/// transformers on the same shape).
struct llama_small_workload {
  using model = whale::models::llama<4, 256, 4, 2, 704, 8192, 128>;
  static constexpr const char* name = "llama-small";
  static constexpr bool tokens = true, time_to_loss = false, baseline_only = true;
  static whale::index_t global_batch(int /*data_ranks*/) { return whale::models::gpt_global_batch; }
  static auto data(whale::index_t global) { return whale::models::gpt_data(whale::seed{7}, global); }
};

/// GPT-2 at gpt's scale: gpt's shape (width 256, 4 layers, 4 heads, MLP
/// 1024, vocabulary 8192, 128 tokens, 16 sequences) with GPT-2's tied head, on
/// gpt's Markov-chain tokens. Plans single and dp only (scripts/reference
/// --bench gpt2-small runs transformers' GPT2LMHeadModel on the same shape).
struct gpt2_small_workload {
  using model = whale::models::gpt2<4, 256, 4, 8192, 128>;
  static constexpr const char* name = "gpt2-small";
  static constexpr bool tokens = true, time_to_loss = false, baseline_only = true;
  static whale::index_t global_batch(int /*data_ranks*/) { return whale::models::gpt_global_batch; }
  static auto data(whale::index_t global) { return whale::models::gpt_data(whale::seed{7}, global); }
};

/// For time-to-loss runs (plans hetpipe, and dp with --speeds or --target-loss).
struct deep_mlp_workload {
  using model = whale::models::deep_mlp;
  static constexpr const char* name = "deep-mlp";
  static constexpr bool tokens = false, time_to_loss = true;
  /// The default --target-loss (docs/bench.md says how it was chosen).
  static constexpr double default_target = 1.0;
  static whale::index_t global_batch(int /*data_ranks*/) { return whale::models::deep_mlp_global_batch; }
  static auto data(whale::index_t global) { return whale::models::deep_mlp_data(whale::seed{7}, global); }
};

/// Model FLOPs of one step of workload W on a global batch, by workloads.md's
/// formula (not the layers' cost metadata): 6 x params x samples, and for a GPT
/// 6 x non-embedding params x tokens + 12 x layers x seq^2 x width x sequences.
template <class W> double model_flops_per_step(whale::index_t global_batch, whale::index_t seq) {
  using M = typename W::model;
  const double b = static_cast<double>(global_batch), t = static_cast<double>(seq);
  if constexpr (requires { M::non_embedding_params; M::layers; M::width; })
    return 6.0 * static_cast<double>(M::non_embedding_params) * b * t +
           12.0 * static_cast<double>(M::layers) * t * t * static_cast<double>(M::width) * b;
  else
    return 6.0 * static_cast<double>(M::cost().params) * b * t;
}

/// Fields a plan's line carries after the common ones (key, raw JSON value),
/// e.g. what --plan auto chose; empty otherwise.
inline std::vector<std::pair<std::string, std::string>>& extra_fields() {
  static std::vector<std::pair<std::string, std::string>> f;
  return f;
}

/// `--precision fp32|bf16` (plans single and dp), parsed whole.
inline whale::precision precision_arg(plan_args& a) {
  try {
    return whale::parse_precision(a.text("--precision", "fp32"), "bench: --precision");
  } catch (const std::invalid_argument& e) {
    throw usage_error(e.what());
  }
}

/// The fields every plan reports first, in workloads.md's order.
template <class W>
json_line& head_fields(json_line& j, const std::string& plan, int ranks, double step_s,
                       whale::index_t global_batch, whale::index_t seq) {
  const double samples = static_cast<double>(global_batch);
  const double mf = model_flops_per_step<W>(global_batch, seq);
  j.add("workload", W::name).add("plan", plan).add("ranks", ranks).add("threads_per_rank", whale::cpu::threads());
  j.add("step_s", step_s).add("samples_per_s", samples / step_s);
  if (W::tokens) j.add("tokens_per_s", samples * static_cast<double>(seq) / step_s);
  j.add("model_flops_per_step", mf).add("achieved_gflops_per_rank", mf / step_s / 1e9 / ranks);
  for (const auto& [k, v] : extra_fields()) j.raw(k, v);
  return j;
}

/// Max of `v` over the world (every rank gets it).
inline double max_over_ranks(whale::context& ctx, double v) {
  whale::all_reduce(ctx.world(), whale::view<double>(&v, {1}), whale::reduce_op::max);
  return v;
}

/// Seconds of f() on the slowest rank, all ranks starting together (barrier first).
template <class F> double timed(whale::context& ctx, F&& f) {
  whale::barrier(ctx.world());
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return max_over_ranks(ctx, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

/// What `steps` training steps did: every step timed on the slowest rank, memory
/// peaks reset after the 2 warm-up steps, bytes sent (mesh and world) over the timed ones.
struct steps_run {
  std::vector<double> losses;
  std::int64_t sent = 0;  ///< bytes this rank sent over the timed steps
  double step_s = 0;      ///< median of the timed steps
};
template <class Trainer, class Data>
steps_run run_steps(whale::context& ctx, Trainer& t, Data& data, whale::index_t global, int steps) {
  auto sent_now = [&] { return ctx.mesh().stats().bytes_sent + ctx.world().stats().bytes_sent; };
  steps_run r;
  std::vector<double> secs;
  for (int s = 0; s < steps; ++s) {
    auto b = t.fetch(data, s);
    if (s == 2) whale::reset_memory_peaks();
    const auto before = sent_now();
    double loss = 0;
    secs.push_back(timed(ctx, [&] { loss = t.step_on(b, global, s); }));
    if (s >= 2) r.sent += sent_now() - before;
    r.losses.push_back(loss);
  }
  r.step_s = median(std::vector<double>(secs.begin() + 2, secs.end()));
  return r;
}

/// Memory by category of the rank with the most, per category (max over ranks).
inline whale::memory_stats max_memory(whale::context& ctx) {
  auto m = whale::memory_snapshot();
  std::vector<double> peak(m.peak.begin(), m.peak.end());
  whale::all_reduce(ctx.world(), whale::view<double>(peak.data(), {static_cast<whale::index_t>(peak.size())}),
                    whale::reduce_op::max);
  for (std::size_t i = 0; i < peak.size(); ++i) m.peak[i] = static_cast<std::int64_t>(peak[i]);
  return m;
}

/// The most one rank holds, in MiB: each rank's category peaks summed (workspace left
/// out, as the prediction leaves it out), the largest over ranks. Collective. Where the
/// ranks hold different things (pipeline stages, tensor-parallel shards) this is what
/// predicted total compares with; the per-category maxima of memory_json come from
/// different ranks there.
inline double busiest_rank_mib(whale::context& ctx) {
  const auto m = whale::memory_snapshot();
  double t = 0;
  for (int i = 0; i < whale::mem_kind_count; ++i)
    if (static_cast<whale::mem_kind>(i) != whale::mem_kind::workspace) t += static_cast<double>(m.peak[static_cast<std::size_t>(i)]);
  whale::all_reduce(ctx.world(), whale::view<double>(&t, {1}), whale::reduce_op::max);
  return t / 1048576.0;
}

/// The plan's predicted memory (plan/memory.hpp) by category, max over ranks, in MiB, as a JSON object.
inline std::string predicted_memory_json(whale::context& ctx, const whale::memory_estimate& e) {
  double v[6] = {static_cast<double>(e.params), static_cast<double>(e.grads), static_cast<double>(e.optimizer),
                 static_cast<double>(e.activations), static_cast<double>(e.comm), static_cast<double>(e.total())};
  whale::all_reduce(ctx.world(), whale::view<double>(v, {6}), whale::reduce_op::max);
  const char* names[6] = {"params", "grads", "optimizer", "activations", "comm", "total"};
  std::string s = "{";
  for (int i = 0; i < 6; ++i) {
    char b[96];
    std::snprintf(b, sizeof b, "%s\"%s\": %.2f", i ? ", " : "", names[i], v[i] / 1048576.0);
    s += b;
  }
  return s + "}";
}

/// One row of bench_workloads' plan table: the name users pass to --plan, a
/// line of help, and the function that runs it for the configured workload.
struct plan_entry {
  const char* name;
  const char* help;
  void (*run)(config&);
};

/// The plan table's entry named `name`, or null (bench_workloads.cpp).
const plan_entry* find_plan(const std::string& name);

/// The table entry of plan P. P is a struct with
///   static constexpr const char* name, help;
///   template <class W> static constexpr bool supports;   // for mlp/xc/gpt/deep_mlp_workload
///   template <class W> static void run(config&);          // prints rank 0's JSON line
/// A workload P does not support is a usage_error (P::run<W> is not even instantiated).
template <class P> plan_entry plan() {
  return {P::name, P::help, [](config& c) {
            auto go = [&]<class W>(W) {
              constexpr bool baseline = std::string_view(P::name) == "single" || std::string_view(P::name) == "dp";
              constexpr bool only_baseline = requires { W::baseline_only; };
              if constexpr (P::template supports<W> && (baseline || !only_baseline)) P::template run<W>(c);
              else
                throw usage_error(std::string("bench: plan '") + P::name + "' does not support workload '" + W::name +
                                  "'");
            };
            if (c.workload == "mlp") go(mlp_workload{});
            else if (c.workload == "xc") go(xc_workload{});
            else if (c.workload == "gpt") go(gpt_workload{});
            else if (c.workload == "deep-mlp") go(deep_mlp_workload{});
            else if (c.workload == "llama-small") go(llama_small_workload{});
            else if (c.workload == "gpt2-small") go(gpt2_small_workload{});
            else throw usage_error("bench: unknown workload '" + c.workload + "' (have: mlp, xc, gpt, deep-mlp, llama-small, gpt2-small)");
          }};
}

}  // namespace bench
