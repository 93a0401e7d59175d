// The collectives of the class-split loss (split_softmax_cross_entropy,
// strategy/split_layers.hpp), in the order its forward issues them: one list,
// read by the layer that issues them and by lowering (plan/lower_pass.hpp),
// which records them in the program.
#pragma once

#include <array>

#include "whale/comm/communicator.hpp"
#include "whale/fwd.hpp"

namespace whale::detail {

/// One all-reduce over the loss's split axis: `floats_per_row` floats of each
/// of the pass's rows, combined with `op`.
struct split_loss_collective {
  reduce_op op;
  index_t floats_per_row;
  const char* what;
};

/// The row maxima first (a stable softmax), then the rows' sums of
/// exponentials with their target logits (each taken by the rank holding the class).
inline constexpr split_loss_collective split_loss_maxima{reduce_op::max, 1, "row maxima of the class-split loss"};
inline constexpr split_loss_collective split_loss_sums{reduce_op::sum, 2, "row sums and target logits of the class-split loss"};
inline constexpr std::array<split_loss_collective, 2> split_loss_collectives{split_loss_maxima, split_loss_sums};

}  // namespace whale::detail
