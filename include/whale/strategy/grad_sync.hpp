// Bucketed, non-blocking gradient all-reduce over given ranges of a flat
// gradient buffer, launched as backward makes each bucket final. Shared by
// the plans that sum gradients over the data axis. No model knowledge here.
#pragma once

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"

namespace whale::detail {

class grad_buckets {
 public:
  /// Buckets of at most `bucket_elems` over `ranges` (sorted, disjoint), from
  /// the end of the buffer (last layer first) to its start. `blocking`: each
  /// bucket in one blocking all-reduce as soon as it is ready; else a
  /// non-blocking one, waited for in finish().
  void plan(const std::vector<std::pair<index_t, index_t>>& ranges, index_t bucket_elems, bool blocking) {
    blocking_ = blocking;
    buckets_.clear();
    for (auto it = ranges.rbegin(); it != ranges.rend(); ++it)
      for (index_t end = it->second; end > it->first; end -= bucket_elems)
        buckets_.push_back({std::max(it->first, end - bucket_elems), end, {}});
  }
  std::size_t size() const noexcept { return buckets_.size(); }

  void start_step() noexcept { next_ = 0; }
  /// Every gradient at flat index >= offset is final: launch the buckets it completes.
  void ready(world_comm& c, float* grads, index_t offset) {
    while (next_ < buckets_.size() && buckets_[next_].begin >= offset) {
      auto& b = buckets_[next_++];
      if (blocking_) all_reduce(c, view<float>(grads + b.begin, {b.end - b.begin}));
      else b.req.emplace(c.iall_reduce(grads + b.begin, b.end - b.begin, dtype::f32, reduce_op::sum));
    }
    for (std::size_t i = 0; i < next_; ++i)
      if (buckets_[i].req) buckets_[i].req->test();  // drive progress
  }
  /// Launch what is left and wait for all.
  void finish(world_comm& c, float* grads) {
    ready(c, grads, 0);
    for (std::size_t i = 0; i < next_; ++i)
      if (buckets_[i].req) buckets_[i].req->wait(), buckets_[i].req.reset();
  }

 private:
  struct bucket {
    index_t begin = 0, end = 0;
    std::optional<world_comm::request> req;
  };
  std::vector<bucket> buckets_;
  std::size_t next_ = 0;
  bool blocking_ = true;
};

/// [0, n) minus `holes` (unsorted, possibly overlapping): sorted disjoint ranges.
inline std::vector<std::pair<index_t, index_t>> complement(std::vector<std::pair<index_t, index_t>> holes, index_t n) {
  std::sort(holes.begin(), holes.end());
  std::vector<std::pair<index_t, index_t>> r;
  index_t at = 0;
  for (const auto& [b, e] : holes) {
    if (b > at) r.push_back({at, b});
    at = std::max(at, e);
  }
  if (at < n) r.push_back({at, n});
  return r;
}

}  // namespace whale::detail
