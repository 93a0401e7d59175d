// `tied_head<Vocab, D>`: the language-model head that shares the token table
// (GPT-2's lm_head, tied to wte): logits = x E^T, with E the model's
// embedding<Vocab, D> table. The layer computes as linear<D, Vocab, no_bias>
// whose weight is a copy of E; the runtime keeps the copy equal to E (runtime/tie.hpp):
// at start-up the table is copied in, and after each step's backward both
// receive the sum of the two gradients, so both take the same update.
#pragma once

#include <string>

#include "whale/nn/linear.hpp"

namespace whale {

/// The LM head tied to the token table of the model's last embedding<Vocab, D>
/// before it. Input (rows, D), output (rows, Vocab) logits, no bias. Its
/// parameter is the table's copy (Vocab, D), row v the embedding of token v.
/// A model whose tied head has no embedding<Vocab, D> before it, or whose
/// table another head is tied to already, is refused when it is made. Counted as a layer with Vocab * D parameters: the copy is held
/// (on one rank as on the last pipeline stage, as Megatron-LM holds it there).
template <index_t Vocab, index_t D>
struct tied_head : linear<D, Vocab, no_bias> {
  /// The runtime ties this layer's weight to the token table (runtime/tie.hpp).
  static constexpr bool ties_token_table = true;
  static std::string name() { return "tied_head<" + std::to_string(Vocab) + ", " + std::to_string(D) + ">"; }
  static constexpr std::array<param_tensor, 1> param_tensors() {
    return {{{"weight", param_role::weight, Vocab * D, D, {Vocab, D}}}};
  }
  void bind(param_binder& b) {
    const index_t at = b.offset();
    linear<D, Vocab, no_bias>::bind(b);
    b.note_tied_head(at, Vocab, D);
  }
};

/// Whether L is a tied head (its weight is the token table's copy).
template <class L> inline constexpr bool ties_token_table = requires { requires L::ties_token_table; };

}  // namespace whale
