// Where a non-finite gradient first appears: the first unit of the model (in
// the unsplit flat order) whose gradients hold a NaN or an Inf on any rank,
// found from the lowered program's holdings. Run by the trainer after a
// non-finite gradient norm, so it costs nothing in a healthy step.
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include "whale/plan/program.hpp"
#include "whale/runtime/executor.hpp"

namespace whale {

namespace detail {
/// The smallest unit index among this rank's holdings whose gradients in
/// [begin, end) of its local flat buffer (`g` holds that range) are not all
/// finite; max() if none.
inline std::int64_t first_nonfinite_unit(const program& prog, const float* g, index_t begin, index_t end) {
  std::int64_t first = std::numeric_limits<std::int64_t>::max();
  for (const auto& h : prog.holds) {
    const index_t b = std::max(begin, h.local_offset), e = std::min(end, h.local_offset + h.local_params);
    for (index_t i = b; i < e; ++i) {
      const float x = g[i - begin];
      if (x - x != 0.f) {
        first = std::min<std::int64_t>(first, h.unit);
        break;
      }
    }
  }
  return first;
}
}  // namespace detail

template <class P> std::string executor<P>::first_nonfinite_grad() const {
  std::vector<float> keep;  // on a device: the gradients' host copy
  std::int64_t u = level >= 2 ? detail::first_nonfinite_unit(prog_, be_.host_readable(cview<float>(zero_.shard_grads()), keep).data(),
                                                             zero_.begin(), zero_.end())
                              : detail::first_nonfinite_unit(
                                    prog_, be_.host_readable(cview<float>(grads_.data(), {param_count()}), keep).data(), 0,
                                    param_count());
  all_reduce(ctx_->world(), view<std::int64_t>(&u, {1}), reduce_op::min);
  if (u == std::numeric_limits<std::int64_t>::max()) return {};
  const auto d = describe<P>();
  index_t offset = 0;
  for (std::int64_t k = 0; k < u; ++k) offset += d.units[static_cast<std::size_t>(k)].full_params;
  const auto& unit = d.units[static_cast<std::size_t>(u)];
  return unit.name + " (unit " + std::to_string(u) + " of the model, its parameters [" + std::to_string(offset) + ", " +
         std::to_string(offset + unit.full_params) + ") of the unsplit flat order)";
}

}  // namespace whale
