// The `gpt` reference workload (shared/workloads.md): a GPT decoder with token
// and learned position embeddings, pre-LN blocks, final LayerNorm and an untied
// LM head, on Markov-chain tokens. Types and data only; plans are the user's.
#pragma once

#include <cstddef>
#include <string>

#include "whale/nn/embedding.hpp"
#include "whale/nn/layer_norm.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/nn/transformer_block.hpp"
#include "whale/train/data.hpp"

namespace whale::models {

/// A GPT of `Layers` pre-LN blocks of width D on (B, T) tokens, T <= MaxSeq:
///   embedding<Vocab, D>, position_embedding<MaxSeq, D>,
///   repeat<Layers, transformer_block<D, Heads, FFN>>, layer_norm<D>,
///   linear<D, Vocab> (untied head), softmax_cross_entropy.
/// Rows are tokens: set step_ctx::batch (sequences) and step_ctx::seq (T).
template <index_t Vocab, index_t MaxSeq, index_t D, index_t Heads, index_t FFN, std::size_t Layers>
struct gpt_model
    : sequential<embedding<Vocab, D>, position_embedding<MaxSeq, D>,
                 repeat<Layers, transformer_block<D, Heads, FFN>>, layer_norm<D>,
                 linear<D, Vocab>, softmax_cross_entropy> {
  using base = sequential<embedding<Vocab, D>, position_embedding<MaxSeq, D>,
                          repeat<Layers, transformer_block<D, Heads, FFN>>, layer_norm<D>,
                          linear<D, Vocab>, softmax_cross_entropy>;
  static constexpr index_t vocab = Vocab;
  static constexpr index_t max_seq = MaxSeq;
  static constexpr index_t width = D;
  static constexpr index_t heads = Heads;
  static constexpr index_t ffn = FFN;
  static constexpr std::size_t layers = Layers;
  /// Parameters of the token and position tables (lookups, not GEMMs).
  static constexpr index_t embedding_params =
      embedding<Vocab, D>::param_count() + position_embedding<MaxSeq, D>::param_count();
  /// Parameters counted in model FLOPs (6 x these per token): all but the embeddings.
  static constexpr index_t non_embedding_params = base::cost().params - embedding_params;

  static std::string name() {
    return "gpt_model<" + std::to_string(Vocab) + ", " + std::to_string(MaxSeq) + ", " +
           std::to_string(D) + ", " + std::to_string(Heads) + ", " + std::to_string(FFN) + ", " +
           std::to_string(Layers) + ">";
  }
};

/// The reference `gpt`: vocabulary 8192, 128 positions, width 256, 4 heads,
/// FFN 1024, 4 blocks: 7,394,816 parameters, 5,264,896 without the embeddings.
using gpt = gpt_model<8192, 128, 256, 4, 1024, 4>;
inline constexpr index_t gpt_global_batch = 16;  // sequences
inline constexpr index_t gpt_seq = 128;          // tokens per sequence

/// Markov-chain tokens for `gpt` (8 successors per token; loss floor ln 8).
inline markov_data gpt_data(seed s = seed{7}, index_t global_batch = gpt_global_batch) {
  return markov_data(s, gpt::vocab, gpt_seq, global_batch);
}

}  // namespace whale::models
