// Declarations of whale's public names, for headers that only mention them.
// Definitions are in the headers listed in whale.hpp.
#pragma once

#include <cstddef>
#include <cstdint>

namespace whale {
using index_t = std::int64_t;

// tensor/
struct host;
struct cuda;
class shape;
template <class T, class Space> class view;
template <class T, class Space> class tensor;
struct seed;
class counter_rng;

// backend/
struct cpu_backend;
class cuda_backend;

// nn/
struct step_ctx;
struct cost_info;
class param_binder;
/// Whether a linear adds a bias: `linear<In, Out, no_bias>` has none (Llama's projections).
enum class bias_mode : bool { none = false, added = true };
inline constexpr bias_mode no_bias = bias_mode::none;
inline constexpr bias_mode with_bias = bias_mode::added;
template <index_t In, index_t Out, bias_mode Bias = with_bias> struct linear;
struct relu;
struct gelu;
template <index_t D> struct layer_norm;
template <index_t D, float Eps = 1e-6f> struct rms_norm;  // Eps: LlamaConfig's default
template <index_t Vocab, index_t D> struct embedding;
template <index_t MaxSeq, index_t D> struct position_embedding;
template <index_t D, index_t Heads> struct causal_self_attention;
template <index_t D, index_t Hidden> struct swiglu_mlp;
/// KVHeads: grouped-query attention's key/value heads; Theta: the RoPE base (LlamaConfig's rope_theta).
template <index_t D, index_t Heads, index_t KVHeads = Heads, float Theta = 10000.f> struct rotary_attention;
struct softmax_cross_entropy;
struct mse_loss;
struct l1_loss;
template <float Delta = 1.f> struct huber_loss;  // Delta: PyTorch HuberLoss's delta
template <class... L> class sequential;
template <class M> class network;

// optim/
struct sgd;
struct adamw;

// strategy/
template <class M> struct replicate;
template <class Sched, class... Parts> struct pipeline;
/// Which candidate families auto_plan<M, S> compiles in (strategy/auto_plan.hpp).
struct plan_space {
  bool recompute = true;  ///< every candidate again with M's repeated block recomputed in backward
};
template <class M, plan_space S> struct auto_plan;

// plan/ and runtime/
struct program;
struct plan_options;
template <class P> class executor;
template <class M, plan_space S> class auto_executor;
struct plan_choice;

// train/
enum class precision;
class teacher_data;
class markov_data;
struct steps;
}  // namespace whale
