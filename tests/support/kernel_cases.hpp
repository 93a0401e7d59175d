// Every kernel body of backend/kernels/ as a test case over one set of named
// buffers, so that one list drives the CPU test (tests/test_kernels.cpp: each
// ISA path of the CPU loop against the others) and the GPU test
// (tests/cuda_backend.cu: the CUDA grid against the CPU loop). Inputs are
// deterministic; a case names its index-space size and builds its body from
// buffer pointers, which may be host or device pointers.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "whale/backend/kernels/elementwise.hpp"
#include "whale/backend/kernels/optim.hpp"
#include "whale/backend/kernels/rows.hpp"
#include "whale/backend/kernels/shapes.hpp"

namespace kernel_cases {

using whale::index_t;
namespace k = whale::kernels;

inline constexpr index_t R = 37, C = 300, T = 8;  // rows, columns (not a multiple of a block), sequence
inline constexpr index_t N = R * C;

/// The buffers every case reads and writes: float arrays a..f of N; class
/// labels of R (in [0, C), one ignored); token rows of R (in [0, R)); per-row doubles of R.
struct buffers {
  float *a, *b, *c, *d, *e, *f;
  std::int32_t *labels, *tokens;
  double* rowd;
};

/// Deterministic host contents: values in about [-3, 3), labels in [0, C) with one ignored row.
struct host_buffers {
  std::vector<float> a, b, c, d, e, f;
  std::vector<std::int32_t> labels, tokens;
  std::vector<double> rowd;
  host_buffers() : a(N), b(N), c(N), d(N), e(N), f(N), labels(R), tokens(R), rowd(R) {
    std::uint32_t s = 12345;
    auto next = [&] {
      s = s * 1664525u + 1013904223u;
      return static_cast<float>(s >> 8) / 16777216.f * 6.f - 3.f;
    };
    for (auto* v : {&a, &b, &c, &d, &e}) for (auto& x : *v) x = next();
    for (auto& x : d) x = std::fabs(x) + 0.1f;  // positive: second moments, sums
    for (auto& x : f) x = 0.f;
    for (index_t r = 0; r < R; ++r) labels[r] = static_cast<std::int32_t>((r * 97) % C);
    labels[5] = -100;  // ignore_index
    for (index_t r = 0; r < R; ++r) tokens[r] = static_cast<std::int32_t>((r * 7) % R);
    // rowd[0] = 0.5: a clipping scale; rowd[1] = 0: go; rowd[2] = 1: halt (update_gate)
    for (index_t r = 0; r < R; ++r) rowd[r] = r == 1 ? 0.0 : 0.5 + 0.25 * static_cast<double>(r % 7);
  }
  buffers ptrs() { return {a.data(), b.data(), c.data(), d.data(), e.data(), f.data(), labels.data(), tokens.data(), rowd.data()}; }
  std::vector<std::vector<float>*> floats() { return {&a, &b, &c, &d, &e, &f}; }
};

/// Calls f(name, n, make) for each case; make(buffers) returns the body: an
/// index body over n indices, a row body over n rows, or a column body (n its columns).
template <class F> void for_each_case(F&& f) {
  f("gelu_forward", N, [](buffers p) { return k::gelu_forward{p.a, p.f}; });
  f("gelu_backward", N, [](buffers p) { return k::gelu_backward{p.a, p.b, p.f}; });
  f("relu_forward", N, [](buffers p) { return k::relu_forward{p.a, p.f}; });
  f("relu_backward", N, [](buffers p) { return k::relu_backward{p.a, p.b, p.f}; });
  f("add", N, [](buffers p) { return k::add{p.a, p.b, p.f}; });
  f("to_bf16", N, [](buffers p) { return k::to_bf16{p.a}; });
  f("tie_sum", N, [](buffers p) { return k::tie_sum{p.a, p.b}; });  // a tied head's and its table's gradients
  // under bf16 the producing kernels store rounded (kernels::stored_as)
  f("gelu_forward (stored as bf16)", N, [](buffers p) { return k::gelu_forward{p.a, p.f, true}; });
  f("add (stored as bf16)", N, [](buffers p) { return k::add{p.a, p.b, p.f, true}; });
  f("bias_rows (added after the product, stored as bf16)", R, [](buffers p) { return k::bias_rows{p.f, p.a, C, true, true}; });
  f("layer_norm_forward (stored as bf16)", R,
    [](buffers p) { return k::layer_norm_forward{p.a, p.b, p.c, p.f, p.e, p.d, C, 1e-5f, true}; });
  f("layer_norm_backward (stored as bf16)", R, [](buffers p) { return k::layer_norm_backward{p.a, p.b, p.d, p.c, p.f, C, true}; });
  // a residual's sum left to the layer norm after it: e = b + (e + c), rounded, stored in e and normalised
  f("layer_norm_forward (a residual's sum stored first, bf16)", R, [](buffers p) {
    k::layer_norm_forward body{p.e, p.b, p.c, p.f, nullptr, p.d, C, 1e-5f, true, p.d + R};
    body.sum_y = p.e, body.sum_bias = p.c, body.sum_add = p.b;
    return body;
  });
  f("layer_norm_forward (a residual's sum without bias, bf16)", R, [](buffers p) {
    k::layer_norm_forward body{p.e, p.b, p.c, p.f, nullptr, p.d, C, 1e-5f, true, p.d + R};
    body.sum_y = p.e, body.sum_add = p.a;
    return body;
  });
  f("rms_norm_forward (a residual's sum stored first, bf16)", R, [](buffers p) {
    k::rms_norm_forward body{p.e, p.b, p.f, p.c, p.d, C, 1e-6f, true};
    body.sum_y = p.e, body.sum_add = p.a;
    return body;
  });
  f("gather_rows (stored as bf16)", R, [](buffers p) { return k::gather_rows{p.a, p.tokens, p.f, C, 0, -1, true}; });
  f("add_positions (stored as bf16)", R, [](buffers p) { return k::add_positions{p.a, p.b, p.f, T, C, true}; });
  f("copy_stored (bf16)", N, [](buffers p) { return k::copy_stored{p.a, p.f, true}; });
  f("bias_rows", R, [](buffers p) { return k::bias_rows{p.f, p.a, C, true}; });
  // a linear without bias under bf16: the pass stores the product rounded, adding a residual's input
  f("bias_rows (no bias, residual added, stored as bf16)", R,
    [](buffers p) { return k::bias_rows{p.a, nullptr, C, true, true, p.b}; });
  // SwiGLU on rows of 2 x 150 (gate | up): h and d(gate | up)
  f("swiglu_forward", N / 2, [](buffers p) { return k::swiglu_forward{p.a, p.f, C / 2}; });
  f("swiglu_backward", N / 2, [](buffers p) { return k::swiglu_backward{p.a, p.b, p.f, C / 2}; });
  f("swiglu_forward (stored as bf16)", N / 2, [](buffers p) { return k::swiglu_forward{p.a, p.f, C / 2, true}; });
  f("swiglu_backward (stored as bf16)", N / 2, [](buffers p) { return k::swiglu_backward{p.a, p.b, p.f, C / 2, true}; });
  // RoPE on 12 heads of 20 of rows of 300 (d stands in for the cos | sin table of T positions), both ways
  f("rotary_rows", R * 12 * 10, [](buffers p) { return k::rotary_rows{p.a, p.d, C, 12, 20, T, false}; });
  f("rotary_rows (inverse)", R * 12 * 10, [](buffers p) { return k::rotary_rows{p.a, p.d, C, 12, 20, T, true}; });
  // grouped-query attention: 4 query heads, 2 KV heads of 10; repeated, then summed back
  f("repeat_kv", R * 120, [](buffers p) { return k::repeat_kv{p.a, p.f, 4, 2, 10}; });
  f("sum_kv_groups", R * 80, [](buffers p) { return k::sum_kv_groups{p.a, p.f, 4, 2, 10}; });
  f("column_sums", C, [](buffers p) { return k::column_sums{p.a, p.f, R, C, false}; });
  f("column_sums (9 row tiles)", 20, [](buffers p) { return k::column_sums{p.a, p.f, N / 20, 20, true}; });
  f("layer_norm_forward", R,
    [](buffers p) { return k::layer_norm_forward{p.a, p.b, p.c, p.f, p.e, p.d, C, 1e-5f}; });
  f("layer_norm_backward", R, [](buffers p) { return k::layer_norm_backward{p.a, p.b, p.d, p.c, p.f, C}; });
  f("layer_norm_backward (a residual's gradient added, stored as bf16)", R,
    [](buffers p) { return k::layer_norm_backward{p.a, p.b, p.d, p.c, p.f, C, true, p.e}; });
  f("rms_norm_forward", R, [](buffers p) { return k::rms_norm_forward{p.a, p.b, p.f, p.e, p.d, C, 1e-5f}; });
  f("rms_norm_backward (a residual's gradient added, stored as bf16)", R,
    [](buffers p) { return k::rms_norm_backward{p.a, p.b, p.d, p.c, p.f, C, true, p.e}; });
  f("rms_norm_forward (one row of 4,200: a block team)", 1,
    [](buffers p) { return k::rms_norm_forward{p.a, p.b, p.f, p.e, p.d, 4200, 1e-5f}; });
  // x-hat not kept: the forward keeps each row's mean, the backward recomputes x-hat from x (a), the mean and rstd (d)
  f("layer_norm_forward (x-hat not kept, the means kept)", R,
    [](buffers p) { return k::layer_norm_forward{p.a, p.b, p.c, p.f, nullptr, p.d, C, 1e-5f, true, p.e}; });
  f("layer_norm_backward (x-hat from x, a residual's gradient added)", R, [](buffers p) {
    return k::layer_norm_backward{p.b, nullptr, p.d, p.c, p.f, C, true, p.e, p.a, p.d + R};
  });
  f("layer_norm_param_grads (x-hat from x)", C, [](buffers p) {
    return k::layer_norm_param_grads{p.b, nullptr, p.f, p.e, R, C, false, true, p.a, p.d + R, p.d};
  });
  f("layer_norm_param_grads", C, [](buffers p) { return k::layer_norm_param_grads{p.a, p.b, p.f, p.e, R, C, true}; });
  f("layer_norm_param_grads (4 row tiles)", 50,
    [](buffers p) { return k::layer_norm_param_grads{p.a, p.b, p.f, p.e, 222, 50, false}; });
  f("layer_norm_forward (one row of 4,200: a block team)", 1,
    [](buffers p) { return k::layer_norm_forward{p.a, p.b, p.c, p.f, p.e, p.d, 4200, 1e-5f}; });
  f("cross_entropy_rows (rows of 5,550: a block team)", 2,
    [](buffers p) { return k::cross_entropy_rows{p.a, p.labels, p.f, p.rowd, N / 2, 1.f / 2, -100}; });
  f("causal_softmax_forward", N / T, [](buffers p) { return k::causal_softmax_forward{p.a, T}; });
  f("causal_softmax_backward", N / T, [](buffers p) { return k::causal_softmax_backward{p.a, p.b, p.c, T}; });
  f("causal_softmax_forward (keeping log-sum-exps)", N / T,
    [](buffers p) { return k::causal_softmax_forward{p.a, T, p.e}; });
  // 3 parts (Q, K, V) of 3 sequences of T tokens, 5 heads of width 30: 360 head-rows, 10,800 of the N elements
  f("split_heads", 3 * 3 * T * 5, [](buffers p) { return k::split_heads{p.a, p.f, {3, T, 5, 30, 3}}; });
  f("merge_heads", 3 * 3 * T * 5, [](buffers p) { return k::merge_heads{p.a, p.f, {3, T, 5, 30, 3}}; });
  f("cross_entropy_rows", R,
    [](buffers p) { return k::cross_entropy_rows{p.a, p.labels, p.f, p.rowd, C, 1.f / R, -100}; });
  f("cross_entropy_rows (gradient in place of the logits)", R,
    [](buffers p) { return k::cross_entropy_rows{p.a, p.labels, p.a, p.rowd, C, 1.f / R, -100}; });
  f("cross_entropy_rows (gradient stored as bf16)", R,
    [](buffers p) { return k::cross_entropy_rows{p.a, p.labels, p.f, p.rowd, C, 1.f / R, -100, true}; });
  // the regression losses: predictions a against targets b, differences on both sides of Huber's delta
  f("regression_rows (mse)", R,
    [](buffers p) { return k::regression_rows{p.a, p.b, p.f, p.rowd, C, 1.f / (R * C), k::regression::mse}; });
  f("regression_rows (l1)", R,
    [](buffers p) { return k::regression_rows{p.a, p.b, p.f, p.rowd, C, 1.f / (R * C), k::regression::l1}; });
  f("regression_rows (huber, delta 1.5, gradient stored as bf16)", R, [](buffers p) {
    return k::regression_rows{p.a, p.b, p.f, p.rowd, C, 1.f / (R * C), k::regression::huber, 1.5f, true};
  });
  f("row_max", R, [](buffers p) { return k::row_max{p.a, p.f, C}; });
  f("exp_rows", R, [](buffers p) { return k::exp_rows{p.a, p.b, p.f, p.e, C}; });
  f("target_logits", R, [](buffers p) { return k::target_logits{p.a, p.labels, p.f, C / 2, 100, -100}; });
  f("copy_cols", R / 2, [](buffers p) { return k::copy_cols{p.a + 7, C, p.f + 3, C / 2, C / 2 - 3}; });
  f("softmax_grad_rows", R,
    [](buffers p) { return k::softmax_grad_rows{p.a, p.d, p.labels, C, 100, 1.f / R, -100}; });
  f("add_positions", R, [](buffers p) { return k::add_positions{p.a, p.b, p.f, T, C}; });
  f("scatter_add_rows (tokens)", k::col_blocks(C),
    [](buffers p) { return k::scatter_add_rows{p.a, p.tokens, p.f, R, C, 0}; });
  f("scatter_add_rows (positions)", k::col_blocks(C),
    [](buffers p) { return k::scatter_add_rows{p.a, nullptr, p.f, R, C, T}; });
  f("scatter_add_stripes (a slice of the table)", k::scatter_add_stripes::stripes_for(C) * C, [](buffers p) {
    return k::scatter_add_stripes{k::scatter_add_rows{p.a, p.tokens, p.f, R, C, 0, 10, 15}, k::scatter_add_stripes::stripes_for(C)};
  });
  f("gather_rows", R, [](buffers p) { return k::gather_rows{p.a, p.tokens, p.f, C}; });
  f("gather_rows (a slice of the table)", R, [](buffers p) { return k::gather_rows{p.a, p.tokens, p.f, C, 10, 15}; });
  f("scatter_add_rows (a slice of the table)", k::col_blocks(C),
    [](buffers p) { return k::scatter_add_rows{p.a, p.tokens, p.f, R, C, 0, 10, 15}; });
  f("scale", N, [](buffers p) { return k::scale{p.a, 0.37f}; });
  f("sgd_plain", N, [](buffers p) { return k::sgd_plain{p.a, p.b, 0.01f, 0.1f}; });
  f("sgd_momentum", N, [](buffers p) { return k::sgd_momentum{p.a, p.b, p.c, 0.01f, 0.1f, 0.9f, false}; });
  f("adamw_step", N,
    [](buffers p) { return k::adamw_step{p.a, p.b, p.c, p.d, 0.9f, 0.999f, 0.01f, 1.f / 0.002f, 0.9999f, 1e-8f}; });
  // under a gate in device memory (trainer_options::log_every): the gradients scaled by rowd[0] as they are read
  f("gated_update<adamw_step> (a clipping scale)", N, [](buffers p) {
    return k::gated_update<k::adamw_step>{{p.a, p.b, p.c, p.d, 0.9f, 0.999f, 0.01f, 1.f / 0.002f, 0.9999f, 1e-8f},
                                          p.rowd, p.rowd + 1};
  });
  f("gated_update<sgd_momentum> (a clipping scale)", N, [](buffers p) {
    return k::gated_update<k::sgd_momentum>{{p.a, p.b, p.c, 0.01f, 0.1f, 0.9f, false}, p.rowd, p.rowd + 1};
  });
  f("gated_update<sgd_plain> (halted)", N,
    [](buffers p) { return k::gated_update<k::sgd_plain>{{p.a, p.b, 0.01f, 0.1f}, p.rowd, p.rowd + 2}; });
  // also writing what the step changed, weighed (Wave Synchronous Parallel's update), into f
  f("gated_delta_update<adamw_step> (a clipping scale)", N, [](buffers p) {
    return k::gated_delta_update<k::adamw_step>{
        {p.a, p.b, p.c, p.d, 0.9f, 0.999f, 0.01f, 1.f / 0.002f, 0.9999f, 1e-8f}, p.rowd, p.rowd + 1, {p.f, 0.3f}};
  });
  f("gated_delta_update<sgd_momentum> (a clipping scale)", N, [](buffers p) {
    return k::gated_delta_update<k::sgd_momentum>{{p.a, p.b, p.c, 0.01f, 0.1f, 0.9f, false}, p.rowd, p.rowd + 1, {p.f, 0.3f}};
  });
  f("gated_delta_update<sgd_plain> (halted)", N, [](buffers p) {
    return k::gated_delta_update<k::sgd_plain>{{p.a, p.b, 0.01f, 0.1f}, p.rowd, p.rowd + 2, {p.f, 0.3f}};
  });
}

/// Runs a case's body on a backend (cpu_backend, backend_ref): by its shape.
template <class Be, class K> void run(const Be& be, index_t n, const K& body) {
  if constexpr (whale::kernels::ColumnBody<K>) be.reduce_columns(body);
  else be.launch(n, body);
}

/// Largest |x - y| / max(1, |y|) over two arrays.
inline double max_rel_diff(const std::vector<float>& x, const std::vector<float>& y) {
  double m = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double d = std::fabs(static_cast<double>(x[i]) - y[i]) / std::fmax(1.0, std::fabs(static_cast<double>(y[i])));
    if (d > m || std::isnan(d)) m = std::isnan(d) ? INFINITY : d;
  }
  return m;
}

}  // namespace kernel_cases
