// The compositions layers share, defined: backend_ref's sums of squares and
// ordered sums, attention forward and backward in five steps (or a device's
// fused form), the embedding's scatter-add, bias rows and column sums, GEMMs
// with bias or GELU epilogues, and a linear layer's weight gradients. Each is
// declared, with what it computes, in backend/backend_ref.hpp, which includes
// this file after the class.
#pragma once

#include <cmath>
#include <vector>

#include "whale/backend/backend_ref.hpp"

namespace whale {

inline double backend_ref::sum_squares(index_t n, const float* x) const {
  if (!gpu_) return cpu::sum_squares(n, x);
  const scratch total(*this, 3);
  double* t = doubles(total);
  sum_squares_into(n, x, t);
  std::vector<double> host;
  return host_readable(cview<double>(t, {1}), host)[0];
}

inline void backend_ref::sum_squares_into(index_t n, const float* x, double* out) const {
  if (!gpu_) {
    *out = cpu::sum_squares(n, x);
    return;
  }
  const index_t nb = kernels::sum_squares_blocks::blocks(n), ng = kernels::sum_blocks::blocks(nb);
  const scratch partial(*this, 2 * (nb + ng) + 2);
  double* part = doubles(partial);
  if (nb > 0) {
    launch(nb, kernels::sum_squares_blocks{x, part, n});
    launch(ng, kernels::sum_blocks{part, part + nb, nb});
  }
  launch(1, kernels::sum_in_order{part + nb, ng, 1.0, out, false});
}

inline void backend_ref::sum_into(index_t n, const double* x, double scale, double* out, bool add) const {
  const index_t nb = kernels::sum_blocks::blocks(n);
  const scratch partial(*this, 2 * nb + 2);
  double* part = doubles(partial);
  if (nb > 0) launch(nb, kernels::sum_blocks{x, part, n});
  launch(1, kernels::sum_in_order{part, nb, scale, out, add});
}

inline void backend_ref::attention_forward(index_t B, index_t T, index_t H, index_t hd, const float* qkv, float* o, float* lse,
    bool bf16, float* packed) const {
  if (gpu_ && ops_->attention &&
      ops_->attention(gpu_, attention_args{B, T, H, hd, qkv, o, lse, nullptr, nullptr, bf16, packed}, false))
    return;
  const kernels::head_layout in{B, T, H, hd, 3}, out{B, T, H, hd, 1};
  const index_t n = B * H, th = T * hd, tt = T * T;
  const scratch heads(*this, in.elements()), s(*this, n * tt), oh(*this, out.elements());
  const float* q = heads.p;
  launch_rows(kernels::split_heads{qkv, heads.p, in});
  gemm_strided_batched(trans::no, trans::yes, T, T, hd, attention_scale(hd), q, hd, th, q + n * th, hd, th, 0.f,
                       s.p, T, tt, n);
  launch(n * T, kernels::causal_softmax_forward{s.p, T, lse});
  gemm_strided_batched(trans::no, trans::no, T, hd, T, 1.f, s.p, T, tt, q + 2 * n * th, hd, th, 0.f, oh.p, hd, th,
                       n);
  launch_rows(kernels::merge_heads{oh.p, o, out});
}

inline void backend_ref::attention_backward(index_t B, index_t T, index_t H, index_t hd, const float* qkv, const float* o,
    const float* lse, const float* dout, float* dqkv, bool bf16,
    float* packed) const {
  if (gpu_ && ops_->attention &&
      ops_->attention(gpu_, attention_args{B, T, H, hd, qkv, const_cast<float*>(o), const_cast<float*>(lse), dout, dqkv,
                                           bf16, packed},
                      true))
    return;
  const kernels::head_layout in{B, T, H, hd, 3}, one{B, T, H, hd, 1};
  const index_t n = B * H, th = T * hd, tt = T * T;
  const float scale = attention_scale(hd);
  const scratch heads(*this, in.elements()), dheads(*this, in.elements()), dh(*this, one.elements());
  const scratch p(*this, n * tt), dp(*this, n * tt);
  const float *q = heads.p, *k = q + n * th, *v = k + n * th;
  float *dq = dheads.p, *dk = dq + n * th, *dv = dk + n * th;
  launch_rows(kernels::split_heads{qkv, heads.p, in});
  launch_rows(kernels::split_heads{dout, dh.p, one});
  gemm_strided_batched(trans::no, trans::yes, T, T, hd, scale, q, hd, th, k, hd, th, 0.f, p.p, T, tt, n);
  gemm_strided_batched(trans::no, trans::yes, T, T, hd, 1.f, dh.p, hd, th, v, hd, th, 0.f, dp.p, T, tt, n);
  launch(n * T, kernels::causal_softmax_backward{p.p, dp.p, lse, T});
  gemm_strided_batched(trans::yes, trans::no, T, hd, T, 1.f, p.p, T, tt, dh.p, hd, th, 0.f, dv, hd, th, n);
  gemm_strided_batched(trans::no, trans::no, T, hd, T, scale, dp.p, T, tt, k, hd, th, 0.f, dq, hd, th, n);
  gemm_strided_batched(trans::yes, trans::no, T, hd, T, scale, dp.p, T, tt, q, hd, th, 0.f, dk, hd, th, n);
  launch_rows(kernels::merge_heads{dheads.p, dqkv, in});
}

inline index_t backend_ref::attention_packed_floats(index_t rows, index_t W, bool bf16) const {
  return bf16 && gpu_ && ops_->attention_fused && ops_->attention_fused(gpu_) ? rows * 2 * W : 0;
}

inline void backend_ref::scatter_add(const kernels::scatter_add_rows& body) const {
  if (!gpu_) return launch(kernels::col_blocks(body.D), body);
  const index_t stripes = kernels::scatter_add_stripes::stripes_for(body.D);
  launch(stripes * body.D, kernels::scatter_add_stripes{body, stripes});
}

inline void backend_ref::add_row_bias(float* y, const float* b, index_t rows, index_t cols) const {
  launch(rows, kernels::bias_rows{y, b, cols, true});
}

inline void backend_ref::sum_rows(const float* dy, float* db, index_t rows, index_t cols, bool accumulate) const {
  reduce_columns(kernels::column_sums{dy, db, rows, cols, accumulate});
}

inline void backend_ref::gemm_bias(trans ta, trans tb, index_t M, index_t N, index_t K, const float* A, const float* B,
    const float* bias, float* C) const {
  if (!bias || K == 0) {
    if (bias) launch(M, kernels::bias_rows{C, bias, N, false});
    else gemm(ta, tb, M, N, K, 1.f, A, B, 0.f, C);
    return;
  }
  if (gpu_ && ops_->bias_gemm && ops_->bias_gemm(gpu_, gemm_bias_args{ta, tb, M, N, K, A, B, bias, C})) return;
  launch(M, kernels::bias_rows{C, bias, N, false});
  gemm(ta, tb, M, N, K, 1.f, A, B, 1.f, C);
}

inline void backend_ref::gemm_gelu(const gemm_gelu_args& a) const {
  if (a.M == 0 || a.N == 0) return;
  if (a.K > 0 && gpu_ && ops_->gelu_gemm && ops_->gelu_gemm(gpu_, a)) return;
  unfused_gemm_gelu(*this, a);
}

template <class Be> void backend_ref::unfused_gemm_gelu(Be&& be, const gemm_gelu_args& a) {
  if (!a.backward) {
    be.gemm_bias(a.ta, a.tb, a.M, a.N, a.K, a.A, a.B, a.bias, a.pre);
    be.launch(a.M * a.N, kernels::gelu_forward{a.pre, a.out, a.round});
  } else {
    be.gemm(a.ta, a.tb, a.M, a.N, a.K, 1.f, a.A, a.B, 0.f, a.out);
    be.launch(a.M * a.N, kernels::gelu_backward{a.pre, a.out, a.out, a.round});
  }
}

inline void backend_ref::linear_weight_grads(index_t R, index_t out, index_t in, const float* dy, const float* x, float* dw, float* db,
    bool accumulate) const {
  if (!db) {  // no bias (linear<In, Out, no_bias>): the GEMM alone
    gemm(trans::yes, trans::no, out, in, R, 1.f, dy, x, accumulate ? 1.f : 0.f, dw);
    return;
  }
  if (gpu_ && !accumulate && ops_->weight_grads && ops_->weight_grads(gpu_, weight_grad_args{R, out, in, dy, x, dw, db}))
    return;
  gemm(trans::yes, trans::no, out, in, R, 1.f, dy, x, accumulate ? 1.f : 0.f, dw);
  sum_rows(dy, db, R, out, accumulate);
}

}  // namespace whale
