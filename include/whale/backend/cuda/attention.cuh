// Causal attention through cuDNN's fused flash attention (the cuDNN
// frontend's graph API, header-only): bf16 Q, K, V and O with fp32
// accumulation and fp32 softmax statistics, forward and backward, no T x T
// tensor anywhere. The CUDA backend (backend/cuda.hpp) runs it for
// backend_ref::attention_forward / attention_backward under bf16 mixed
// precision; the statistics are the natural log-sum-exp of each query's
// scaled scores, the same lse the CPU's steps keep, so either backward can
// follow either forward. Built only where CMake found the frontend's headers
// and libcudnn (WHALE_HAS_CUDNN_FRONTEND); a shape cuDNN refuses returns false
// and the caller takes the batched-GEMM steps.
#pragma once

#if defined(WHALE_HAS_CUDNN_FRONTEND)

#include <cstring>  // before the frontend, whose shim uses std::strlen without it

#include <cudnn_frontend.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "whale/fwd.hpp"

namespace whale::detail {

/// One cuDNN handle on one stream, and the forward and backward graphs built
/// for each shape (B, T, H, hd) asked for, kept for the backend's life.
class cudnn_attention {
 public:
  explicit cudnn_attention(cudaStream_t stream) {
    check(cudnnCreate(&handle_), "cudnnCreate");
    check(cudnnSetStream(handle_, stream), "cudnnSetStream");
  }
  ~cudnn_attention() {
    fwd_.clear();
    bwd_.clear();
    if (handle_) cudnnDestroy(handle_);
  }
  cudnn_attention(const cudnn_attention&) = delete;
  cudnn_attention& operator=(const cudnn_attention&) = delete;

  /// Whether cuDNN runs this shape forward and backward (plans built on the
  /// first call for a shape); `why` says what it refused otherwise.
  bool supports(index_t B, index_t T, index_t H, index_t hd, std::string& why) {
    const auto& f = forward_graph(B, T, H, hd);
    const auto& b = backward_graph(B, T, H, hd);
    why = !f.why.empty() ? f.why : b.why;
    return why.empty();
  }
  /// Workspace bytes the forward and the backward of a supported shape need.
  std::int64_t forward_workspace(index_t B, index_t T, index_t H, index_t hd) { return forward_graph(B, T, H, hd).workspace; }
  std::int64_t backward_workspace(index_t B, index_t T, index_t H, index_t hd) { return backward_graph(B, T, H, hd).workspace; }

  /// qkv16: (B*T, 3W) bf16, [Q | K | V] with the heads side by side; o16: (B*T, W) bf16 out; lse: (B, H, T) fp32 out.
  void forward(index_t B, index_t T, index_t H, index_t hd, const void* qkv16, void* o16, float* lse, void* workspace) {
    const auto& g = forward_graph(B, T, H, hd);
    const index_t W = H * hd;
    auto* base = static_cast<std::uint16_t*>(const_cast<void*>(qkv16));
    std::unordered_map<std::int64_t, void*> pack{{uid_q, base}, {uid_k, base + W}, {uid_v, base + 2 * W},
                                                 {uid_o, o16}, {uid_stats, lse}};
    run(g.graph->execute(handle_, pack, workspace), "the fused attention forward");
  }
  /// d(o16) (B*T, W) bf16 to d(qkv16) (B*T, 3W) bf16, from the forward's qkv16, o16 and lse.
  void backward(index_t B, index_t T, index_t H, index_t hd, const void* qkv16, const void* o16, const float* lse,
                const void* do16, void* dqkv16, void* workspace) {
    const auto& g = backward_graph(B, T, H, hd);
    const index_t W = H * hd;
    auto* base = static_cast<std::uint16_t*>(const_cast<void*>(qkv16));
    auto* dbase = static_cast<std::uint16_t*>(dqkv16);
    std::unordered_map<std::int64_t, void*> pack{
        {uid_q, base},          {uid_k, base + W},       {uid_v, base + 2 * W},
        {uid_o, const_cast<void*>(o16)}, {uid_stats, const_cast<float*>(lse)}, {uid_do, const_cast<void*>(do16)},
        {uid_dq, dbase},        {uid_dk, dbase + W},     {uid_dv, dbase + 2 * W}};
    run(g.graph->execute(handle_, pack, workspace), "the fused attention backward");
  }

 private:
  using graph_type = cudnn_frontend::graph::Graph;
  using tensor_ptr = std::shared_ptr<cudnn_frontend::graph::Tensor_attributes>;
  using dims = std::vector<std::int64_t>;
  enum : std::int64_t { uid_q = 1, uid_k, uid_v, uid_o, uid_stats, uid_do, uid_dq, uid_dk, uid_dv };
  struct built {
    std::shared_ptr<graph_type> graph;
    std::int64_t workspace = 0;
    std::string why;  // not empty: what cuDNN refused
  };
  using key = std::tuple<index_t, index_t, index_t, index_t>;

  static void check(cudnnStatus_t s, const char* what) {
    if (s != CUDNN_STATUS_SUCCESS)
      throw std::runtime_error(std::string("whale::cuda_backend: ") + what + " failed: " + cudnnGetErrorString(s));
  }
  static void run(cudnn_frontend::error_t e, const char* what) {
    if (e.is_bad()) throw std::runtime_error(std::string("whale::cuda_backend: ") + what + " failed in cuDNN: " + e.get_message());
  }
  // (B, H, T, hd) views of token-major rows: Q, K, V (and their gradients) in
  // rows of 3W, O and dO in rows of W; the statistics (B, H, T, 1) contiguous
  static dims shape(index_t B, index_t T, index_t H, index_t hd) { return {B, H, T, hd}; }
  static dims rows_of(index_t T, index_t hd, index_t width) { return {T * width, hd, width, 1}; }
  static tensor_ptr input(graph_type& g, const char* name, std::int64_t uid, const dims& d, const dims& s) {
    return g.tensor(cudnn_frontend::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(d).set_stride(s));
  }
  static std::shared_ptr<graph_type> new_graph() {
    auto g = std::make_shared<graph_type>();
    g->set_io_data_type(cudnn_frontend::DataType_t::BFLOAT16)
        .set_intermediate_data_type(cudnn_frontend::DataType_t::FLOAT)
        .set_compute_data_type(cudnn_frontend::DataType_t::FLOAT);
    return g;
  }
  // validated, lowered and planned by cuDNN's heuristics; the first refusal is kept in `why`
  void finish(built& b) {
    auto& g = *b.graph;
    auto step = [&](cudnn_frontend::error_t e, const char* what) {
      if (b.why.empty() && e.is_bad()) b.why = std::string(what) + ": " + e.get_message();
      return b.why.empty();
    };
    step(g.validate(), "validate") && step(g.build_operation_graph(handle_), "build_operation_graph") &&
        step(g.create_execution_plans({cudnn_frontend::HeurMode_t::A}), "create_execution_plans") &&
        step(g.check_support(handle_), "check_support") && step(g.build_plans(handle_), "build_plans") &&
        step(g.get_workspace_size(b.workspace), "get_workspace_size");
  }
  const built& forward_graph(index_t B, index_t T, index_t H, index_t hd) {
    auto [it, fresh] = fwd_.try_emplace(key{B, T, H, hd});
    built& b = it->second;
    if (!fresh) return b;
    b.graph = new_graph();
    auto& g = *b.graph;
    const index_t W = H * hd;
    const auto d = shape(B, T, H, hd), in = rows_of(T, hd, 3 * W);
    auto q = input(g, "Q", uid_q, d, in), k = input(g, "K", uid_k, d, in), v = input(g, "V", uid_v, d, in);
    auto opts = cudnn_frontend::graph::SDPA_attributes()
                    .set_name("whale_attention")
                    .set_generate_stats(true)
                    .set_causal_mask(true)
                    .set_attn_scale(1.f / std::sqrt(static_cast<float>(hd)));
    auto [o, stats] = g.sdpa(q, k, v, opts);
    o->set_output(true).set_uid(uid_o).set_dim(d).set_stride(rows_of(T, hd, W));
    stats->set_output(true).set_uid(uid_stats).set_data_type(cudnn_frontend::DataType_t::FLOAT)
        .set_dim({B, H, T, 1}).set_stride({H * T, T, 1, 1});
    finish(b);
    return b;
  }
  const built& backward_graph(index_t B, index_t T, index_t H, index_t hd) {
    auto [it, fresh] = bwd_.try_emplace(key{B, T, H, hd});
    built& b = it->second;
    if (!fresh) return b;
    b.graph = new_graph();
    auto& g = *b.graph;
    const index_t W = H * hd;
    const auto d = shape(B, T, H, hd), in = rows_of(T, hd, 3 * W), out = rows_of(T, hd, W);
    auto q = input(g, "Q", uid_q, d, in), k = input(g, "K", uid_k, d, in), v = input(g, "V", uid_v, d, in);
    auto o = input(g, "O", uid_o, d, out), dout = input(g, "dO", uid_do, d, out);
    auto stats = input(g, "stats", uid_stats, {B, H, T, 1}, {H * T, T, 1, 1});
    stats->set_data_type(cudnn_frontend::DataType_t::FLOAT);
    auto opts = cudnn_frontend::graph::SDPA_backward_attributes()
                    .set_name("whale_attention_backward")
                    .set_causal_mask(true)
                    .set_attn_scale(1.f / std::sqrt(static_cast<float>(hd)));
    auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, dout, stats, opts);
    dq->set_output(true).set_uid(uid_dq).set_dim(d).set_stride(in);
    dk->set_output(true).set_uid(uid_dk).set_dim(d).set_stride(in);
    dv->set_output(true).set_uid(uid_dv).set_dim(d).set_stride(in);
    finish(b);
    return b;
  }

  cudnnHandle_t handle_ = nullptr;
  std::map<key, built> fwd_, bwd_;
};

}  // namespace whale::detail

#endif
