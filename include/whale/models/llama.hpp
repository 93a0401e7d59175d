// `models::llama`: transformers' LlamaForCausalLM as a type of whale's layers:
// a token table, pre-norm decoder blocks of RMSNorm, rotary grouped-query
// attention and a SwiGLU MLP, a final RMSNorm and an untied LM head, no biases.
// Weights in and out in Hugging Face's names: train/hf_safetensors.hpp.
#pragma once

#include <cstddef>
#include <string>

#include "whale/nn/embedding.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/residual.hpp"
#include "whale/nn/rms_norm.hpp"
#include "whale/nn/rotary_attention.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/nn/swiglu_mlp.hpp"

namespace whale::models {

/// One Llama decoder layer (transformers' LlamaDecoderLayer) on (B*T, D) rows:
///   x + attention(RMSNorm(x)), then x + MLP(RMSNorm(x)).
template <index_t D, index_t Heads, index_t KVHeads, index_t Hidden, float Eps = 1e-6f, float Theta = 10000.f>
struct llama_block : sequential<residual<rms_norm<D, Eps>, rotary_attention<D, Heads, KVHeads, Theta>>,
                                residual<rms_norm<D, Eps>, swiglu_mlp<D, Hidden>>> {
  using base = sequential<residual<rms_norm<D, Eps>, rotary_attention<D, Heads, KVHeads, Theta>>,
                          residual<rms_norm<D, Eps>, swiglu_mlp<D, Hidden>>>;
  static std::string name() {
    return "llama_block<" + std::to_string(D) + ", " + std::to_string(Heads) + ", " + std::to_string(KVHeads) + ", " +
           std::to_string(Hidden) + ">";
  }
};

/// LlamaForCausalLM: embedding<Vocab, D>, repeat<Layers, llama_block<...>>,
/// rms_norm<D, Eps>, linear<D, Vocab, no_bias> (untied head), then the loss.
/// The defaults of Eps (rms_norm_eps) and Theta (rope_theta) are LlamaConfig's;
/// Llama 2 and 3 checkpoints say Eps = 1e-5f (Llama 3: Theta = 500000.f).
/// MaxSeq is the configuration's max_position_embeddings: rotary positions
/// have no table to outgrow, so, as in transformers, a longer sequence is not
/// refused. Rows are tokens: step_ctx::batch sequences of step_ctx::seq.
template <std::size_t Layers, index_t D, index_t Heads, index_t KVHeads, index_t Hidden, index_t Vocab, index_t MaxSeq,
          float Eps = 1e-6f, float Theta = 10000.f>
struct llama : sequential<embedding<Vocab, D>, repeat<Layers, llama_block<D, Heads, KVHeads, Hidden, Eps, Theta>>,
                          rms_norm<D, Eps>, linear<D, Vocab, no_bias>, softmax_cross_entropy> {
  using base = sequential<embedding<Vocab, D>, repeat<Layers, llama_block<D, Heads, KVHeads, Hidden, Eps, Theta>>,
                          rms_norm<D, Eps>, linear<D, Vocab, no_bias>, softmax_cross_entropy>;
  static constexpr std::size_t layers = Layers;
  static constexpr index_t width = D, heads = Heads, kv_heads = KVHeads, hidden = Hidden, vocab = Vocab, max_seq = MaxSeq;
  static constexpr float eps = Eps, theta = Theta;
  /// Parameters counted in model FLOPs (6 x these per token): all but the token table.
  static constexpr index_t non_embedding_params = base::cost().params - embedding<Vocab, D>::param_count();

  static std::string name() {
    return "llama<" + std::to_string(Layers) + ", " + std::to_string(D) + ", " + std::to_string(Heads) + ", " +
           std::to_string(KVHeads) + ", " + std::to_string(Hidden) + ", " + std::to_string(Vocab) + ", " +
           std::to_string(MaxSeq) + ">";
  }
};

/// The small Llama of the reference checks (tests/reference/llama-tiny): 2
/// layers, width 64, 4 query heads sharing 2 key/value heads, MLP 176,
/// vocabulary 256 (bytes), 32 positions.
using llama_tiny = llama<2, 64, 4, 2, 176, 256, 32>;

}  // namespace whale::models
