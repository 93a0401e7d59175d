// guarded_backend's larger members (backend/guarded.hpp), defined: the fused
// attention it models, the launch ledger's note, taking pages of its region,
// and the SIGSEGV handler that names a host access to device memory.
#pragma once

#include <csignal>
#include <cstddef>
#include <unistd.h>

#include "whale/backend/guarded.hpp"

namespace whale {

/// The fused attention call, modelled: recorded as the fused path's calls
/// and computed on the CPU in its precision.
inline bool guarded_backend::fused_attention(const attention_args& a, bool backward) {
  if (!fused_attention_ || !a.bf16) return false;
  mine(a.qkv, "attention's qkv"), mine(a.o, "attention's output"), mine(a.lse, "attention's log-sum-exps");
  mine(a.packed, "attention's kept bf16 operands");
  const bool kept = a.packed != nullptr;
  const index_t W = a.H * a.hd, R = a.B * a.T, in = R * 3 * W, out = R * W;
  const auto pack = kernels::kernel_name<kernels::pack_bf16>(), unpack = kernels::kernel_name<kernels::unpack_bf16>();
  const double products = static_cast<double>(a.B * a.H) * static_cast<double>(a.T) * static_cast<double>(a.T) *
                          static_cast<double>(a.hd);  // T x T x hd multiply-adds per (sequence, head), the causal half
  ++ledger_.attention_calls;
  if (!backward || !kept) ledger_.add({pack.c_str(), 'i', in, in, kernels::pack_bf16{}.bytes(in)});
  if (!backward) {
    ledger_.attention_flops += 2.0 * products;  // S = Q K^T and O = P V
    ledger_.attention_bytes += 2 * (in + out) + 4 * a.B * a.H * a.T;
    ledger_.add({unpack.c_str(), 'i', out, out, kernels::unpack_bf16{}.bytes(out)});
  } else {
    mine(a.dout, "attention's d(output)"), mine(a.dqkv, "attention's d(qkv)");
    ledger_.attention_flops += 5.0 * products;  // S again, dP, dV, dQ, dK
    ledger_.attention_bytes += 2 * (2 * in + 2 * out) + 4 * a.B * a.H * a.T;
    if (!kept) ledger_.add({pack.c_str(), 'i', out, out, kernels::pack_bf16{}.bytes(out)});
    ledger_.add({pack.c_str(), 'i', out, out, kernels::pack_bf16{}.bytes(out)});
    ledger_.add({unpack.c_str(), 'i', in, in, kernels::unpack_bf16{}.bytes(in)});
  }
  if (count_only_) return true;
  const window w(*this);
  auto rounded = [](const float* x, index_t n) {
    std::vector<float> v(x, x + n);
    for (auto& e : v) e = kernels::round_bf16(e);
    return v;
  };
  auto* const kept16 = static_cast<std::uint16_t*>(a.packed);
  std::vector<float> qkv;
  if (backward && kept) {  // the forward's bf16 Q, K, V, as cuDNN's backward reads them
    qkv.resize(static_cast<std::size_t>(in));
    for (index_t i = 0; i < in; ++i) qkv[static_cast<std::size_t>(i)] = kernels::from_bf16_bits(kept16[i]);
  } else {
    qkv = rounded(a.qkv, in);
  }
  const backend_ref cpu;
  if (!backward) {
    cpu.attention_forward(a.B, a.T, a.H, a.hd, qkv.data(), a.o, a.lse);
    for (index_t i = 0; i < out; ++i) a.o[i] = kernels::round_bf16(a.o[i]);
    if (kept) {
      for (index_t i = 0; i < in; ++i) kept16[i] = kernels::bf16_bits(qkv[static_cast<std::size_t>(i)]);
      for (index_t i = 0; i < out; ++i) kept16[in + i] = kernels::bf16_bits(a.o[i]);
    }
  } else {
    const auto dout = rounded(a.dout, out);
    cpu.attention_backward(a.B, a.T, a.H, a.hd, qkv.data(), a.o, a.lse, dout.data(), a.dqkv);
    for (index_t i = 0; i < in; ++i) a.dqkv[i] = kernels::round_bf16(a.dqkv[i]);
  }
  return true;
}

inline void guarded_backend::on_fault(int sig, siginfo_t* info, void* uctx) {
  guarded_backend* g = active();
  if (g && g->contains(info->si_addr) && g->depth_ > 0) {
    static const char msg[] =
        "whale: a guarded backend call read or wrote its region past the end of what was allocated\n";
    (void)!::write(2, msg, sizeof msg - 1);
    ::signal(SIGSEGV, SIG_DFL);
    return;
  }
  if (g && g->contains(info->si_addr)) {
    static const char msg[] =
        "whale: host code read or wrote device memory (a tensor placed on the guarded backend); only the "
        "backend's GEMMs, kernel bodies, copies and fills may touch it. Copy it to the host first "
        "(backend_ref::host_readable), or run under a debugger to see which code did it\n";
    (void)!::write(2, msg, sizeof msg - 1);
    ::signal(SIGSEGV, SIG_DFL);
    return;  // the access faults again, now with the default action
  }
  if (!g) {
    ::signal(SIGSEGV, SIG_DFL);
    return;
  }
  const struct sigaction& prev = g->previous_;
  if ((prev.sa_flags & SA_SIGINFO) && prev.sa_sigaction) return prev.sa_sigaction(sig, info, uctx);
  if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN && prev.sa_handler) return prev.sa_handler(sig);
  ::signal(SIGSEGV, SIG_DFL);
}

inline void* guarded_backend::take(std::size_t n) {
  n = (n + page() - 1) / page() * page();
  std::size_t best = free_.size();
  for (std::size_t i = 0; i < free_.size(); ++i)
    if (free_[i].second >= n && (best == free_.size() || free_[i].second < free_[best].second)) best = i;
  if (best != free_.size()) {
    void* p = free_[best].first;
    free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
    return p;
  }
  if (n > capacity_ - used_)
    throw std::runtime_error("whale::guarded_backend: its region of " + std::to_string(capacity_) +
                             " bytes is full (" + std::to_string(used_) + " used, " + std::to_string(n) +
                             " more asked for); construct it with a larger capacity");
  void* p = base_ + used_;
  used_ += n;
  if (depth_ > 0 && ::mprotect(p, n, PROT_READ | PROT_WRITE) != 0)
    throw std::runtime_error(std::string("whale::guarded_backend: mprotect failed: ") + std::strerror(errno));
  return p;
}

inline bool guarded_backend::note(const launch_note& n) {
  ledger_.add(n);
  return !count_only_;
}

inline void* detail::guarded_upstream::allocate(std::size_t n) { return owner->take(n); }
inline void detail::guarded_upstream::deallocate(void* p, std::size_t n) noexcept { owner->give(p, n); }

}  // namespace whale
