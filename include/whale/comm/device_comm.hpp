// `device_comm`: a communicator whose buffers are in a device backend's
// memory, chosen at run time like the backend itself: NCCL on a GPU (where
// the program is built with whale::cuda), and on the guarded backend, MPI
// with the backend's memory opened to the process while an operation is in
// flight (the test stand-in for a GPU's own communicator: the collectives
// read and write the device buffers themselves, no host copy). Type-erased:
// one runtime source serves both. make_device_comm() picks one for a backend.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "whale/backend/backend_ref.hpp"
#include "whale/comm/communicator.hpp"
#if defined(WHALE_HAS_CUDA) && defined(WHALE_HAS_MPI)
#include "whale/comm/nccl_comm.hpp"
#endif

namespace whale {

class device_comm {
 public:
  /// Buffers are placed at run time (a place_scope on the backend), so views
  /// over them keep the host type: the typed collectives take them as they are.
  using space = whale::host;

  /// A pending operation; a default one is complete. Completing it (test() true,
  /// wait(), or destruction, which waits unless an exception is unwinding) closes
  /// what the operation held open.
  class request {
   public:
    request() = default;
    bool test() {
      if (!impl_) return true;
      if (!impl_->test()) return false;
      impl_.reset();
      return true;
    }
    void wait() {
      if (!impl_) return;
      impl_->wait();
      impl_.reset();
    }
    /// The backend's queue waits for the operation, the host does not: on a
    /// GPU its compute stream waits for the operation's event, so the kernels
    /// queued after this call follow it; on a host-executed backend (where
    /// the host is the device) the operation completes here. Not a host wait
    /// (host_waits() does not count it). The request is complete afterwards.
    void join() {
      if (!impl_) return;
      impl_->join();
      impl_.reset();
    }

   private:
    friend class device_comm;
    struct base {
      virtual ~base() = default;
      virtual bool test() = 0;
      virtual void wait() = 0;
      virtual void join() = 0;
    };
    std::unique_ptr<base> impl_;
  };

  device_comm() = default;
  /// `c` takes buffers in `be`'s memory: NCCL's on a GPU; on a host-executed
  /// backend any host communicator, run with the backend's memory open from
  /// an operation's start to its completion.
  template <Communicator C>
  device_comm(C c, const backend_ref& be) : m_(std::make_unique<model<C>>(std::move(c), be)) {}

  bool valid() const noexcept { return m_ != nullptr; }
  /// Called while this communicator's operations are waited for, where the
  /// communicator can (NCCL): the progress of another one whose messages move
  /// only inside its calls (MPI's pipeline sends), so that a rank blocked here
  /// does not hold up a peer waiting for those. Must outlive the waits.
  void set_progress(std::function<void()> poll) { self().poll = std::move(poll); }
  int rank() const { return self().rank(); }
  int size() const { return self().size(); }
  std::string name() const { return self().name(); }
  comm_stats stats() const { return self().stats(); }
  void reset_stats() { self().reset_stats(); }
  /// How often the host has waited for this communicator's operations: each
  /// request's wait() (on a GPU, a spin on an event of the NCCL stream).
  /// join() and the blocking forms are not counted: on a GPU the device's
  /// queue waits for those, not the host. Split communicators count their own.
  std::int64_t host_waits() const { return self().waits; }

  request iall_reduce(void* buf, index_t n, dtype t, reduce_op op) { return self().iall_reduce(buf, n, t, op); }
  request iall_gather(const void* in, void* out, index_t n, dtype t) { return self().iall_gather(in, out, n, t); }
  request iall_gather_v(const void* in, void* out, std::span<const index_t> counts, dtype t) {
    return self().iall_gather_v(in, out, counts, t);
  }
  request ireduce_scatter(const void* in, void* out, index_t n, dtype t, reduce_op op) {
    return self().ireduce_scatter(in, out, n, t, op);
  }
  request ireduce_scatter_v(const void* in, void* out, std::span<const index_t> counts, dtype t, reduce_op op) {
    return self().ireduce_scatter_v(in, out, counts, t, op);
  }
  request ibroadcast(void* buf, index_t n, dtype t, int root) { return self().ibroadcast(buf, n, t, root); }
  request isend(const void* buf, index_t n, dtype t, int dst, int tag) { return self().isend(buf, n, t, dst, tag); }
  request irecv(void* buf, index_t n, dtype t, int src, int tag) { return self().irecv(buf, n, t, src, tag); }
  request ibarrier() { return self().ibarrier(); }
  // Blocking forms: the communicator's own blocking call where it has one (an
  // MPI library may sum in another order in its non-blocking algorithms, so a
  // blocking collective must stay blocking to give the host path's bits); else
  // (NCCL) the non-blocking one, joined: the device's queue waits for it, the host does not.
  void all_reduce(void* buf, index_t n, dtype t, reduce_op op) { self().all_reduce(buf, n, t, op); }
  void all_gather(const void* in, void* out, index_t n, dtype t) { self().all_gather(in, out, n, t); }
  void all_gather_v(const void* in, void* out, std::span<const index_t> counts, dtype t) {
    self().all_gather_v(in, out, counts, t);
  }
  void reduce_scatter(const void* in, void* out, index_t n, dtype t, reduce_op op) {
    self().reduce_scatter(in, out, n, t, op);
  }
  void reduce_scatter_v(const void* in, void* out, std::span<const index_t> counts, dtype t, reduce_op op) {
    self().reduce_scatter_v(in, out, counts, t, op);
  }
  void broadcast(void* buf, index_t n, dtype t, int root) { self().broadcast(buf, n, t, root); }
  /// Collective: the ranks of equal color, ordered by key, over the same backend.
  device_comm split(int color, int key = 0) {
    device_comm d;
    d.m_ = self().split(color, key);
    return d;
  }

 private:
  struct concept_t {
    std::function<void()> poll;  // set_progress
    std::int64_t waits = 0;      // host_waits()
    virtual ~concept_t() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual std::string name() const = 0;
    virtual comm_stats stats() const = 0;
    virtual void reset_stats() = 0;
    virtual request iall_reduce(void*, index_t, dtype, reduce_op) = 0;
    virtual request iall_gather(const void*, void*, index_t, dtype) = 0;
    virtual request iall_gather_v(const void*, void*, std::span<const index_t>, dtype) = 0;
    virtual request ireduce_scatter(const void*, void*, index_t, dtype, reduce_op) = 0;
    virtual request ireduce_scatter_v(const void*, void*, std::span<const index_t>, dtype, reduce_op) = 0;
    virtual request ibroadcast(void*, index_t, dtype, int) = 0;
    virtual request isend(const void*, index_t, dtype, int, int) = 0;
    virtual request irecv(void*, index_t, dtype, int, int) = 0;
    virtual request ibarrier() = 0;
    virtual void all_reduce(void*, index_t, dtype, reduce_op) = 0;
    virtual void all_gather(const void*, void*, index_t, dtype) = 0;
    virtual void all_gather_v(const void*, void*, std::span<const index_t>, dtype) = 0;
    virtual void reduce_scatter(const void*, void*, index_t, dtype, reduce_op) = 0;
    virtual void reduce_scatter_v(const void*, void*, std::span<const index_t>, dtype, reduce_op) = 0;
    virtual void broadcast(void*, index_t, dtype, int) = 0;
    virtual std::unique_ptr<concept_t> split(int, int) = 0;
  };

  // The backend's memory open while an operation may touch it (host-executed
  // backends; nothing on a GPU): from before it starts until it completes.
  struct window {
    backend_ref be;
    bool open = false;
    explicit window(const backend_ref& b) : be(b) {
      be.open_window();
      open = true;
    }
    window(const window&) = delete;
    window& operator=(const window&) = delete;
    ~window() {
      if (open) be.close_window();
    }
  };
  // Waits for `r`, calling `poll` meanwhile where the request can (NCCL's).
  template <class R> static void finish(R& r, const std::function<void()>& poll) {
    if constexpr (requires { r.wait(poll); }) {
      if (poll) return r.wait(poll);
    }
    r.wait();
  }
  template <class R> struct held final : request::base {
    window w;  // declared first: closed after the operation's own request is done with
    R r;
    const std::function<void()>* poll;
    std::int64_t* waits;
    template <class Issue>
    held(const backend_ref& be, Issue&& issue, const std::function<void()>* p, std::int64_t* n)
        : w(be), r(issue()), poll(p), waits(n) {}
    bool test() override { return r.test(); }
    void wait() override {
      ++*waits;
      finish(r, *poll);
    }
    void join() override {
      if constexpr (requires(void* s) { r.join_on(s); }) r.join_on(w.be.compute_stream());
      else finish(r, *poll);  // a host-executed backend: the host is the device's queue
    }
  };

  template <class C> struct model final : concept_t {
    C c;
    backend_ref be;
    model(C comm, const backend_ref& b) : c(std::move(comm)), be(b) {}
    template <class Issue> request run(Issue&& issue) {
      request q;
      q.impl_ = std::make_unique<held<typename C::request>>(be, std::forward<Issue>(issue), &this->poll, &this->waits);
      return q;
    }
    // A blocking form without one of its own: the device's queue waits for the operation (on a
    // GPU its compute stream waits for the operation's event; the host does not).
    template <class Issue> void complete(Issue&& issue) {
      auto q = issue();
      if constexpr (requires(void* st) { q.join_on(st); }) q.join_on(be.compute_stream());
      else finish(q, this->poll);
    }
    int rank() const override { return c.rank(); }
    int size() const override { return c.size(); }
    std::string name() const override { return c.name(); }
    comm_stats stats() const override { return c.stats(); }
    void reset_stats() override { c.reset_stats(); }
    request iall_reduce(void* b, index_t n, dtype t, reduce_op op) override {
      return run([&] { return c.iall_reduce(b, n, t, op); });
    }
    request iall_gather(const void* i, void* o, index_t n, dtype t) override {
      return run([&] { return c.iall_gather(i, o, n, t); });
    }
    request iall_gather_v(const void* i, void* o, std::span<const index_t> k, dtype t) override {
      return run([&] { return c.iall_gather_v(i, o, k, t); });
    }
    request ireduce_scatter(const void* i, void* o, index_t n, dtype t, reduce_op op) override {
      return run([&] { return c.ireduce_scatter(i, o, n, t, op); });
    }
    request ireduce_scatter_v(const void* i, void* o, std::span<const index_t> k, dtype t, reduce_op op) override {
      return run([&] { return c.ireduce_scatter_v(i, o, k, t, op); });
    }
    request ibroadcast(void* b, index_t n, dtype t, int root) override {
      return run([&] { return c.ibroadcast(b, n, t, root); });
    }
    request isend(const void* b, index_t n, dtype t, int dst, int tag) override {
      return run([&] { return c.isend(b, n, t, dst, tag); });
    }
    request irecv(void* b, index_t n, dtype t, int src, int tag) override {
      return run([&] { return c.irecv(b, n, t, src, tag); });
    }
    request ibarrier() override {
      return run([&] { return c.ibarrier(); });
    }
    void all_reduce(void* b, index_t n, dtype t, reduce_op op) override {
      const window w(be);
      if constexpr (requires { c.all_reduce(b, n, t, op); }) c.all_reduce(b, n, t, op);
      else complete([&] { return c.iall_reduce(b, n, t, op); });
    }
    void all_gather(const void* i, void* o, index_t n, dtype t) override {
      const window w(be);
      if constexpr (requires { c.all_gather(i, o, n, t); }) c.all_gather(i, o, n, t);
      else complete([&] { return c.iall_gather(i, o, n, t); });
    }
    void all_gather_v(const void* i, void* o, std::span<const index_t> k, dtype t) override {
      const window w(be);
      if constexpr (requires { c.all_gather_v(i, o, k, t); }) c.all_gather_v(i, o, k, t);
      else complete([&] { return c.iall_gather_v(i, o, k, t); });
    }
    void reduce_scatter(const void* i, void* o, index_t n, dtype t, reduce_op op) override {
      const window w(be);
      if constexpr (requires { c.reduce_scatter(i, o, n, t, op); }) c.reduce_scatter(i, o, n, t, op);
      else complete([&] { return c.ireduce_scatter(i, o, n, t, op); });
    }
    void reduce_scatter_v(const void* i, void* o, std::span<const index_t> k, dtype t, reduce_op op) override {
      const window w(be);
      if constexpr (requires { c.reduce_scatter_v(i, o, k, t, op); }) c.reduce_scatter_v(i, o, k, t, op);
      else complete([&] { return c.ireduce_scatter_v(i, o, k, t, op); });
    }
    void broadcast(void* b, index_t n, dtype t, int root) override {
      const window w(be);
      if constexpr (requires { c.broadcast(b, n, t, root); }) c.broadcast(b, n, t, root);
      else complete([&] { return c.ibroadcast(b, n, t, root); });
    }
    std::unique_ptr<concept_t> split(int color, int key) override {
      auto m = std::make_unique<model>(c.split(color, key), be);
      m->poll = poll;
      return m;
    }
  };

  concept_t& self() const {
    if (!m_) throw std::logic_error("whale::device_comm: operation on a null communicator");
    return *m_;
  }
  std::unique_ptr<concept_t> m_;
};

static_assert(Communicator<device_comm>);

/// The communicator for buffers in `be`'s memory over the ranks of `over`
/// (collective over `over`; every rank must pass a backend of the same kind):
/// on a GPU, NCCL (its producer stream the backend's compute stream, so each
/// operation follows the kernels that wrote its buffers); on a host-executed
/// backend (the guarded one), a split of `over` run inside the backend's
/// window. Null for the CPU, whose buffers `over` takes as they are, and for
/// a GPU in a build without MPI (no NCCL communicator then): host copies.
template <class HostComm> std::unique_ptr<device_comm> make_device_comm(HostComm& over, const backend_ref& be) {
  if (be.on_cpu()) return nullptr;
  if (be.host_executed())
    return std::make_unique<device_comm>(over.split(0, over.rank(), over.name() + "@" + be.name()), be);
#if defined(WHALE_HAS_CUDA) && defined(WHALE_HAS_MPI)
  if constexpr (std::is_same_v<HostComm, mpi_comm>) {
    nccl_comm n(over, over.name() + "@nccl");
    n.set_producer_stream(static_cast<cudaStream_t>(be.compute_stream()));
    return std::make_unique<device_comm>(std::move(n), be);
  }
#endif
  return nullptr;  // a GPU without NCCL in this build (no MPI): the collectives go through host copies
}

}  // namespace whale
