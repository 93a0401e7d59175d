// `transformer_block<D, Heads, FFN>`: the pre-LN GPT decoder block,
// x + attn(LN(x)) then x + W2 gelu(W1 LN(x)). A thin named sequential of two
// residuals; no dropout, no post-LN or parallel-block variants.
#pragma once

#include <string>

#include "whale/nn/causal_self_attention.hpp"
#include "whale/nn/gelu.hpp"
#include "whale/nn/layer_norm.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/residual.hpp"
#include "whale/nn/sequential.hpp"

namespace whale {

/// Pre-LN decoder block on (B*T, D) rows:
///   residual<layer_norm<D>, causal_self_attention<D, Heads>>, then
///   residual<layer_norm<D>, linear<D, FFN>, gelu, linear<FFN, D>>.
/// Everything of sequential is inherited; `base` names that sequential.
template <index_t D, index_t Heads, index_t FFN>
struct transformer_block
    : sequential<residual<layer_norm<D>, causal_self_attention<D, Heads>>,
                 residual<layer_norm<D>, linear<D, FFN>, gelu, linear<FFN, D>>> {
  using base = sequential<residual<layer_norm<D>, causal_self_attention<D, Heads>>,
                          residual<layer_norm<D>, linear<D, FFN>, gelu, linear<FFN, D>>>;
  static std::string name() {
    return "transformer_block<" + std::to_string(D) + ", " + std::to_string(Heads) + ", " +
           std::to_string(FFN) + ">";
  }
};

}  // namespace whale
