// `models::gpt2`: transformers' GPT2LMHeadModel as a type of whale's layers:
// token and learned position tables, pre-LN blocks (LayerNorm eps 1e-5,
// attention and MLP with biases, GELU in its tanh form), a final LayerNorm and
// the LM head tied to the token table. Weights in and out in Hugging Face's
// names (Conv1D weights transposed): train/hf_safetensors.hpp.
#pragma once

#include <cstddef>
#include <string>

#include "whale/nn/embedding.hpp"
#include "whale/nn/layer_norm.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/nn/tied_head.hpp"
#include "whale/nn/transformer_block.hpp"

namespace whale::models {

/// GPT2LMHeadModel: embedding<Vocab, D>, position_embedding<MaxSeq, D>,
/// repeat<Layers, transformer_block<D, Heads, 4 D>>, layer_norm<D>,
/// tied_head<Vocab, D> (the LM head is the token table), then the loss.
/// Rows are tokens: step_ctx::batch sequences of step_ctx::seq <= MaxSeq.
/// The tied head holds a copy of the table that the runtime keeps equal to it
/// (nn/tied_head.hpp), so a rank holding both holds Vocab * D parameters more
/// than transformers' one tensor.
template <std::size_t Layers, index_t D, index_t Heads, index_t Vocab, index_t MaxSeq>
struct gpt2 : sequential<embedding<Vocab, D>, position_embedding<MaxSeq, D>,
                         repeat<Layers, transformer_block<D, Heads, 4 * D>>, layer_norm<D>, tied_head<Vocab, D>,
                         softmax_cross_entropy> {
  using base = sequential<embedding<Vocab, D>, position_embedding<MaxSeq, D>,
                          repeat<Layers, transformer_block<D, Heads, 4 * D>>, layer_norm<D>, tied_head<Vocab, D>,
                          softmax_cross_entropy>;
  static constexpr std::size_t layers = Layers;
  static constexpr index_t width = D, heads = Heads, vocab = Vocab, max_seq = MaxSeq;
  /// transformers' parameter count (the table once): 124,439,808 for gpt2_124m at vocabulary 50,257.
  static constexpr index_t hf_params = base::cost().params - tied_head<Vocab, D>::param_count();
  /// Parameters counted in model FLOPs (6 x these per token): all but the two tables
  /// (the lookups; the head's product is counted, through its copy).
  static constexpr index_t non_embedding_params =
      base::cost().params - embedding<Vocab, D>::param_count() - position_embedding<MaxSeq, D>::param_count();

  static std::string name() {
    return "gpt2<" + std::to_string(Layers) + ", " + std::to_string(D) + ", " + std::to_string(Heads) + ", " +
           std::to_string(Vocab) + ", " + std::to_string(MaxSeq) + ">";
  }
};

/// GPT-2 124M (the "gpt2" checkpoint): 12 layers, width 768, 12 heads,
/// vocabulary 50,257, 1,024 positions.
using gpt2_124m = gpt2<12, 768, 12, 50257, 1024>;
/// The small GPT-2 of the reference checks (tests/reference/gpt2-tiny): 2
/// layers, width 64, 4 heads, vocabulary 256 (bytes), 32 positions.
using gpt2_tiny = gpt2<2, 64, 4, 256, 32>;

}  // namespace whale::models
