// The one gradient synchroniser: buckets of a flat gradient buffer summed
// over the data axis (all-reduce), launched as backward makes each bucket
// final — blocking, or non-blocking and waited for at the end. The buckets
// are cut by plan/partition.hpp's bucket_ranges, the function the lowering
// uses, so what runs is what the program says. No model knowledge here.
#pragma once

#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"

namespace whale::detail {

class grad_sync {
 public:
  /// `buckets`: local ranges [begin, end) in launch order (last layer first);
  /// `blocking`: each bucket in one blocking all-reduce as soon as it is ready.
  void plan(std::vector<std::pair<index_t, index_t>> buckets, bool blocking) {
    blocking_ = blocking;
    buckets_.clear();
    for (auto [b, e] : buckets) buckets_.push_back({b, e, {}});
  }
  std::size_t size() const noexcept { return buckets_.size(); }
  const auto& ranges() const noexcept { return buckets_; }

  void start_step() noexcept { next_ = 0; }
  /// Every gradient at local index >= offset is final: launch the buckets it completes.
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
    ready(c, grads, std::numeric_limits<index_t>::min());
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

}  // namespace whale::detail
