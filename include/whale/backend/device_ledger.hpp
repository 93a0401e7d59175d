// The ledger of a device backend's calls (`device_ledger`): each kernel
// launch with its threads and declared bytes, each GEMM's FLOPs, each copy,
// fill and host wait, summed per kernel. The guarded backend keeps one
// (backend/guarded.hpp); bench/gpu_ledger prints it.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "whale/backend/backend.hpp"

namespace whale {

/// What a device backend was asked to do, call by call, summed: what a GPU
/// would launch, move and wait for. Launches that run fewer threads than one
/// block of 256 per SM of an H200 (132 SMs) are `underfilled`: a roofline
/// prices their bytes at that fraction of the memory bandwidth.
struct device_ledger {
  static constexpr std::int64_t full_threads = 132 * 256;
  struct kernel_line {
    std::int64_t launches = 0, bytes = 0, undeclared = 0, underfilled = 0;
    std::int64_t threads_min = -1;  ///< the fewest threads of one launch
    double effective_bytes = 0;     ///< bytes divided by each launch's filled fraction of the GPU
  };
  std::map<std::string, kernel_line> kernels;  ///< by kernel name
  std::int64_t kernel_launches = 0, gemms = 0, batched_gemms = 0, copies = 0, fills = 0;
  std::int64_t host_syncs = 0;        ///< waits of the host for the device's queue (synchronize)
  std::int64_t device_to_host = 0;    ///< copies into host memory (a host wait on a GPU)
  std::int64_t host_to_device = 0;    ///< copies from host memory
  std::int64_t kernel_bytes = 0, copy_bytes = 0, fill_bytes = 0, undeclared_launches = 0, underfilled_launches = 0;
  double kernel_effective_bytes = 0;
  double gemm_flops = 0, batched_gemm_flops = 0;
  /// Fused attention calls (guarded_backend::set_fused_attention), their
  /// FLOPs (the causal half of the products: a flash attention skips the
  /// masked blocks) and the bytes of their bf16 operands, statistics included.
  std::int64_t attention_calls = 0, attention_bytes = 0;
  double attention_flops = 0;
  /// GEMMs that computed a bias gradient in their epilogue (guarded_backend::set_fused_bias_grads; counted in gemms).
  std::int64_t bias_grad_epilogues = 0;
  /// GEMMs that added a bias in their epilogue (gemm_bias, under the same setting; counted in gemms).
  std::int64_t bias_epilogues = 0;
  /// GEMMs with GELU or its gradient in their epilogue (gemm_gelu, under the same setting; counted in gemms).
  std::int64_t gelu_epilogues = 0;

  /// Every call a GPU queues: kernels, GEMMs (batched ones count once), fused attention, copies and fills.
  std::int64_t launches() const noexcept {
    return kernel_launches + gemms + batched_gemms + attention_calls + copies + fills;
  }
  void clear() { *this = device_ledger{}; }
  /// What this ledger holds beyond `before` (a ledger of a shorter run of the
  /// same work): e.g. one training step, as a run of two steps less a run of
  /// one, with what both do once (a read at the end) cancelled. The fewest
  /// threads of a launch stay this ledger's.
  device_ledger minus(const device_ledger& before) const {
    device_ledger d = *this;
    for (const auto& [name, b] : before.kernels) {
      auto& k = d.kernels[name];
      k.launches -= b.launches, k.bytes -= b.bytes, k.undeclared -= b.undeclared, k.underfilled -= b.underfilled;
      k.effective_bytes -= b.effective_bytes;
      if (k.launches == 0) d.kernels.erase(name);
    }
    d.kernel_launches -= before.kernel_launches, d.gemms -= before.gemms, d.batched_gemms -= before.batched_gemms;
    d.copies -= before.copies, d.fills -= before.fills, d.host_syncs -= before.host_syncs;
    d.device_to_host -= before.device_to_host, d.host_to_device -= before.host_to_device;
    d.kernel_bytes -= before.kernel_bytes, d.copy_bytes -= before.copy_bytes, d.fill_bytes -= before.fill_bytes;
    d.undeclared_launches -= before.undeclared_launches, d.underfilled_launches -= before.underfilled_launches;
    d.kernel_effective_bytes -= before.kernel_effective_bytes;
    d.gemm_flops -= before.gemm_flops, d.batched_gemm_flops -= before.batched_gemm_flops;
    d.attention_calls -= before.attention_calls, d.attention_bytes -= before.attention_bytes;
    d.attention_flops -= before.attention_flops;
    d.bias_grad_epilogues -= before.bias_grad_epilogues;
    d.bias_epilogues -= before.bias_epilogues;
    d.gelu_epilogues -= before.gelu_epilogues;
    return d;
  }
  void add(const launch_note& n) {
    auto& k = kernels[n.kernel];
    ++k.launches, ++kernel_launches;
    const double filled = n.threads >= full_threads ? 1.0 : static_cast<double>(n.threads > 0 ? n.threads : 1) / full_threads;
    if (filled < 1.0) ++k.underfilled, ++underfilled_launches;
    if (k.threads_min < 0 || n.threads < k.threads_min) k.threads_min = n.threads;
    if (n.bytes < 0) {
      ++k.undeclared, ++undeclared_launches;
      return;
    }
    k.bytes += n.bytes, kernel_bytes += n.bytes;
    k.effective_bytes += static_cast<double>(n.bytes) / filled;
    kernel_effective_bytes += static_cast<double>(n.bytes) / filled;
  }
};

}  // namespace whale
