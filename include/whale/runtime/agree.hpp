// Start-up agreement: before its first collective, every rank of a plan
// compares what it was launched with (the build, the plan type, the mesh, the
// plan options) with every other rank, and all fail with one message naming
// the ranks that differ and how. No training logic.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "whale/comm/collectives.hpp"
#include "whale/comm/communicator.hpp"
#include "whale/comm/mesh.hpp"
#include "whale/backend/cpu/launch.hpp"
#include "whale/runtime/options.hpp"
#include "whale/version.hpp"

namespace whale::detail {

/// One thing every rank must agree on: an integer, a real (its bits), or a text (its hash).
struct launch_field {
  enum class kind : std::uint8_t { integer, real, text };
  std::string name;
  kind k = kind::integer;
  std::int64_t value = 0;
  std::string text;  ///< this rank's text (text fields)

  static launch_field integer(std::string n, std::int64_t v) { return {std::move(n), kind::integer, v, {}}; }
  static launch_field real(std::string n, double v) {
    std::int64_t b;
    std::memcpy(&b, &v, sizeof b);
    return {std::move(n), kind::real, b, {}};
  }
  static launch_field of_text(std::string n, std::string t) {
    std::uint64_t h = 1469598103934665603ULL;  // FNV-1a
    for (unsigned char c : t) h = (h ^ c) * 1099511628211ULL;
    return {std::move(n), kind::text, static_cast<std::int64_t>(h), std::move(t)};
  }
  std::string show(std::int64_t v) const {
    if (k == kind::real) {
      double d;
      std::memcpy(&d, &v, sizeof d);
      return std::to_string(d);
    }
    return std::to_string(v);
  }
};

/// a * b + c as this translation unit compiles it where whale's CPU kernels
/// run (with FMA, when the ISA dispatch has it): one rounding if the compiler
/// fuses it (GCC does from -O2 on), two if not. The operands come through
/// volatiles, so it is not folded.
#if WHALE_ISA_DISPATCH
[[gnu::target("avx2,fma")]]
#endif
inline float multiply_add_probe(float a, float b, float c) { return a * b + c; }
/// "fused" or "separate": how this build rounds a multiply-add in the kernels
/// (1 + 2^-12 squared, less 1 + 2^-11: 2^-24 fused, 0 rounded twice).
inline const char* multiply_adds() {
  static volatile float a = 1.f + 0x1p-12f, c = -(1.f + 0x1p-11f);
#if WHALE_ISA_DISPATCH
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return "separate (no fma here)";
#endif
  return multiply_add_probe(a, a, c) != 0.f ? "fused" : "separate";
}

/// What this compiler and these flags make of whale's headers (ranks must run
/// one build): whale's version, the compiler, the language, the index width,
/// assertions, and what changes the numbers: optimisation, fast math, the
/// instruction sets compiled for, and whether multiply-adds are fused.
inline std::string build_id() {
  std::string b = std::string("whale ") + version + ", gcc-compatible ";
#ifdef __VERSION__
  b += __VERSION__;
#endif
  b += ", c++" + std::to_string(__cplusplus) + ", index_t " + std::to_string(sizeof(index_t) * 8) + " bits";
#ifdef NDEBUG
  b += ", NDEBUG";
#endif
#if defined(__OPTIMIZE_SIZE__)
  b += ", optimised for size";
#elif defined(__OPTIMIZE__)
  b += ", optimised";
#else
  b += ", not optimised";
#endif
#ifdef __FAST_MATH__
  b += ", fast math";
#endif
#ifdef __AVX512F__
  b += ", avx512";
#elif defined(__AVX2__)
  b += ", avx2";
#endif
#ifdef __FMA__
  b += ", fma";
#endif
  b += std::string(", multiply-adds ") + multiply_adds();
  return b;
}

/// What the ranks of plan `plan` on mesh `m` with options `o` must agree on: the
/// plan, each mesh axis, and every option that changes the program or its collectives.
inline std::vector<launch_field> launch_fields(const std::string& plan, const mesh_shape& m, const plan_options& o) {
  using f = launch_field;
  std::string blocks;
  for (int b : o.blocks) {
    if (!blocks.empty()) blocks += ',';
    blocks += std::to_string(b);
  }
  std::string speeds;  // plain appends: GCC 12's -Wrestrict false positive on operator+
  for (double v : o.speeds) {
    char b[32];
    std::snprintf(b, sizeof b, speeds.empty() ? "%g" : ",%g", v);
    speeds += b;
  }
  return {
      f::of_text("the plan", plan),
      f::integer("the mesh's data axis", m.size(axis::data)),
      f::integer("the mesh's pipe axis", m.size(axis::pipe)),
      f::integer("the mesh's model axis", m.size(axis::model)),
      f::of_text("precision (--precision, WHALE_PRECISION)", to_string(o.precision)),
      f::integer("micro_batches (--micro-batches, WHALE_MICRO_BATCHES)", o.micro_batches),
      f::of_text("the stage blocks (WHALE_STAGE_BLOCKS)", blocks.empty() ? "balanced" : blocks),
      f::integer("balance_seq", o.balance_seq),
      f::real("bucket_mib (WHALE_BUCKET_MIB)", o.bucket_mib),
      f::integer("overlap (WHALE_DP_OVERLAP)", o.overlap),
      f::integer("blocking (WHALE_DP_BLOCKING; -1: by backend)", o.blocking ? *o.blocking : -1),
      f::integer("bf16_reduce (--bf16-reduce, WHALE_BF16_REDUCE)", o.bf16_reduce),
      f::integer("prefetch (WHALE_ZERO_PREFETCH)", o.prefetch),
      f::integer("max_pending", o.max_pending),
      f::integer("tracing (--trace, WHALE_TRACE)", o.trace || !o.trace_path.empty()),
      f::of_text("the speeds (--speeds, WHALE_SPEEDS)", speeds.empty() ? "none" : speeds),
      f::integer("balance (--balance, WHALE_BALANCE)", o.balance),
      f::integer("worker_cuts (--worker-cuts, WHALE_WORKER_CUTS)", o.worker_cuts),
      f::integer("in_flight (plan_options::in_flight)", o.in_flight),
      f::of_text("the backend (plan_options::backend)", o.backend.name()),
      f::integer("device_collectives (plan_options::device_collectives)", o.device_collectives),
  };
}

inline std::string rank_list(const std::vector<int>& rs) {
  std::string s = rs.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < rs.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(rs[i]);
  }
  return s;
}

/// Collective over `w`: throws std::invalid_argument on every rank, with the
/// same message, if any rank's `fields` differ from another's. `who` prefixes it.
template <Communicator C> void check_ranks_agree(C& w, const std::vector<launch_field>& fields, const std::string& who) {
  const int n = w.size();
  if (n == 1) return;
  const auto build = launch_field::of_text("build", build_id());
  // first the build and the field count, fixed size, so that a different build cannot mismatch the next gather
  std::int64_t head[2] = {build.value, static_cast<std::int64_t>(fields.size())};
  std::vector<std::int64_t> heads(static_cast<std::size_t>(2 * n));
  all_gather(w, view<std::int64_t>(head, {2}), view<std::int64_t>(heads.data(), {2 * n}));
  for (int r = 1; r < n; ++r)
    if (heads[static_cast<std::size_t>(2 * r)] != heads[0] || heads[static_cast<std::size_t>(2 * r + 1)] != heads[1])
      throw std::invalid_argument(who + "the ranks run different builds of the program (rank " + std::to_string(r) +
                                  "'s differs from rank 0's; this rank's: " + build.text +
                                  "); launch one executable, built once, on every rank");
  const auto k = static_cast<index_t>(fields.size());
  std::vector<std::int64_t> mine(fields.size()), all(fields.size() * static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < fields.size(); ++i) mine[i] = fields[i].value;
  all_gather(w, view<std::int64_t>(mine.data(), {k}), view<std::int64_t>(all.data(), {k * n}));
  std::string why;
  for (std::size_t i = 0; i < fields.size(); ++i) {
    std::map<std::int64_t, std::vector<int>> by;  // value -> ranks
    for (int r = 0; r < n; ++r) by[all[static_cast<std::size_t>(r) * fields.size() + i]].push_back(r);
    if (by.size() == 1) continue;
    const auto& f = fields[i];
    if (!why.empty()) why += "; ";
    why += f.name;
    why += " differs: ";
    bool first = true;
    for (const auto& [v, rs] : by) {
      if (!first) why += ", ";
      why += f.k == launch_field::kind::text ? rank_list(rs) + " have one value" : f.show(v) + " on " + rank_list(rs);
      first = false;
    }
    if (f.k == launch_field::kind::text) why += " (this rank's: " + f.text + ")";
  }
  if (!why.empty())
    throw std::invalid_argument(who + "the ranks were launched with different settings: " + why +
                                "; give every rank the same flags and environment (e.g. mpirun -x VAR)");
}

}  // namespace whale::detail
