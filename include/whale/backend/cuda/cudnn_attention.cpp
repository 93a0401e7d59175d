// cuDNN's fused flash attention through the cuDNN frontend's graph API: the
// definitions behind backend/cuda/cudnn_attention.hpp. The one unit of a
// program that includes the frontend's headers; whale::cudnn adds it to the
// programs that link it, compiled by the host compiler (nvcc would parse the
// frontend once per GPU architecture it compiles for). Not part of the
// header-only library: an optional component, like whale::cudnn itself.
#include "whale/backend/cuda/cudnn_attention.hpp"

#include <cuda_runtime.h>

#include <cstring>  // before the frontend, whose shim uses std::strlen without it

#include <cudnn_frontend.h>

#include <cmath>
#include <map>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace whale::detail::cudnn {

namespace fe = cudnn_frontend;

struct engine {
  using graph_type = fe::graph::Graph;
  using tensor_ptr = std::shared_ptr<fe::graph::Tensor_attributes>;
  using dims = std::vector<std::int64_t>;
  enum : std::int64_t { uid_q = 1, uid_k, uid_v, uid_o, uid_stats, uid_do, uid_dq, uid_dk, uid_dv };
  struct built {
    std::shared_ptr<graph_type> graph;
    std::int64_t workspace = 0;
    std::string why;  // not empty: what cuDNN refused
  };
  using key = std::tuple<index_t, index_t, index_t, index_t>;

  explicit engine(cudaStream_t stream) {
    check(cudnnCreate(&handle), "cudnnCreate");
    if (cudnnSetStream(handle, stream) != CUDNN_STATUS_SUCCESS) {
      cudnnDestroy(handle);
      throw std::runtime_error("whale::cuda_backend: cudnnSetStream failed");
    }
  }
  ~engine() {
    forward_graphs.clear();
    backward_graphs.clear();
    cudnnDestroy(handle);
  }
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  static void check(cudnnStatus_t s, const char* what) {
    if (s != CUDNN_STATUS_SUCCESS)
      throw std::runtime_error(std::string("whale::cuda_backend: ") + what + " failed: " + cudnnGetErrorString(s));
  }
  static void run(fe::error_t e, const char* what) {
    if (e.is_bad()) throw std::runtime_error(std::string("whale::cuda_backend: ") + what + " failed in cuDNN: " + e.get_message());
  }
  // (B, H, T, hd) views of token-major rows: Q, K, V (and their gradients) in
  // rows of 3W, O and d(O) in rows of W; the statistics (B, H, T, 1) contiguous
  static dims shape(index_t B, index_t T, index_t H, index_t hd) { return {B, H, T, hd}; }
  static dims rows_of(index_t T, index_t hd, index_t width) { return {T * width, hd, width, 1}; }
  static tensor_ptr input(graph_type& g, const char* name, std::int64_t uid, const dims& d, const dims& s) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(d).set_stride(s));
  }
  static float scale(index_t hd) { return 1.f / std::sqrt(static_cast<float>(hd)); }

  /// The graph of `k` in `graphs`, described by `describe(graph)` and then
  /// validated, lowered and planned by cuDNN's heuristics on the first call;
  /// the first refusal is kept in `why`.
  template <class Describe> const built& lookup(std::map<key, built>& graphs, const key& k, Describe describe) {
    auto [it, fresh] = graphs.try_emplace(k);
    built& b = it->second;
    if (!fresh) return b;
    b.graph = std::make_shared<graph_type>();
    auto& g = *b.graph;
    g.set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    describe(g);
    auto step = [&](fe::error_t e, const char* what) {
      if (b.why.empty() && e.is_bad()) b.why = std::string(what) + ": " + e.get_message();
      return b.why.empty();
    };
    (void)(step(g.validate(), "validate") && step(g.build_operation_graph(handle), "build_operation_graph") &&
           step(g.create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans") &&
           step(g.check_support(handle), "check_support") && step(g.build_plans(handle), "build_plans") &&
           step(g.get_workspace_size(b.workspace), "get_workspace_size"));
    return b;
  }
  const built& forward_graph(index_t B, index_t T, index_t H, index_t hd) {
    return lookup(forward_graphs, key{B, T, H, hd}, [&](graph_type& g) {
      const index_t W = H * hd;
      const auto d = shape(B, T, H, hd), in = rows_of(T, hd, 3 * W);
      auto q = input(g, "Q", uid_q, d, in), k = input(g, "K", uid_k, d, in), v = input(g, "V", uid_v, d, in);
      auto opts = fe::graph::SDPA_attributes()
                      .set_name("whale_attention")
                      .set_generate_stats(true)
                      .set_causal_mask(true)
                      .set_attn_scale(scale(hd));
      auto [o, stats] = g.sdpa(q, k, v, opts);
      o->set_output(true).set_uid(uid_o).set_dim(d).set_stride(rows_of(T, hd, W));
      stats->set_output(true).set_uid(uid_stats).set_data_type(fe::DataType_t::FLOAT)
          .set_dim({B, H, T, 1}).set_stride({H * T, T, 1, 1});
    });
  }
  const built& backward_graph(index_t B, index_t T, index_t H, index_t hd) {
    return lookup(backward_graphs, key{B, T, H, hd}, [&](graph_type& g) {
      const index_t W = H * hd;
      const auto d = shape(B, T, H, hd), in = rows_of(T, hd, 3 * W), out = rows_of(T, hd, W);
      auto q = input(g, "Q", uid_q, d, in), k = input(g, "K", uid_k, d, in), v = input(g, "V", uid_v, d, in);
      auto o = input(g, "O", uid_o, d, out), dout = input(g, "dO", uid_do, d, out);
      auto stats = input(g, "stats", uid_stats, {B, H, T, 1}, {H * T, T, 1, 1});
      stats->set_data_type(fe::DataType_t::FLOAT);
      auto opts = fe::graph::SDPA_backward_attributes()
                      .set_name("whale_attention_backward")
                      .set_causal_mask(true)
                      .set_attn_scale(scale(hd));
      auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, dout, stats, opts);
      dq->set_output(true).set_uid(uid_dq).set_dim(d).set_stride(in);
      dk->set_output(true).set_uid(uid_dk).set_dim(d).set_stride(in);
      dv->set_output(true).set_uid(uid_dv).set_dim(d).set_stride(in);
    });
  }

  cudnnHandle_t handle = nullptr;
  std::map<key, built> forward_graphs, backward_graphs;
};

std::shared_ptr<engine> make_engine(void* stream) { return std::make_shared<engine>(static_cast<cudaStream_t>(stream)); }

bool supports(engine& e, index_t B, index_t T, index_t H, index_t hd, std::string& why) {
  const auto& f = e.forward_graph(B, T, H, hd);
  const auto& b = e.backward_graph(B, T, H, hd);
  why = !f.why.empty() ? f.why : b.why;
  return why.empty();
}
std::int64_t forward_workspace(engine& e, index_t B, index_t T, index_t H, index_t hd) {
  return e.forward_graph(B, T, H, hd).workspace;
}
std::int64_t backward_workspace(engine& e, index_t B, index_t T, index_t H, index_t hd) {
  return e.backward_graph(B, T, H, hd).workspace;
}

void forward(engine& e, index_t B, index_t T, index_t H, index_t hd, const void* qkv16, void* o16, float* lse,
             void* workspace) {
  const auto& g = e.forward_graph(B, T, H, hd);
  const index_t W = H * hd;
  auto* base = static_cast<std::uint16_t*>(const_cast<void*>(qkv16));
  std::unordered_map<std::int64_t, void*> pack{{engine::uid_q, base},      {engine::uid_k, base + W},
                                               {engine::uid_v, base + 2 * W}, {engine::uid_o, o16},
                                               {engine::uid_stats, lse}};
  engine::run(g.graph->execute(e.handle, pack, workspace), "the fused attention forward");
}

void backward(engine& e, index_t B, index_t T, index_t H, index_t hd, const void* qkv16, const void* o16,
              const float* lse, const void* do16, void* dqkv16, void* workspace) {
  const auto& g = e.backward_graph(B, T, H, hd);
  const index_t W = H * hd;
  auto* base = static_cast<std::uint16_t*>(const_cast<void*>(qkv16));
  auto* dbase = static_cast<std::uint16_t*>(dqkv16);
  std::unordered_map<std::int64_t, void*> pack{
      {engine::uid_q, base},       {engine::uid_k, base + W},  {engine::uid_v, base + 2 * W},
      {engine::uid_o, const_cast<void*>(o16)}, {engine::uid_stats, const_cast<float*>(lse)},
      {engine::uid_do, const_cast<void*>(do16)}, {engine::uid_dq, dbase}, {engine::uid_dk, dbase + W},
      {engine::uid_dv, dbase + 2 * W}};
  engine::run(g.graph->execute(e.handle, pack, workspace), "the fused attention backward");
}

}  // namespace whale::detail::cudnn
