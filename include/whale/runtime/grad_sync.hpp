// The one gradient synchroniser: buckets of a flat gradient buffer summed
// over the data axis (all-reduce), each launched when the program says (after
// the backward its all-reduce depends on) — blocking, or non-blocking and
// waited for at the end; in fp32, or
// packed to bf16 (half the bytes, each partial sum rounded to bf16) and
// unpacked when summed. Gradients in a device's memory (a backend_ref that is
// not the CPU) are summed there by the device's own communicator when the
// plan has one (NCCL on a GPU), else copied to a host buffer for the sum and
// back after it. The buckets and their launch points are the step's program's
// (program::grad_buckets, program::bucket_launches), so what runs is what the
// program says. No model knowledge here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/cpu/launch.hpp"
#include "whale/backend/kernels/elementwise.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/comm/device_comm.hpp"
#include "whale/plan/program.hpp"

namespace whale::detail {

class grad_sync {
 public:
  /// `buckets`: local ranges [begin, end) in launch order (last layer first);
  /// `launch_at`: per bucket, the local offset from which the gradients must be
  /// final before it is launched (program::bucket_launches; program::after_backward:
  /// at finish); `blocking`: each bucket in one blocking all-reduce when launched;
  /// `in_bf16`: buckets travel and are summed in bf16 (a staging buffer of 2
  /// bytes per gradient they cover, allocated here, once); `be`: where the
  /// gradients are; `dev`: on a device, the communicator that takes them (null: host copies).
  void plan(std::vector<std::pair<index_t, index_t>> buckets, const std::vector<index_t>& launch_at, bool blocking,
            bool in_bf16 = false, const backend_ref& be = {}, device_comm* dev = nullptr) {
    if (launch_at.size() != buckets.size())
      throw std::logic_error("whale: " + std::to_string(buckets.size()) + " gradient bucket(s) but " +
                             std::to_string(launch_at.size()) + " launch point(s)");
    blocking_ = blocking;
    bf16_ = in_bf16;
    be_ = be;
    dev_ = be.on_cpu() ? nullptr : dev;
    if (in_bf16 && !be.on_cpu() && !dev_)
      throw std::invalid_argument(std::string("whale: summing gradients in bf16 (bf16_reduce) on a device (") + be.name() +
                                  ") needs the device's own communicator (device_collectives; NCCL needs a build with MPI)");
    buckets_.clear();
    index_t at = 0;  // bf16: each bucket's place in the staging buffer (buckets back to back)
    during_ = false;
    for (std::size_t k = 0; k < buckets.size(); ++k) {
      const auto [b, e] = buckets[k];
      buckets_.push_back({b, e, launch_at[k], at, {}});
      during_ = during_ || launch_at[k] != program::after_backward;
      at += e - b;
    }
    {
      const place_scope on(be.memory());  // beside the gradients (on a device, packed and summed there)
      staging_ = in_bf16 ? tensor<whale::bf16>({at}, mem_kind::comm) : tensor<whale::bf16>{};
    }
    index_t top = 0;
    for (const auto& b : buckets_) top = std::max(top, b.end);
    const place_scope host(nullptr);
    host_ = be_.on_cpu() || dev_ ? tensor<float>{} : tensor<float>({top}, mem_kind::comm);
  }
  std::size_t size() const noexcept { return buckets_.size(); }
  /// Whether any bucket is launched during backward (else all at finish).
  bool during_backward() const noexcept { return during_; }
  const auto& ranges() const noexcept { return buckets_; }

  void start_step() noexcept { next_ = 0; }
  /// Every gradient at local index >= offset is final: launch, in order, the
  /// buckets the program launches by then.
  void ready(world_comm& c, float* grads, index_t offset) {
    while (next_ < buckets_.size() && buckets_[next_].launch_at >= offset) {
      auto& b = buckets_[next_++];
      const index_t n = b.end - b.begin;
      if (bf16_) {  // packed where the gradients are; on a device, summed there by its communicator
        const view<whale::bf16> packed(staging_.data() + b.at, {n});
        be_.launch(n, kernels::pack_bf16{grads + b.begin, bits(packed.data())});
        if (blocking_) {
          if (dev_) all_reduce(*dev_, packed);
          else all_reduce(c, packed);
          be_.launch(n, kernels::unpack_bf16{bits(packed.data()), grads + b.begin});
        } else if (dev_) {
          b.dreq = dev_->iall_reduce(packed.data(), n, dtype::bf16, reduce_op::sum);
        } else {
          b.req.emplace(c.iall_reduce(packed.data(), n, dtype::bf16, reduce_op::sum));
        }
      } else if (dev_) {  // the device's communicator sums the gradients where they are
        if (blocking_) all_reduce(*dev_, view<float>(grads + b.begin, {n}));
        else b.dreq = dev_->iall_reduce(grads + b.begin, n, dtype::f32, reduce_op::sum);
      } else {
        float* sum = grads + b.begin;  // where the bucket is summed: the gradients, or their host copy
        if (!be_.on_cpu()) {
          sum = host_.data() + b.begin;
          be_.copy(sum, grads + b.begin, static_cast<std::size_t>(n) * sizeof(float));
          be_.synchronize();
        }
        if (blocking_) {
          all_reduce(c, view<float>(sum, {n}));
          if (!be_.on_cpu()) be_.copy(grads + b.begin, sum, static_cast<std::size_t>(n) * sizeof(float));
        } else {
          b.req.emplace(c.iall_reduce(sum, n, dtype::f32, reduce_op::sum));
        }
      }
    }
    for (std::size_t i = 0; i < next_; ++i) {  // drive progress
      if (buckets_[i].req) buckets_[i].req->test();
      buckets_[i].dreq.test();
    }
  }
  /// Launch what is left and wait for all.
  void finish(world_comm& c, float* grads) {
    ready(c, grads, std::numeric_limits<index_t>::min());
    for (std::size_t i = 0; i < next_; ++i) {
      auto& b = buckets_[i];
      b.dreq.join();  // the device's queue waits for the sum, the host does not
      if (b.req) {
        b.req->wait(), b.req.reset();
        if (!bf16_ && !be_.on_cpu())
          be_.copy(grads + b.begin, host_.data() + b.begin, static_cast<std::size_t>(b.end - b.begin) * sizeof(float));
      }
      if (bf16_ && !blocking_)  // widened where the gradients are (a blocking bucket was, when it was summed)
        be_.launch(b.end - b.begin, kernels::unpack_bf16{bits(staging_.data() + b.at), grads + b.begin});
    }
  }
  bool in_bf16() const noexcept { return bf16_; }

 private:
  static std::uint16_t* bits(whale::bf16* p) noexcept { return reinterpret_cast<std::uint16_t*>(p); }
  struct bucket {
    index_t begin = 0, end = 0;
    index_t launch_at = 0;  // launched once the gradients from here on are final (program::bucket_launches)
    index_t at = 0;  // bf16: offset of its packed copy in staging_
    std::optional<world_comm::request> req;
    device_comm::request dreq{};  // summed by the device's communicator
  };
  std::vector<bucket> buckets_;
  std::size_t next_ = 0;
  bool blocking_ = true, bf16_ = false, during_ = false;
  tensor<whale::bf16> staging_;  // bf16: the packed buckets, back to back
  backend_ref be_;               // where the gradients are
  device_comm* dev_ = nullptr;   // on a device: the communicator that takes them (null: host_)
  tensor<float> host_;           // on a device without one: the buckets' host copies, at their own offsets
};

}  // namespace whale::detail
