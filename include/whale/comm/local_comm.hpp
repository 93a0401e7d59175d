// local_comm: a world of one rank, implementing Communicator without MPI.
// Every collective is a copy or a no-op; sends to self are buffered. Single-
// process code paths (and builds without whale::mpi) use it. No MPI here.
#pragma once

#include <cstring>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/comm/communicator.hpp"

namespace whale {

class local_comm {
  struct message {
    int tag;
    std::vector<unsigned char> bytes;
  };
  struct pending_recv {
    void* buf;
    std::size_t bytes;
    int tag;
    std::shared_ptr<bool> done;
  };
  struct mailbox {
    std::deque<message> sent;       // sends not yet received
    std::deque<pending_recv> recvs;  // receives not yet matched
  };

 public:
  using space = host;

  /// Completes at once, except a receive that waits for a later send to self.
  class request {
   public:
    request() = default;
    bool test() { return !done_ || *done_; }
    void wait() {
      if (!test())
        throw std::logic_error(
            "whale::local_comm: recv (tag " + std::to_string(tag_) +
            ") waits for a send to self that was never posted; with one rank it would never complete");
    }

   private:
    friend class local_comm;
    request(std::shared_ptr<bool> done, int tag) : done_(std::move(done)), tag_(tag) {}
    std::shared_ptr<bool> done_;
    int tag_ = 0;
  };

  explicit local_comm(std::string name = "world") : name_(std::move(name)) {}

  int rank() const noexcept { return 0; }
  int size() const noexcept { return 1; }
  const std::string& name() const noexcept { return name_; }
  comm_stats stats() const noexcept { return stats_; }
  void reset_stats() noexcept { stats_ = {}; }

  request iall_reduce(void*, index_t, dtype, reduce_op) { return done(); }
  request iall_gather(const void* in, void* out, index_t n, dtype t) { return copy(in, out, n, t); }
  request iall_gather_v(const void* in, void* out, std::span<const index_t> counts, dtype t) {
    return copy(in, out, counts.empty() ? 0 : counts[0], t);
  }
  request ireduce_scatter(const void* in, void* out, index_t n, dtype t, reduce_op) {
    return copy(in, out, n, t);
  }
  request ireduce_scatter_v(const void* in, void* out, std::span<const index_t> counts, dtype t,
                            reduce_op) {
    return copy(in, out, counts.empty() ? 0 : counts[0], t);
  }
  request ibroadcast(void*, index_t, dtype, int root) {
    check_peer("broadcast", root);
    return done();
  }
  request ibarrier() { return done(); }

  request isend(const void* buf, index_t n, dtype t, int dst, int tag) {
    check_peer("send", dst);
    ++stats_.operations;
    const auto bytes = static_cast<std::size_t>(n) * size_of(t);
    for (auto it = box_->recvs.begin(); it != box_->recvs.end(); ++it)
      if (it->tag == tag) {
        deliver("send", *it, buf, bytes);
        box_->recvs.erase(it);
        return {};
      }
    const auto* p = static_cast<const unsigned char*>(buf);
    box_->sent.push_back({tag, std::vector<unsigned char>(p, p + bytes)});
    return {};
  }
  request irecv(void* buf, index_t n, dtype t, int src, int tag) {
    check_peer("recv", src);
    ++stats_.operations;
    pending_recv r{buf, static_cast<std::size_t>(n) * size_of(t), tag, std::make_shared<bool>(false)};
    for (auto it = box_->sent.begin(); it != box_->sent.end(); ++it)
      if (it->tag == tag) {
        deliver("recv", r, it->bytes.data(), it->bytes.size());
        box_->sent.erase(it);
        return {r.done, tag};
      }
    box_->recvs.push_back(r);
    return {r.done, tag};
  }

  /// Collective in name only: any color gives another world of one rank.
  local_comm split(int color, int /*key*/ = 0) const {
    return local_comm(name_ + "/" + std::to_string(color));
  }
  local_comm split(int color, int key, std::string name) const {
    (void)color;
    (void)key;
    return local_comm(std::move(name));
  }

 private:
  request done() {
    ++stats_.operations;
    return {};
  }
  request copy(const void* in, void* out, index_t n, dtype t) {
    if (n && in != out) std::memmove(out, in, static_cast<std::size_t>(n) * size_of(t));
    return done();
  }
  void check_peer(const char* op, int peer) const {
    if (peer != 0)
      throw std::invalid_argument(std::string("whale::local_comm::") + op + ": rank " +
                                  std::to_string(peer) + " does not exist in a world of one rank");
  }
  static void deliver(const char* op, pending_recv& r, const void* src, std::size_t bytes) {
    if (bytes > r.bytes)
      throw std::length_error(std::string("whale::local_comm::") + op + ": a message of " +
                              std::to_string(bytes) + " bytes does not fit the receive buffer of " +
                              std::to_string(r.bytes) + " bytes (tag " + std::to_string(r.tag) + ")");
    if (bytes) std::memcpy(r.buf, src, bytes);
    *r.done = true;
  }

  std::string name_;
  comm_stats stats_{};
  std::shared_ptr<mailbox> box_ = std::make_shared<mailbox>();
};

static_assert(Communicator<local_comm>);

}  // namespace whale
