// The entry points of cuDNN's fused flash attention for the CUDA backend
// (cuda_backend::fused_attention): bf16 Q, K, V and O with fp32 accumulation
// and fp32 softmax statistics, forward and backward, no T x T tensor. The
// statistics are the natural log-sum-exp of each query's scaled scores, the
// same lse the batched-GEMM steps keep, so either backward can follow either
// forward. Their definitions are in cudnn_attention.cpp, the one unit that
// includes the cuDNN frontend's headers: whale::cudnn compiles it once per
// program with the host compiler (an nvcc unit would parse those headers
// once per GPU architecture). Declared whatever the build, so that
// cuda_backend has one layout; called only where WHALE_HAS_CUDNN_FRONTEND.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "whale/fwd.hpp"

namespace whale::detail::cudnn {

/// One cuDNN handle on one stream and the graphs built for each shape (B, T,
/// H, hd) asked for, kept for its life.
struct engine;
/// An engine whose work goes to `stream` (a cudaStream_t).
std::shared_ptr<engine> make_engine(void* stream);
/// Whether cuDNN runs this shape forward and backward (plans built on the
/// first call for a shape); `why` says what it refused otherwise.
bool supports(engine& e, index_t B, index_t T, index_t H, index_t hd, std::string& why);
/// Workspace bytes the forward and the backward of a supported shape need.
std::int64_t forward_workspace(engine& e, index_t B, index_t T, index_t H, index_t hd);
std::int64_t backward_workspace(engine& e, index_t B, index_t T, index_t H, index_t hd);
/// qkv16: (B*T, 3W) bf16, [Q | K | V] with the heads side by side (W = H*hd);
/// o16: (B*T, W) bf16 out; lse: (B, H, T) fp32 out.
void forward(engine& e, index_t B, index_t T, index_t H, index_t hd, const void* qkv16, void* o16, float* lse,
             void* workspace);
/// d(o16) (B*T, W) bf16 to d(qkv16) (B*T, 3W) bf16, from the forward's qkv16, o16 and lse.
void backward(engine& e, index_t B, index_t T, index_t H, index_t hd, const void* qkv16, const void* o16,
              const float* lse, const void* do16, void* dqkv16, void* workspace);

}  // namespace whale::detail::cudnn
