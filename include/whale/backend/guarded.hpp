// `guarded_backend`: the CPU computing in memory that host code may not touch.
// It keeps a GPU's rule -- device memory is read and written only by the
// backend's own calls (GEMMs, kernel bodies, copies, fills) -- on a machine
// without a GPU: its memory is one reserved region that is mapped without
// access (PROT_NONE) except while one of those calls runs. Host code that
// reads or writes a tensor placed there (a loss summed on the host, a label
// check, an initialisation loop) stops with SIGSEGV and a message naming the
// cause, where on a GPU it would crash or read garbage. The arithmetic is the
// CPU backend's, so a model trained on it must match the CPU bit for bit.
// A debugging and testing backend: each call costs two mprotect calls. It
// also catches the opposite mistake where it can: a GEMM operand or a fill
// target in host memory (a buffer never placed on the device) is an error.
// Kernel bodies hold raw pointers, so a body over host memory goes unseen.
// It keeps a ledger of what a GPU would be asked to do (device_ledger: each
// launch with its kernel, threads and declared bytes, each GEMM's FLOPs, each
// copy, fill and host wait), and can count without computing (count_only),
// so a full-size step's ledger costs no memory and no arithmetic.
#pragma once

#include <csignal>
#include <cstdlib>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "whale/backend/backend.hpp"
#include "whale/backend/backend_ref.hpp"
#include "whale/backend/caching_allocator.hpp"
#include "whale/backend/cpu.hpp"
#include "whale/backend/device_ledger.hpp"
#include "whale/backend/kernels/elementwise.hpp"

namespace whale {

/// The guarded backend's memory space.
struct guarded {
  static constexpr const char* name = "guarded";
};

class guarded_backend;

namespace detail {
/// Pages of the guarded region, handed to the caching allocator: reused by
/// size (the smallest free run that fits), else taken from the unused end.
struct guarded_upstream {
  guarded_backend* owner = nullptr;
  void* allocate(std::size_t n);
  void deallocate(void* p, std::size_t n) noexcept;
};
}  // namespace detail

/// One per process at a time (it installs the SIGSEGV handler that names the
/// cause); tensors placed in it must be freed before it is destroyed.
class guarded_backend {
 public:
  using space = guarded;
  struct event_type {};
  /// Kernel bodies run by the CPU loop between enter() and leave().
  static constexpr bool host_executed = true;
  static constexpr const char* name() noexcept { return "guarded"; }

  /// Reserve `capacity` bytes of address space (no memory is committed until used).
  explicit guarded_backend(std::size_t capacity = std::size_t{1} << 30) : alloc_(detail::guarded_upstream{this}) {
    if (active() != nullptr)
      throw std::logic_error("whale::guarded_backend: another guarded backend is alive in this process; use one at a time");
    reserve(capacity);
    struct sigaction sa {};
    sa.sa_sigaction = &on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;  // on the alternate stack where one is set up (doctest's)
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGSEGV, &sa, &previous_);
    active() = this;
  }
  /// A backend that only counts (count_only, for good): it computes nothing and
  /// touches none of its memory, so it installs no fault handler, and any number
  /// may live beside one another and beside a guarded backend that computes
  /// (the plan simulator's kernel probes, plan/probe.hpp). Its region is never
  /// opened: host code that touches it dies of a plain SIGSEGV.
  struct counting_t {};
  static constexpr counting_t counting{};
  guarded_backend(std::size_t capacity, counting_t) : alloc_(detail::guarded_upstream{this}) {
    reserve(capacity);
    count_only_ = counter_ = true;
  }
  guarded_backend(const guarded_backend&) = delete;
  guarded_backend& operator=(const guarded_backend&) = delete;
  ~guarded_backend() {
    if (alloc_.stats().bytes_in_use != 0) {  // tensors still placed here would dangle
      static const char msg[] =
          "whale::guarded_backend: destroyed while tensors placed on it are alive; free them first\n";
      (void)!::write(2, msg, sizeof msg - 1);
      std::abort();
    }
    alloc_.release();
    if (!counter_) {
      ::sigaction(SIGSEGV, &previous_, nullptr);
      active() = nullptr;
    }
    ::munmap(base_, capacity_);
  }

  /// What this backend was asked to do since construction or the last clear().
  const device_ledger& ledger() const noexcept { return ledger_; }
  device_ledger& ledger() noexcept { return ledger_; }
  /// Record every call without computing it or touching memory: GEMMs, kernels,
  /// copies and fills are counted and skipped (host copies out of the device
  /// leave their destination as it was). For ledgers of shapes too large to
  /// compute here; what the step computes is then meaningless.
  void set_count_only(bool on) noexcept { count_only_ = on || counter_; }
  bool count_only() const noexcept { return count_only_; }
  /// Model a GPU whose attention is fused under bf16 mixed precision (the CUDA
  /// backend built with the cuDNN frontend; off by default). backend_ref's
  /// attention calls with bf16 set are then recorded as that path's calls --
  /// Q, K, V (and O, d(O)) packed to bf16, one fused call with its FLOPs, the
  /// results unpacked -- and computed in the same precision on the CPU: the
  /// batched-GEMM steps on bf16-rounded operands, the results rounded to bf16.
  void set_fused_attention(bool on) noexcept { fused_attention_ = on; }
  bool fuses_attention() const noexcept { return fused_attention_; }
  /// A kept buffer (attention_args::packed) is written by the forward (the
  /// bf16 Q, K, V and O) and read by the backward, which then packs only d(o).
  bool fused_attention(const attention_args& a, bool backward);
  /// Model a GPU whose GEMMs compute the bias gradient in their epilogue (the
  /// CUDA backend's cuBLASLt BGRADB; off by default): backend_ref's
  /// linear_weight_grads that overwrite are then one GEMM in the ledger, with
  /// no column reduction launched, and computed as the CPU computes them (its
  /// GEMM, its column sums in their order), so the values stay the CPU's bits.
  /// The same setting models the forward's bias epilogue (cuBLASLt's BIAS):
  /// backend_ref::gemm_bias is one GEMM, computed as the CPU computes it
  /// (the bias, then the product added), with no launch.
  void set_fused_bias_grads(bool on) noexcept { fused_bias_grads_ = on; }
  /// And GELU's (cuBLASLt's GELU_AUX_BIAS forward, DGELU backward): backend_ref::gemm_gelu
  /// is one GEMM, computed as the CPU computes it (the GEMM, then the GELU kernel).
  bool gemm_gelu(const gemm_gelu_args& a) {
    if (!fused_bias_grads_) return false;
    mine(a.A, "a GEMM's A"), mine(a.B, "a GEMM's B"), mine(a.out, "a GEMM's C"), mine(a.pre, "a GELU epilogue's input");
    if (a.bias) mine(a.bias, "a GEMM's bias");
    ++ledger_.gemms, ++ledger_.gelu_epilogues;
    if (a.bias) ++ledger_.bias_epilogues;
    ledger_.gemm_flops += 2.0 * static_cast<double>(a.M) * static_cast<double>(a.N) * static_cast<double>(a.K);
    if (count_only_) return true;
    const window w(*this);
    backend_ref::unfused_gemm_gelu(backend_ref{}, a);
    return true;
  }
  bool gemm_bias(const gemm_bias_args& a) {
    if (!fused_bias_grads_) return false;
    mine(a.A, "a GEMM's A"), mine(a.B, "a GEMM's B"), mine(a.C, "a GEMM's C"), mine(a.bias, "a GEMM's bias");
    if (a.M == 0 || a.N == 0 || a.K == 0) return false;
    ++ledger_.gemms, ++ledger_.bias_epilogues;
    ledger_.gemm_flops += 2.0 * static_cast<double>(a.M) * static_cast<double>(a.N) * static_cast<double>(a.K);
    if (count_only_) return true;
    const window w(*this);
    cpu::launch(a.M, kernels::bias_rows{a.C, a.bias, a.N, false});
    cpu::gemm(a.ta, a.tb, a.M, a.N, a.K, 1.f, a.A, a.ta == trans::yes ? a.M : a.K, a.B, a.tb == trans::yes ? a.K : a.N,
              1.f, a.C, a.N);
    return true;
  }
  bool linear_weight_grads(const weight_grad_args& a) {
    if (!fused_bias_grads_ || a.db == nullptr) return false;
    mine(a.dy, "a GEMM's A"), mine(a.x, "a GEMM's B"), mine(a.dw, "a GEMM's C"), mine(a.db, "a GEMM's bias gradient");
    if (a.R == 0 || a.out == 0 || a.in == 0) return false;
    ++ledger_.gemms, ++ledger_.bias_grad_epilogues;
    ledger_.gemm_flops += 2.0 * static_cast<double>(a.out) * static_cast<double>(a.in) * static_cast<double>(a.R);
    if (count_only_) return true;
    const window w(*this);
    cpu::gemm(trans::yes, trans::no, a.out, a.in, a.R, 1.f, a.dy, a.out, a.x, a.in, 0.f, a.dw, a.in);
    cpu::reduce_columns(kernels::column_sums{a.dy, a.db, a.R, a.out, false});
    return true;
  }
  /// A kernel launch for the ledger; whether to run it (false under count_only).
  bool note(const launch_note& n);

  void gemm(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A, index_t lda,
            const float* B, index_t ldb, float beta, float* C, index_t ldc) {
    mine(A, "a GEMM's A"), mine(B, "a GEMM's B"), mine(C, "a GEMM's C");
    if (M == 0 || N == 0) return;
    ++ledger_.gemms;
    ledger_.gemm_flops += 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
    if (count_only_) return;
    const window w(*this);
    cpu::gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void gemm_strided_batched(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A,
                            index_t lda, index_t strideA, const float* B, index_t ldb, index_t strideB, float beta,
                            float* C, index_t ldc, index_t strideC, index_t count) {
    mine(A, "a batched GEMM's A"), mine(B, "a batched GEMM's B"), mine(C, "a batched GEMM's C");
    if (M == 0 || N == 0 || count == 0) return;
    ++ledger_.batched_gemms;
    ledger_.batched_gemm_flops +=
        2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) * static_cast<double>(count);
    if (count_only_) return;
    const window w(*this);
    cpu::gemm_strided_batched(ta, tb, M, N, K, alpha, A, lda, strideA, B, ldb, strideB, beta, C, ldc, strideC,
                              count);
  }
  template <kernels::KernelBody K> void launch(index_t n, const K& body) {
    std::int64_t bytes = -1;
    if constexpr (requires { body.bytes(n); }) bytes = body.bytes(n);
    if (!note({kernels::kernel_name<K>().c_str(), 'i', n, n, bytes})) return;
    const window w(*this);
    cpu::launch(n, body);
  }
  void* allocate(std::size_t bytes) { return alloc_.allocate(bytes); }
  void deallocate(void* p, std::size_t bytes) { alloc_.deallocate(p, bytes); }
  /// Copy within or into or out of the region (the host side is ordinary memory).
  void copy(void* dst, const void* src, std::size_t bytes) {
    if (!bytes) return;
    if (!contains(dst) && !contains(src))
      throw std::logic_error("whale::guarded_backend: a copy between two host buffers: neither side is device memory "
                             "(a tensor meant for the device was allocated outside a place_scope)");
    ++ledger_.copies;
    ledger_.copy_bytes += static_cast<std::int64_t>(bytes);
    if (!contains(dst)) ++ledger_.device_to_host;
    if (!contains(src)) ++ledger_.host_to_device;
    if (count_only_) return;
    const window w(*this);
    std::memcpy(dst, src, bytes);
  }
  void fill_zero(void* p, std::size_t bytes) {
    if (!bytes) return;
    mine(p, "a fill's target");
    ++ledger_.fills;
    ledger_.fill_bytes += static_cast<std::int64_t>(bytes);
    if (count_only_) return;
    const window w(*this);
    std::memset(p, 0, bytes);
  }
  void record(event_type&) const noexcept {}
  void wait(event_type&) const noexcept {}
  void synchronize() noexcept { ++ledger_.host_syncs; }

  /// Open the region to this thread's backend call (nested calls count); a
  /// counting backend's stays closed (nothing may touch it).
  void enter() {
    if (counter_) return;
    if (depth_ == 0) protect(PROT_READ | PROT_WRITE);
    ++depth_;
  }
  /// Close it again after the outermost call (a failing mprotect here cannot be reported: it aborts).
  void leave() noexcept {
    if (counter_) return;
    if (--depth_ == 0 && used_ && ::mprotect(base_, used_, PROT_NONE) != 0) {
      static const char msg[] = "whale::guarded_backend: mprotect failed closing the region\n";
      (void)!::write(2, msg, sizeof msg - 1);
      std::abort();
    }
  }
  /// Where tensors placed on this backend live.
  const memory_place* memory() const noexcept { return &place_; }
  const allocator_stats& allocator() const noexcept { return alloc_.stats(); }
  /// Bytes it could still hand out: the region's unused end, its freed page
  /// runs and the blocks its allocator caches for reuse.
  std::size_t memory_free() const noexcept {
    std::size_t f = capacity_ - used_ + static_cast<std::size_t>(alloc_.stats().bytes_cached);
    for (const auto& run : free_) f += run.second;
    return f;
  }
  /// Whether `p` points into the region.
  bool contains(const void* p) const noexcept {
    const char* c = static_cast<const char*>(p);
    return c >= base_ && c < base_ + capacity_;
  }

 private:
  friend struct detail::guarded_upstream;
  struct window {
    guarded_backend& g;
    explicit window(guarded_backend& b) : g(b) { g.enter(); }
    ~window() { g.leave(); }
    window(const window&) = delete;
    window& operator=(const window&) = delete;
  };
  // GEMMs and fills work on device memory only: a host pointer here is a
  // buffer that was never placed on the device (on a GPU, a crash).
  void mine(const void* p, const char* what) const {
    if (p && !contains(p))
      throw std::logic_error(std::string("whale::guarded_backend: ") + what +
                             " is host memory, not the device's: a buffer meant for the device was allocated outside "
                             "a place_scope on it");
  }
  static std::size_t page() noexcept { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }
  void reserve(std::size_t capacity) {
    capacity_ = (capacity + page() - 1) / page() * page();
    void* p = ::mmap(nullptr, capacity_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw std::runtime_error("whale::guarded_backend: cannot reserve " + std::to_string(capacity_) +
                               " bytes of address space: " + std::strerror(errno));
    base_ = static_cast<char*>(p);
  }
  static guarded_backend*& active() noexcept {
    static guarded_backend* a = nullptr;
    return a;
  }
  void protect(int prot) {
    if (used_ && ::mprotect(base_, used_, prot) != 0)
      throw std::runtime_error(std::string("whale::guarded_backend: mprotect failed: ") + std::strerror(errno));
  }
  void* take(std::size_t n);
  void give(void* p, std::size_t n) noexcept { free_.emplace_back(p, (n + page() - 1) / page() * page()); }

  // SIGSEGV in the region: say why, then die of the signal (the default action,
  // so a test harness or a debugger sees the crash where it happened).
  // Faults elsewhere go to the handler that was there before.
  static void on_fault(int sig, siginfo_t* info, void* uctx);

  char* base_ = nullptr;
  std::size_t capacity_ = 0, used_ = 0;
  int depth_ = 0;
  bool count_only_ = false, counter_ = false, fused_attention_ = false, fused_bias_grads_ = false;
  device_ledger ledger_;
  std::vector<std::pair<void*, std::size_t>> free_;
  struct sigaction previous_ {};
  caching_allocator<detail::guarded_upstream> alloc_;
  memory_place place_{this,
                      [](void* o, std::size_t n) { return static_cast<guarded_backend*>(o)->allocate(n); },
                      [](void* o, void* p, std::size_t n) { static_cast<guarded_backend*>(o)->deallocate(p, n); },
                      [](void* o, void* p, std::size_t n) { static_cast<guarded_backend*>(o)->fill_zero(p, n); },
                      "guarded"};
};
static_assert(Backend<guarded_backend>, "whale::guarded_backend must model the Backend concept");

}  // namespace whale

#include "whale/backend/guarded_calls.hpp"  // the larger members' definitions
