// Kernel bodies on the CPU: every body of backend/kernels/ against a plain
// double-precision reference where one is short to write, every body's ISA
// paths (baseline loop, AVX2, AVX-512) against each other, the Backend
// concept's CPU model, bf16 rounding and the caching allocator.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

#include "support/kernel_cases.hpp"
#include "whale/backend/backend_ref.hpp"
#include "whale/backend/caching_allocator.hpp"
#include "whale/backend/cpu.hpp"
#include "whale/optim/optimizer.hpp"

using namespace whale;
namespace kc = kernel_cases;

namespace {
// Runs an index body by the loop compiled for `which` (when this CPU has it).
template <class K> void run_index(cpu::isa which, index_t n, const K& body) {
#if WHALE_ISA_DISPATCH
  if (which == cpu::isa::avx512) return cpu::detail::launch_avx512<-1>(n, body);  // a round flag (if any) read in the loop
  if (which == cpu::isa::avx2) return cpu::detail::launch_avx2<-1>(n, body);
#endif
  (void)which;
  for (index_t i = 0; i < n; ++i) body(i);
}
// Any body, by its shape, through the loop compiled for `which`.
template <class K> void run_on(cpu::isa which, index_t n, const K& body) {
  if constexpr (kernels::RowBody<K>) {
    if (kernels::row_warps(body.width()) == 1) return run_index(which, n, cpu::detail::row_runner<1, K>{body});
    return run_index(which, n, cpu::detail::row_runner<8, K>{body});
  } else if constexpr (kernels::ColumnBody<K>) {
    using run = cpu::detail::column_runner<K>;
    return run_index(which, (body.cols() + run::cols_per_block - 1) / run::cols_per_block,
                     run{body, body.rows(), body.cols()});
  } else {
    run_index(which, n, body);
  }
}
double ref_gelu(double x) { return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
double ref_silu(double x) { return x / (1 + std::exp(-x)); }
}  // namespace

TEST_CASE("every kernel body gives the same result on every CPU instruction set it is compiled for") {
  std::vector<cpu::isa> paths{cpu::isa::baseline};
#if WHALE_ISA_DISPATCH
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) paths.push_back(cpu::isa::avx2);
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    paths.push_back(cpu::isa::avx512);
#endif
  MESSAGE("CPU paths tested: " << paths.size() << " (active: " << std::string(cpu::isa_name(cpu::active_isa())) << ")");
  int cases = 0;
  kc::for_each_case([&](const char* name, index_t n, auto make) {
    ++cases;
    kc::host_buffers ref;
    run_on(cpu::isa::baseline, n, make(ref.ptrs()));
    for (auto p : paths) {
      kc::host_buffers got;
      run_on(p, n, make(got.ptrs()));
      auto rf = ref.floats(), gf = got.floats();
      for (std::size_t i = 0; i < rf.size(); ++i) {
        INFO(name << " on " << cpu::isa_name(p) << ", buffer " << i);
        CHECK(kc::max_rel_diff(*gf[i], *rf[i]) <= 2e-6);  // FMA contraction differs from the baseline
      }
      for (index_t r = 0; r < kc::R; ++r) CHECK(got.rowd[r] == doctest::Approx(ref.rowd[r]).epsilon(1e-6));
    }
  });
  CHECK(cases == 76);
}

TEST_CASE("elementwise bodies match their formulas in double precision") {
  kc::host_buffers h;
  auto p = h.ptrs();
  cpu::launch(kc::N, kernels::gelu_forward{p.a, p.f});
  double worst = 0;
  for (index_t i = 0; i < kc::N; ++i) worst = std::fmax(worst, std::fabs(h.f[i] - ref_gelu(h.a[i])));
  CHECK(worst < 2e-6);
  // GELU's backward against a central difference of the double formula
  cpu::launch(kc::N, kernels::gelu_backward{p.a, p.b, p.f});
  worst = 0;
  for (index_t i = 0; i < kc::N; ++i) {
    const double x = h.a[i], eps = 1e-5;
    const double d = (ref_gelu(x + eps) - ref_gelu(x - eps)) / (2 * eps);
    worst = std::fmax(worst, std::fabs(h.f[i] - h.b[i] * d) / std::fmax(1.0, std::fabs(h.b[i] * d)));
  }
  CHECK(worst < 1e-5);
  cpu::launch(kc::N, kernels::relu_backward{p.a, p.b, p.f});
  for (index_t i = 0; i < kc::N; ++i) CHECK(h.f[i] == (h.a[i] > 0 ? h.b[i] : 0.f));
}

TEST_CASE("SwiGLU bodies: SiLU(g) u and its gradient against double formulas, on rows of gate | up") {
  // rows of 2H (H = 150: not a multiple of a vector), and one odd row width
  for (const index_t H : {kc::C / 2, index_t{7}}) {
    const index_t rows = kc::N / (2 * H), n = rows * H;
    kc::host_buffers h;
    auto p = h.ptrs();
    cpu::launch(n, kernels::swiglu_forward{p.a, p.f, H});
    double worst = 0;
    for (index_t i = 0; i < n; ++i) {
      const index_t r = i / H, c = i % H;
      const double g = h.a[2 * r * H + c], u = h.a[2 * r * H + H + c];
      worst = std::fmax(worst, std::fabs(h.f[i] - ref_silu(g) * u) / std::fmax(1.0, std::fabs(ref_silu(g) * u)));
    }
    CHECK(worst < 1e-6);
    // the backward against central differences of the double formula
    cpu::launch(n, kernels::swiglu_backward{p.a, p.b, p.f, H});
    double worst_g = 0, worst_u = 0;
    for (index_t i = 0; i < n; ++i) {
      const index_t r = i / H, c = i % H;
      const double g = h.a[2 * r * H + c], u = h.a[2 * r * H + H + c], d = h.b[i], eps = 1e-5;
      const double dg = d * u * (ref_silu(g + eps) - ref_silu(g - eps)) / (2 * eps), du = d * ref_silu(g);
      worst_g = std::fmax(worst_g, std::fabs(h.f[2 * r * H + c] - dg) / std::fmax(1.0, std::fabs(dg)));
      worst_u = std::fmax(worst_u, std::fabs(h.f[2 * r * H + H + c] - du) / std::fmax(1.0, std::fabs(du)));
    }
    CHECK(worst_g < 1e-5);
    CHECK(worst_u < 1e-6);
    // under bf16: the inputs read as bf16 holds them, every output stored rounded
    kc::host_buffers b;
    auto q = b.ptrs();
    cpu::launch(n, kernels::swiglu_forward{q.a, q.f, H, true});
    for (index_t i = 0; i < n; ++i) {
      const index_t r = i / H, c = i % H;
      const float g = kernels::round_bf16(b.a[2 * r * H + c]), u = kernels::round_bf16(b.a[2 * r * H + H + c]);
      CHECK(b.f[i] == kernels::round_bf16(g * kernels::vsigmoid(g) * u));
    }
  }
}

TEST_CASE("row bodies: LayerNorm, causal softmax, cross-entropy and column sums against double references") {
  using kc::C, kc::R, kc::T;
  kc::host_buffers h;
  auto p = h.ptrs();
  cpu::launch(R, kernels::layer_norm_forward{p.a, p.b, p.c, p.f, p.e, p.d, C, 1e-5f});
  for (index_t r = 0; r < R; ++r) {
    double mean = 0, var = 0;
    for (index_t j = 0; j < C; ++j) mean += h.a[r * C + j];
    mean /= C;
    for (index_t j = 0; j < C; ++j) var += (h.a[r * C + j] - mean) * (h.a[r * C + j] - mean);
    var /= C;
    for (index_t j = 0; j < C; ++j) {
      const double y = (h.a[r * C + j] - mean) / std::sqrt(var + 1e-5) * h.b[j] + h.c[j];
      REQUIRE(std::fabs(h.f[r * C + j] - y) < 1e-5 * std::fmax(1.0, std::fabs(y)));
    }
  }
  // causal softmax: rows sum to one over the visible columns, zero after, ratios are exp differences
  kc::host_buffers s;
  cpu::launch(kc::N / T, kernels::causal_softmax_forward{s.a.data(), T});
  for (index_t row = 0; row < kc::N / T; ++row) {
    const index_t vis = row % T + 1;
    double sum = 0;
    for (index_t j = 0; j < T; ++j) {
      const float v = s.a[row * T + j];
      if (j >= vis) REQUIRE(v == 0.f);
      sum += v;
    }
    REQUIRE(sum == doctest::Approx(1.0).epsilon(1e-6));
    const double want = std::exp(static_cast<double>(h.a[row * T]) - h.a[row * T + vis - 1]);
    REQUIRE(s.a[row * T] / s.a[row * T + vis - 1] == doctest::Approx(want).epsilon(1e-5));
  }
  // cross-entropy: loss is the double log-sum-exp minus the target, gradient rows sum to zero
  cpu::launch(R, kernels::cross_entropy_rows{p.a, p.labels, p.f, p.rowd, C, 1.f / R, -100});
  for (index_t r = 0; r < R; ++r) {
    if (h.labels[r] == -100) {
      CHECK(h.rowd[r] == 0.0);
      continue;
    }
    double m = -INFINITY, se = 0, gs = 0;
    for (index_t j = 0; j < C; ++j) m = std::fmax(m, h.a[r * C + j]);
    for (index_t j = 0; j < C; ++j) se += std::exp(h.a[r * C + j] - m);
    CHECK(h.rowd[r] == doctest::Approx(std::log(se) + m - h.a[r * C + h.labels[r]]).epsilon(1e-6));
    for (index_t j = 0; j < C; ++j) gs += h.f[r * C + j];
    CHECK(std::fabs(gs) < 1e-6);
  }
  // column sums, accumulate off then on
  std::vector<float> out(C, 5.f);
  cpu::reduce_columns(kernels::column_sums{p.a, out.data(), R, C, false});
  cpu::reduce_columns(kernels::column_sums{p.a, out.data(), R, C, true});
  for (index_t j = 0; j < C; ++j) {
    double want = 0;
    for (index_t r = 0; r < R; ++r) want += h.a[r * C + j];
    CHECK(out[j] == doctest::Approx(2 * want).epsilon(1e-5).scale(1.0));
  }
}

TEST_CASE("embedding bodies: a lookup and its gradient, over the whole table or a slice of it") {
  // the table is a (R rows of C), tokens in [0, R); a slice holds rows [10, 25)
  for (const index_t first : {index_t{0}, index_t{10}}) {
    const index_t held = first ? 15 : -1;
    kc::host_buffers h;
    cpu::launch(kc::R, kernels::gather_rows{h.a.data(), h.tokens.data(), h.f.data(), kc::C, first, held});
    std::vector<float> grad(static_cast<std::size_t>(kc::N), 0.f);
    cpu::launch(kernels::col_blocks(kc::C),
                kernels::scatter_add_rows{h.b.data(), h.tokens.data(), grad.data(), kc::R, kc::C, 0, first, held});
    std::vector<float> want_grad(static_cast<std::size_t>(kc::N), 0.f);
    for (index_t r = 0; r < kc::R; ++r) {
      const index_t t = h.tokens[r] - first;
      const bool mine = held < 0 || (t >= 0 && t < held);
      for (index_t j = 0; j < kc::C; ++j) {
        INFO("first " << first << ", row " << r << ", column " << j);
        CHECK(h.f[r * kc::C + j] == (mine ? h.a[t * kc::C + j] : 0.f));
        if (mine) want_grad[t * kc::C + j] += h.b[r * kc::C + j];
      }
    }
    CHECK(grad == want_grad);  // the same rows added in the same order
  }
}

TEST_CASE("split-region bodies: the target logits of a class slice, and a block of columns moved") {
  kc::host_buffers h;
  const index_t n = kc::C / 2, c0 = 100;  // this rank's classes: columns [100, 250) of each row
  cpu::launch(kc::R, kernels::target_logits{h.a.data(), h.labels.data(), h.f.data(), n, c0, -100});
  int held = 0;
  for (index_t r = 0; r < kc::R; ++r) {
    const index_t y = h.labels[r];
    const bool mine = y != -100 && y >= c0 && y < c0 + n;
    held += mine;
    CHECK(h.f[r] == (mine ? h.a[r * n + (y - c0)] : 0.f));
  }
  CHECK(held > 0);  // the labels fall on both sides of the slice
  CHECK(held < kc::R);
  // rows 0..R/2 of columns [7, 7 + w) of a (., C) matrix into columns [3, 3 + w) of a (., C/2) one
  kc::host_buffers g;
  const index_t w = kc::C / 2 - 3;
  cpu::launch(kc::R / 2, kernels::copy_cols{g.a.data() + 7, kc::C, g.f.data() + 3, kc::C / 2, w});
  for (index_t r = 0; r < kc::R / 2; ++r)
    for (index_t j = 0; j < kc::C / 2; ++j) {
      INFO("row " << r << ", column " << j);
      CHECK(g.f[r * (kc::C / 2) + j] == (j >= 3 ? g.a[r * kc::C + 7 + (j - 3)] : 0.f));
    }
}

TEST_CASE("bf16 packing: pack then unpack is round_bf16; inf and NaN kept") {
  kc::host_buffers h;
  std::vector<float> x(h.a);
  x.insert(x.end(), {0.f, -0.f, 1e-40f, 3.4e38f, std::numeric_limits<float>::infinity(),
                     -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                     kernels::as_float(0x7f800001)});  // the last: a NaN whose payload is only in the low bits
  const auto n = static_cast<index_t>(x.size());
  std::vector<std::uint16_t> bits(x.size());
  std::vector<float> back(x.size());
  cpu::launch(n, kernels::pack_bf16{x.data(), bits.data()});
  cpu::launch(n, kernels::unpack_bf16{bits.data(), back.data()});
  for (index_t i = 0; i < n; ++i) {
    INFO("element " << i << ": " << x[i]);
    const float want = kernels::round_bf16(x[i]);
    if (std::isnan(x[i])) CHECK(std::isnan(back[i]));
    else CHECK(kernels::as_int(back[i]) == kernels::as_int(want));
  }
  CHECK(std::isnan(kernels::from_bf16_bits(kernels::bf16_bits(kernels::as_float(0x7f800001)))));
  // unpack_add adds the widened value (ZeRO 2-3 accumulating micro-batches in bf16)
  std::vector<float> acc(x.size(), 0.5f);
  cpu::launch(n, kernels::unpack_add_bf16{bits.data(), acc.data()});
  for (index_t i = 0; i < n; ++i) {
    INFO("element " << i << ": " << x[i]);
    if (std::isnan(x[i])) CHECK(std::isnan(acc[i]));
    else CHECK(acc[i] == 0.5f + back[i]);
  }
}

TEST_CASE("optimizer bodies match the scalar update rules") {
  kc::host_buffers h, o;
  auto p = h.ptrs();
  cpu::launch(kc::N, kernels::adamw_step{p.a, p.b, p.c, p.d, 0.9f, 0.999f, 0.01f, 500.f, 0.9999f, 1e-8f});
  for (index_t i = 0; i < kc::N; i += 97) {
    const double g = o.b[i], m = 0.9 * o.c[i] + 0.1 * g, v = 0.999 * o.d[i] + 0.001 * g * g;
    const double want = o.a[i] * 0.9999 - 0.01 * m / (std::sqrt(v * 500.0) + 1e-8);
    CHECK(h.a[i] == doctest::Approx(want).epsilon(1e-5));
    CHECK(h.c[i] == doctest::Approx(m).epsilon(1e-6));
  }
  kc::host_buffers s;
  auto q = s.ptrs();
  cpu::launch(kc::N, kernels::sgd_momentum{q.a, q.b, q.c, 0.01f, 0.1f, 0.9f, true});  // first step: buf = g + wd p
  for (index_t i = 0; i < kc::N; i += 97) CHECK(s.c[i] == doctest::Approx(o.b[i] + 0.1 * o.a[i]).epsilon(1e-6));
}

TEST_CASE("a gated update: the gradients scaled as they are read, or nothing changed while halted") {
  const double half = 0.5, go = 0.0, stop = 3.0;
  kc::host_buffers ref, gated, halted;
  auto r = ref.ptrs(), g = gated.ptrs(), h = halted.ptrs();
  cpu::launch(kc::N, kernels::scale{r.b, 0.5f});  // the host's clipping: scale the gradients, then update
  cpu::launch(kc::N, kernels::adamw_step{r.a, r.b, r.c, r.d, 0.9f, 0.999f, 0.01f, 500.f, 0.9999f, 1e-8f});
  const kernels::adamw_step gr{g.a, g.b, g.c, g.d, 0.9f, 0.999f, 0.01f, 500.f, 0.9999f, 1e-8f};
  cpu::launch(kc::N, kernels::gated_update<kernels::adamw_step>{gr, &half, &go});
  CHECK(gated.a == ref.a);  // the same bits
  CHECK(gated.c == ref.c);
  CHECK(gated.d == ref.d);
  const kc::host_buffers before;
  const kernels::adamw_step hr{h.a, h.b, h.c, h.d, 0.9f, 0.999f, 0.01f, 500.f, 0.9999f, 1e-8f};
  cpu::launch(kc::N, kernels::gated_update<kernels::adamw_step>{hr, &half, &stop});
  CHECK(halted.a == before.a);
  CHECK(halted.c == before.c);
  CHECK(halted.d == before.d);
}

TEST_CASE("sums left in memory: blocks then their sum in order; a step's check and clipping scale") {
  for (const index_t n : {index_t{0}, index_t{1}, index_t{255}, index_t{256}, index_t{8192}, index_t{8193}}) {
    INFO("n = " << n);
    std::vector<double> x(static_cast<std::size_t>(n));
    for (index_t i = 0; i < n; ++i) x[static_cast<std::size_t>(i)] = std::sin(static_cast<double>(i)) * 3.0 + 0.1;
    const index_t nb = kernels::sum_blocks::blocks(n);
    std::vector<double> part(static_cast<std::size_t>(nb) + 1);
    cpu::launch(nb, kernels::sum_blocks{x.data(), part.data(), n});
    double want = 0.0;  // the same order, written out
    for (index_t b = 0; b < nb; ++b) {
      double s = 0.0;
      for (index_t i = b * 256; i < std::min(n, (b + 1) * 256); ++i) s += x[static_cast<std::size_t>(i)];
      want += s;
    }
    double out = 7.0;
    cpu::launch(1, kernels::sum_in_order{part.data(), nb, 0.25, &out, false});
    CHECK(out == want * 0.25);
    cpu::launch(1, kernels::sum_in_order{part.data(), nb, 0.25, &out, true});
    CHECK(out == want * 0.25 + want * 0.25);
    double direct = 0.0;
    for (const double v : x) direct += v;
    CHECK(out == doctest::Approx(direct * 0.5).epsilon(1e-12));
    // the backend's composition, on the CPU
    double via = 1.0;
    backend_ref{}.sum_into(n, x.data(), 0.25, &via, true);
    CHECK(via == 1.0 + want * 0.25);
  }
  kernels::step_figures rec{2.5, 16.0, 0, 0};
  double halt = 0;
  cpu::launch(1, kernels::check_step{&rec, &halt, 1.0, 3.0, true});
  CHECK(rec.fault == 0);
  CHECK(halt == 0);
  CHECK(rec.scale == static_cast<double>(clip_coefficient(4.0, 1.0)));  // norm 4 clipped to 1
  rec = {2.5, 16.0, 0, 0};
  cpu::launch(1, kernels::check_step{&rec, &halt, 0.0, 3.0, true});
  CHECK(rec.scale == 1.0);  // no clipping
  rec = {2.5, NAN, 0, 0};
  cpu::launch(1, kernels::check_step{&rec, &halt, 1.0, 3.0, true});
  CHECK(rec.fault == 2);  // the norm
  CHECK(halt == 3.0);     // the first faulty step stays
  CHECK(rec.scale == 1.0);
  rec = {INFINITY, 1.0, 0, 0};
  cpu::launch(1, kernels::check_step{&rec, &halt, 1.0, 5.0, true});
  CHECK(rec.fault == 1);  // the loss
  CHECK(halt == 3.0);
  rec = {1.0, NAN, 0, 0};
  halt = 0;
  cpu::launch(1, kernels::check_step{&rec, &halt, 0.0, 1.0, false});
  CHECK(rec.fault == 0);  // the norm not checked (check_grad_norm off, no clipping)
  CHECK(halt == 0);
}

TEST_CASE("bf16 rounding: nearest, ties to even, inf and NaN kept") {
  CHECK(kernels::round_bf16(1.f) == 1.f);
  CHECK(kernels::round_bf16(1.f + 0x1p-8f) == 1.f);                   // a tie: to even (1.0)
  CHECK(kernels::round_bf16(1.f + 3 * 0x1p-8f) == 1.f + 0x1p-6f);     // a tie: to even (upwards)
  CHECK(kernels::round_bf16(1.f + 0x1p-8f + 0x1p-20f) == 1.f + 0x1p-7f);  // above the tie: up
  CHECK(kernels::round_bf16(-2.5f) == -2.5f);
  CHECK(std::isinf(kernels::round_bf16(INFINITY)));
  CHECK(std::isnan(kernels::round_bf16(NAN)));
  CHECK(std::isinf(kernels::round_bf16(3.4e38f)));  // beyond bf16's largest finite value
  // every rounded value has 8 significant bits: the low 16 bits are zero
  kc::host_buffers h;
  cpu::launch(kc::N, kernels::to_bf16{h.a.data()});
  for (index_t i = 0; i < kc::N; ++i) REQUIRE((kernels::as_int(h.a[i]) & 0xffff) == 0);
}

TEST_CASE("cpu_backend models Backend: GEMM, launch, memory and a no-op queue") {
  static_assert(Backend<cpu_backend>);
  cpu_backend b;
  const index_t M = 5, N = 7, K = 3;
  std::vector<float> A(M * K), B(K * N), Cm(M * N, 0.f);
  for (index_t i = 0; i < M * K; ++i) A[i] = static_cast<float>(i % 5) - 2;
  for (index_t i = 0; i < K * N; ++i) B[i] = static_cast<float>(i % 3) - 1;
  b.gemm(trans::no, trans::no, M, N, K, 1.f, A.data(), K, B.data(), N, 0.f, Cm.data(), N);
  for (index_t i = 0; i < M; ++i)
    for (index_t j = 0; j < N; ++j) {
      float want = 0;
      for (index_t k = 0; k < K; ++k) want += A[i * K + k] * B[k * N + j];
      CHECK(Cm[i * N + j] == want);
    }
  auto* p = static_cast<float*>(b.allocate(64 * sizeof(float)));
  b.fill_zero(p, 64 * sizeof(float));
  b.launch(64, kernels::add{p, p, p});
  cpu_backend::event_type e;
  b.record(e), b.wait(e), b.synchronize();
  CHECK(p[63] == 0.f);
  b.deallocate(p, 64 * sizeof(float));
}

namespace {
struct counting_upstream {
  int* calls;
  std::vector<void*>* live;
  void* allocate(std::size_t n) {
    ++*calls;
    void* p = std::malloc(n);
    live->push_back(p);
    return p;
  }
  void deallocate(void* p, std::size_t) {
    std::erase(*live, p);
    std::free(p);
  }
};
}  // namespace

TEST_CASE("caching_allocator: the steady state of a training loop reaches the upstream never") {
  int calls = 0;
  std::vector<void*> live;
  {
    caching_allocator<counting_upstream> a(counting_upstream{&calls, &live});
    CHECK(a.rounded(1) == 512);
    CHECK(a.rounded(3u << 20) == (4u << 20));
    const std::size_t sizes[] = {1000, 4096, 3u << 20, 100, 1u << 20};
    int after_first = 0;
    for (int step = 0; step < 5; ++step) {
      std::vector<std::pair<void*, std::size_t>> held;
      for (auto n : sizes) held.push_back({a.allocate(n), n});
      for (auto& [p, n] : held) a.deallocate(p, n);
      if (step == 0) after_first = calls;
    }
    CHECK(after_first == 5);
    CHECK(calls == 5);  // no new upstream allocation after the first step
    CHECK(a.stats().cache_hits == 20);
    CHECK(a.stats().bytes_in_use == 0);
    // a smaller request reuses a block up to twice its size; a much smaller one does not
    void* big = a.allocate(4096);
    CHECK(calls == 5);
    a.deallocate(big);
    CHECK_THROWS_WITH_AS(a.deallocate(&calls), doctest::Contains("did not allocate"), std::invalid_argument);
  }
  CHECK(live.empty());  // the destructor returned every block
}

TEST_CASE("WHALE_CPU_ISA caps the kernels' instruction set and is parsed whole") {
  ::setenv("WHALE_CPU_ISA", "baseline", 1);
  CHECK(cpu::detail::detect_isa() == cpu::isa::baseline);
  for (const char* bad : {"avx3", "", "AVX2", "avx2 "}) {
    ::setenv("WHALE_CPU_ISA", bad, 1);
    CHECK_THROWS_WITH_AS(cpu::detail::detect_isa(), doctest::Contains("WHALE_CPU_ISA"), std::invalid_argument);
  }
  ::unsetenv("WHALE_CPU_ISA");
}
