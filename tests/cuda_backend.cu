// The CUDA backend against the CPU backend, on a GPU: every kernel body of
// backend/kernels/ run by a CUDA grid against the same body run by the CPU
// loop (tests/support/kernel_cases.hpp), cuBLASLt and cuBLAS GEMMs in every
// transpose and strided-batched against OpenBLAS (fp32, TF32, bf16 inputs,
// bf16 math on bf16 values; the bias-gradient epilogue), and the caching
// allocator's steady state (no cudaMalloc after the first step), and
// backend_ref holding the GPU as a layer uses it. Compiled by
// nvcc in CI; without a GPU it prints "skipped: no CUDA device" and exits 77
// (ctest's skip code). Tolerances are stated beside each check.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "support/kernel_cases.hpp"
#include "whale/backend/backend_ref.hpp"
#include "whale/backend/cpu.hpp"
#include "whale/backend/cuda.hpp"

using namespace whale;
namespace kc = kernel_cases;

static_assert(Backend<cuda_backend>, "cuda_backend must model the Backend concept");
static_assert(Backend<cpu_backend>, "cpu_backend must model the Backend concept");

namespace {
int failures = 0;
void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::printf("FAILED: %s\n", what.c_str());
  }
}

// Device copies of a host_buffers set, and back.
struct device_buffers {
  cuda_backend& b;
  std::vector<float*> f;
  std::int32_t *labels = nullptr, *tokens = nullptr;
  double* rowd = nullptr;
  explicit device_buffers(cuda_backend& be, kc::host_buffers& h) : b(be) {
    for (auto* v : h.floats()) {
      f.push_back(static_cast<float*>(b.allocate(v->size() * sizeof(float))));
      b.copy(f.back(), v->data(), v->size() * sizeof(float));
    }
    labels = static_cast<std::int32_t*>(b.allocate(h.labels.size() * 4));
    tokens = static_cast<std::int32_t*>(b.allocate(h.tokens.size() * 4));
    rowd = static_cast<double*>(b.allocate(h.rowd.size() * 8));
    b.copy(labels, h.labels.data(), h.labels.size() * 4);
    b.copy(tokens, h.tokens.data(), h.tokens.size() * 4);
    b.copy(rowd, h.rowd.data(), h.rowd.size() * 8);
  }
  kc::buffers ptrs() { return {f[0], f[1], f[2], f[3], f[4], f[5], labels, tokens, rowd}; }
  void to_host(kc::host_buffers& h) {
    auto hv = h.floats();
    for (std::size_t i = 0; i < hv.size(); ++i) b.copy(hv[i]->data(), f[i], hv[i]->size() * sizeof(float));
    b.copy(h.rowd.data(), rowd, h.rowd.size() * 8);
    b.synchronize();
  }
  ~device_buffers() {
    for (auto* p : f) b.deallocate(p, 0);
    b.deallocate(labels, 0), b.deallocate(tokens, 0), b.deallocate(rowd, 0);
  }
};

void kernel_bodies(cuda_backend& gpu) {
  int n_cases = 0;
  kc::for_each_case([&](const char* name, index_t n, auto make) {
    ++n_cases;
    kc::host_buffers cpu_side, gpu_side;
    kc::run(cpu_backend{}, n, make(cpu_side.ptrs()));
    {
      device_buffers d(gpu, gpu_side);
      kc::run(backend_ref(gpu), n, make(d.ptrs()));  // by its shape: index space, row teams, column tiles
      d.to_host(gpu_side);
    }
    auto c = cpu_side.floats(), g = gpu_side.floats();
    double worst = 0;
    for (std::size_t i = 0; i < c.size(); ++i) worst = std::max(worst, kc::max_rel_diff(*g[i], *c[i]));
    // same arithmetic in the same order; the GPU contracts to FMA where the CPU's baseline does not
    check(worst <= 2e-6, std::string(name) + ": GPU vs CPU relative difference " + std::to_string(worst));
  });
  std::printf("kernel bodies: %d cases compared, GPU vs CPU\n", n_cases);
}

void gemms(cuda_backend& gpu) {
  const index_t M = 67, N = 45, K = 129;
  std::vector<float> A(M * K), B(K * N), C0(M * N), Cc(M * N), Cg(M * N);
  for (std::size_t i = 0; i < A.size(); ++i) A[i] = static_cast<float>((i * 37) % 17) / 8.f - 1.f;
  for (std::size_t i = 0; i < B.size(); ++i) B[i] = static_cast<float>((i * 11) % 13) / 6.f - 1.f;
  for (std::size_t i = 0; i < C0.size(); ++i) C0[i] = static_cast<float>(i % 7) - 3.f;
  auto* dA = static_cast<float*>(gpu.allocate(A.size() * 4));
  auto* dB = static_cast<float*>(gpu.allocate(B.size() * 4));
  auto* dC = static_cast<float*>(gpu.allocate(C0.size() * 4));
  // C = 0.5 op(A) op(B) + 2 C in the four transposes, in the backend's math `m`, against OpenBLAS
  auto transposes = [&](gemm_math m, const std::vector<float>& a, const std::vector<float>& b, double tol,
                        const char* what) {
    gpu.copy(dA, a.data(), a.size() * 4);
    gpu.copy(dB, b.data(), b.size() * 4);
    gpu.set_math(m);
    for (int t = 0; t < 4; ++t) {
      const trans ta = t & 1 ? trans::yes : trans::no, tb = t & 2 ? trans::yes : trans::no;
      const index_t lda = ta == trans::yes ? M : K, ldb = tb == trans::yes ? K : N;
      Cc = C0;
      cpu::gemm(ta, tb, M, N, K, 0.5f, a.data(), lda, b.data(), ldb, 2.f, Cc.data(), N);
      gpu.copy(dC, C0.data(), C0.size() * 4);
      gpu.gemm(ta, tb, M, N, K, 0.5f, dA, lda, dB, ldb, 2.f, dC, N);
      gpu.copy(Cg.data(), dC, Cg.size() * 4);
      gpu.synchronize();
      const double d = kc::max_rel_diff(Cg, Cc);
      check(d <= tol, "gemm ta=" + std::to_string(t & 1) + " tb=" + std::to_string(t >> 1) + " " + what +
                          ": difference " + std::to_string(d));
    }
    gpu.set_math(gemm_math::fp32);
  };
  // fp32: summation order only (1e-5); TF32 rounds inputs to 10 bits (relative 1e-3 of |C| ~ K)
  transposes(gemm_math::fp32, A, B, 1e-5, "fp32");
  transposes(gemm_math::tf32, A, B, 5e-2, "tf32");
  // strided-batched: 3 problems
  const index_t count = 3, m = 8, n = 9, k = 10;
  std::vector<float> a(count * m * k), bb(count * k * n), cc(count * m * n, 0.f), cg(count * m * n);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i % 5) - 2.f;
  for (std::size_t i = 0; i < bb.size(); ++i) bb[i] = static_cast<float>(i % 3) - 1.f;
  cpu::gemm_strided_batched(trans::no, trans::yes, m, n, k, 1.f, a.data(), k, m * k, bb.data(), k, k * n, 0.f,
                            cc.data(), n, m * n, count);
  auto* da = static_cast<float*>(gpu.allocate(a.size() * 4));
  auto* db = static_cast<float*>(gpu.allocate(bb.size() * 4));
  auto* dc = static_cast<float*>(gpu.allocate(cc.size() * 4));
  gpu.copy(da, a.data(), a.size() * 4), gpu.copy(db, bb.data(), bb.size() * 4), gpu.fill_zero(dc, cc.size() * 4);
  gpu.gemm_strided_batched(trans::no, trans::yes, m, n, k, 1.f, da, k, m * k, db, k, k * n, 0.f, dc, n, m * n, count);
  gpu.copy(cg.data(), dc, cg.size() * 4);
  gpu.synchronize();
  check(kc::max_rel_diff(cg, cc) == 0.0, "strided-batched gemm: small integers must be exact");
  // bf16 inputs, fp32 output: the CPU reference rounds the inputs to bf16 and computes in fp32
  std::vector<std::uint16_t> a16(A.size()), b16(B.size());
  std::vector<float> Ar(A.size()), Br(B.size());
  for (std::size_t i = 0; i < A.size(); ++i) Ar[i] = kernels::round_bf16(A[i]), a16[i] = static_cast<std::uint16_t>(kernels::as_int(Ar[i]) >> 16);
  for (std::size_t i = 0; i < B.size(); ++i) Br[i] = kernels::round_bf16(B[i]), b16[i] = static_cast<std::uint16_t>(kernels::as_int(Br[i]) >> 16);
  Cc.assign(C0.size(), 0.f);
  cpu::gemm(trans::no, trans::no, M, N, K, 1.f, Ar.data(), K, Br.data(), N, 0.f, Cc.data(), N);
  auto* dA16 = gpu.allocate(a16.size() * 2);
  auto* dB16 = gpu.allocate(b16.size() * 2);
  gpu.copy(dA16, a16.data(), a16.size() * 2), gpu.copy(dB16, b16.data(), b16.size() * 2);
  gpu.gemm_bf16(trans::no, trans::no, M, N, K, 1.f, dA16, K, dB16, N, 0.f, dC, N, false);
  gpu.copy(Cg.data(), dC, Cg.size() * 4);
  gpu.synchronize();
  check(kc::max_rel_diff(Cg, Cc) <= 1e-4, "bf16 gemm against the CPU on bf16-rounded inputs");
  // the layers' bf16 GEMMs: fp32 operands holding bf16 values, cuBLASLt's bf16 math (32F_FAST_16BF):
  // exact products, fp32 sums in another order (1e-5, as fp32)
  transposes(gemm_math::bf16, Ar, Br, 1e-5, "bf16 math on bf16 values");
  std::printf("gemms: cuBLASLt plans %s\n", gpu.lt_refused_plans() ? "partly refused (cuBLAS ran those)" : "all taken");
  for (void* p : {static_cast<void*>(dA), static_cast<void*>(dB), static_cast<void*>(dC), static_cast<void*>(da),
                  static_cast<void*>(db), static_cast<void*>(dc), dA16, dB16})
    gpu.deallocate(p, 0);
  std::printf("gemms: fp32 and TF32 in four transposes, strided-batched, bf16\n");
}

// backend_ref holding the GPU, as a layer uses it: a linear layer's forward
// (bias rows, then y += x W^T) and its weight gradients (dW = dy^T x, db = the
// column sums of dy) on device buffers, against the same calls on the CPU's
// backend_ref. Tolerance 1e-4 relative to max(1, |value|): sums of 300 (and
// 37) products of inputs in [-3, 3) in another order, with FMA, differ by up to
// ~1.5e-5 in fp32 (estimated for three summation orders on these inputs).
void backend_ref_on_gpu(cuda_backend& gpu) {
  const index_t R = 37, in = 300, out = 30;  // every operand fits the N floats of a host buffer
  kc::host_buffers h;  // a: x (R, in), b: W (out, in), c: dy (R, out), d: bias (out)
  const backend_ref host, dev(gpu);
  check(!dev.on_cpu() && std::string(dev.name()) == "cuda", "backend_ref(gpu) is a GPU backend");
  auto linear_step = [&](const backend_ref& be, const float* x, const float* w, const float* dy, const float* bias,
                         float* y, float* dw, float* db) {
    be.launch(R, kernels::bias_rows{y, bias, out, false});
    be.gemm(trans::no, trans::yes, R, out, in, 1.f, x, w, 1.f, y);
    be.linear_weight_grads(R, out, in, dy, x, dw, db, false);
  };
  std::vector<float> y_c(R * out), dw_c(out * in), db_c(out);
  linear_step(host, h.a.data(), h.b.data(), h.c.data(), h.d.data(), y_c.data(), dw_c.data(), db_c.data());
  device_buffers d(gpu, h);  // f[0..5] hold a..f
  auto* y = static_cast<float*>(gpu.allocate(y_c.size() * 4));
  auto* dw = static_cast<float*>(gpu.allocate(dw_c.size() * 4));
  auto* db = static_cast<float*>(gpu.allocate(db_c.size() * 4));
  linear_step(dev, d.f[0], d.f[1], d.f[2], d.f[3], y, dw, db);
  std::vector<float> y_g(y_c.size()), dw_g(dw_c.size()), db_g(db_c.size());
  dev.copy(y_g.data(), y, y_g.size() * 4);
  dev.copy(dw_g.data(), dw, dw_g.size() * 4);
  dev.copy(db_g.data(), db, db_g.size() * 4);
  dev.synchronize();
  for (auto* p : {y, dw, db}) gpu.deallocate(p, 0);
  check(kc::max_rel_diff(y_g, y_c) <= 1e-4, "backend_ref: a linear forward on the GPU against the CPU");
  check(kc::max_rel_diff(dw_g, dw_c) <= 1e-4, "backend_ref: dW on the GPU against the CPU");
  check(kc::max_rel_diff(db_g, db_c) <= 1e-4, "backend_ref: db on the GPU against the CPU");
  std::printf("backend_ref: a linear layer's forward and weight gradients on the GPU match the CPU (bias gradient %s)\n",
              gpu.fused_bias_grads() > 0 ? "in the GEMM's epilogue" : "by a column reduction: cuBLASLt refused the epilogue");
  // the weight gradients at shapes of multiples of 16, with db aligned and with db one float off (cuBLASLt
  // takes the first or says no; either way the values are the CPU's to rounding)
  {
    const index_t R2 = 64, out2 = 32, in2 = 48;
    std::vector<float> x2(R2 * in2), dy2(R2 * out2), dw_c2(out2 * in2), db_c2(out2);
    for (std::size_t i = 0; i < x2.size(); ++i) x2[i] = static_cast<float>((i * 29) % 23) / 11.f - 1.f;
    for (std::size_t i = 0; i < dy2.size(); ++i) dy2[i] = static_cast<float>((i * 13) % 19) / 9.f - 1.f;
    host.linear_weight_grads(R2, out2, in2, dy2.data(), x2.data(), dw_c2.data(), db_c2.data(), false);
    auto* dx2 = static_cast<float*>(gpu.allocate(x2.size() * 4));
    auto* ddy2 = static_cast<float*>(gpu.allocate(dy2.size() * 4));
    auto* ddw2 = static_cast<float*>(gpu.allocate(dw_c2.size() * 4));
    auto* ddb2 = static_cast<float*>(gpu.allocate((db_c2.size() + 1) * 4));
    gpu.copy(dx2, x2.data(), x2.size() * 4), gpu.copy(ddy2, dy2.data(), dy2.size() * 4);
    for (const int off : {0, 1}) {
      const auto fused_before = gpu.fused_bias_grads();
      dev.linear_weight_grads(R2, out2, in2, ddy2, dx2, ddw2, ddb2 + off, false);
      std::vector<float> dw_g2(dw_c2.size()), db_g2(db_c2.size());
      dev.copy(dw_g2.data(), ddw2, dw_g2.size() * 4);
      dev.copy(db_g2.data(), ddb2 + off, db_g2.size() * 4);
      dev.synchronize();
      const std::string what = std::string("weight gradients, db ") + (off ? "4 bytes off alignment" : "aligned") +
                               (gpu.fused_bias_grads() > fused_before ? " (epilogue)" : " (column reduction)");
      check(kc::max_rel_diff(dw_g2, dw_c2) <= 1e-4, what + ": dW against the CPU");
      check(kc::max_rel_diff(db_g2, db_c2) <= 1e-4, what + ": db against the CPU");
      std::printf("backend_ref: %s matches the CPU\n", what.c_str());
    }
    for (void* p : {static_cast<void*>(dx2), static_cast<void*>(ddy2), static_cast<void*>(ddw2), static_cast<void*>(ddb2)})
      gpu.deallocate(p, 0);
  }
  // a GEMM with its bias in the epilogue (cuBLASLt's BIAS), bias aligned and one float off, in both transposes of B:
  // the CPU's values (the bias written, then the product added) to rounding, whether cuBLASLt takes it or not
  {
    const index_t M = 64, N = 48, K = 32;
    std::vector<float> a(M * K), b(N * K), bias(N + 1);
    for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>((i * 31) % 29) / 13.f - 1.f;
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>((i * 17) % 23) / 11.f - 1.f;
    for (std::size_t i = 0; i < bias.size(); ++i) bias[i] = static_cast<float>(i % 7) - 3.f;
    auto* da = static_cast<float*>(gpu.allocate(a.size() * 4));
    auto* db = static_cast<float*>(gpu.allocate(b.size() * 4));
    auto* dbias = static_cast<float*>(gpu.allocate(bias.size() * 4));
    auto* dc = static_cast<float*>(gpu.allocate(M * N * 4));
    gpu.copy(da, a.data(), a.size() * 4), gpu.copy(db, b.data(), b.size() * 4), gpu.copy(dbias, bias.data(), bias.size() * 4);
    for (const trans tb : {trans::yes, trans::no})
      for (const int off : {0, 1}) {
        std::vector<float> c_cpu(M * N), c_gpu(M * N);
        host.gemm_bias(trans::no, tb, M, N, K, a.data(), b.data(), bias.data() + off, c_cpu.data());
        const auto fused_before = gpu.fused_biases();
        dev.gemm_bias(trans::no, tb, M, N, K, da, db, dbias + off, dc);
        dev.copy(c_gpu.data(), dc, c_gpu.size() * 4);
        dev.synchronize();
        const std::string what = std::string("a GEMM with its bias (B ") + (tb == trans::yes ? "transposed" : "as stored") +
                                 ", bias " + (off ? "4 bytes off alignment" : "aligned") +
                                 (gpu.fused_biases() > fused_before ? ", epilogue)" : ", bias written first)");
        check(kc::max_rel_diff(c_gpu, c_cpu) <= 1e-4, what + " against the CPU");
        std::printf("backend_ref: %s matches the CPU\n", what.c_str());
      }
    for (void* p : {static_cast<void*>(da), static_cast<void*>(db), static_cast<void*>(dbias), static_cast<void*>(dc)})
      gpu.deallocate(p, 0);
  }
  // GELU in the GEMM's call (cuBLASLt's GELU_AUX_BIAS forward, DGELU backward) against the CPU's GEMM and
  // GELU kernels: the epilogue's GELU is the tanh form too (1e-3 of each tensor's largest value: its tanh is not ours)
  {
    const index_t M = 64, N = 48, K = 32;
    std::vector<float> a(M * K), b(N * K), bias(N);
    for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>((i * 31) % 29) / 13.f - 1.f;
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>((i * 17) % 23) / 11.f - 1.f;
    for (std::size_t i = 0; i < bias.size(); ++i) bias[i] = static_cast<float>(i % 7) / 4.f - 0.75f;
    std::vector<float> pre_c(M * N), out_c(M * N), dx_c(M * N);
    host.gemm_gelu({trans::no, trans::yes, M, N, K, a.data(), b.data(), bias.data(), pre_c.data(), out_c.data(), false, false});
    // backward: d(pre) = (dh2 W) GELU'(pre), with dh2 (M, K2) and W (K2, N)
    const index_t K2 = 40;
    std::vector<float> dh2(M * K2), w2(K2 * N);
    for (std::size_t i = 0; i < dh2.size(); ++i) dh2[i] = static_cast<float>((i * 11) % 17) / 8.f - 1.f;
    for (std::size_t i = 0; i < w2.size(); ++i) w2[i] = static_cast<float>((i * 5) % 19) / 9.f - 1.f;
    host.gemm_gelu({trans::no, trans::no, M, N, K2, dh2.data(), w2.data(), nullptr, pre_c.data(), dx_c.data(), true, false});
    auto up = [&](const std::vector<float>& v) {
      auto* p = static_cast<float*>(gpu.allocate(v.size() * 4));
      gpu.copy(p, v.data(), v.size() * 4);
      return p;
    };
    float *da = up(a), *db = up(b), *dbias = up(bias), *ddh2 = up(dh2), *dw2 = up(w2);
    auto* dpre = static_cast<float*>(gpu.allocate(M * N * 4));
    auto* dout = static_cast<float*>(gpu.allocate(M * N * 4));
    auto* ddx = static_cast<float*>(gpu.allocate(M * N * 4));
    const auto fused_before = gpu.fused_gelus();
    dev.gemm_gelu({trans::no, trans::yes, M, N, K, da, db, dbias, dpre, dout, false, false});
    dev.gemm_gelu({trans::no, trans::no, M, N, K2, ddh2, dw2, nullptr, dpre, ddx, true, false});
    std::vector<float> pre_g(M * N), out_g(M * N), dx_g(M * N);
    dev.copy(pre_g.data(), dpre, pre_g.size() * 4);
    dev.copy(out_g.data(), dout, out_g.size() * 4);
    dev.copy(dx_g.data(), ddx, dx_g.size() * 4);
    dev.synchronize();
    const std::string how = gpu.fused_gelus() - fused_before == 2 ? " (epilogues)" : " (a kernel after the GEMM, at least once)";
    check(kc::max_rel_diff(pre_g, pre_c) <= 1e-4, "GELU in the GEMM: its argument against the CPU" + how);
    check(kc::max_rel_diff(out_g, out_c) <= 1e-3, "GELU in the GEMM: GELU against the CPU" + how);
    check(kc::max_rel_diff(dx_g, dx_c) <= 1e-3, "GELU's gradient in the GEMM against the CPU" + how);
    std::printf("backend_ref: GELU and its gradient in the GEMM's call match the CPU%s\n", how.c_str());
    for (void* p : {static_cast<void*>(da), static_cast<void*>(db), static_cast<void*>(dbias), static_cast<void*>(ddh2),
                    static_cast<void*>(dw2), static_cast<void*>(dpre), static_cast<void*>(dout), static_cast<void*>(ddx)})
      gpu.deallocate(p, 0);
  }
  // per-kind timing: a GEMM and a kernel body, each counted once under its kind
  {
    auto* buf = static_cast<float*>(gpu.allocate(64 * 64 * 4 * 3));
    gpu.fill_zero(buf, 64 * 64 * 4 * 3);
    gpu.set_kernel_timing(true);
    dev.gemm(trans::no, trans::no, 64, 64, 64, 1.f, buf, buf + 4096, 0.f, buf + 8192);
    dev.launch(4096, kernels::scale{buf, 2.f});
    auto times = gpu.kernel_times();
    gpu.set_kernel_timing(false);
    check(times.count("gemm") == 1 && times["gemm"].calls == 1, "kernel timing: one GEMM counted");
    check(times.count("elementwise") == 1 && times["elementwise"].calls == 1, "kernel timing: one body counted");
    check(gpu.kernel_times().empty(), "kernel timing: the marks are forgotten once read");
    gpu.deallocate(buf, 0);
  }
}

// Causal attention as one backend call on the GPU against the CPU's steps:
// fp32 (the batched-GEMM steps on both; tolerance 1e-4 of each tensor's
// largest value: the same products in cuBLAS's order) and, in a build linked
// with whale::cudnn, bf16 through cuDNN's fused flash attention (tolerance
// 2e-2 of each tensor's largest value, 3e-2 for d(qkv): bf16 operands carry 8
// bits, and cuDNN rounds P to bf16 before P V). Shapes: gpt-gpu's head width
// 64 at T 256, and T 100 with 3 heads (T not a multiple of cuDNN's tiles).
void attention_on_gpu(cuda_backend& gpu) {
  struct shape_case {
    index_t B, T, H, hd;
  };
  for (const auto [B, T, H, hd] : {shape_case{2, 256, 4, 64}, shape_case{1, 100, 3, 64}}) {
    const index_t W = H * hd, R = B * T;
    std::vector<float> qkv(R * 3 * W), dout(R * W);
    std::uint32_t seed = 99;
    for (auto* v : {&qkv, &dout})
      for (auto& x : *v) {
        seed = seed * 1664525u + 1013904223u;
        x = static_cast<float>(seed >> 8) / 16777216.f * 2.f - 1.f;
      }
    std::vector<float> o(R * W), lse(B * H * T), dqkv(R * 3 * W);
    const backend_ref host, dev(gpu);
    host.attention_forward(B, T, H, hd, qkv.data(), o.data(), lse.data());
    host.attention_backward(B, T, H, hd, qkv.data(), o.data(), lse.data(), dout.data(), dqkv.data());
    auto worst = [](const std::vector<float>& x, const std::vector<float>& ref) {
      double scale = 1, e = 0;
      for (const float r : ref) scale = std::max(scale, static_cast<double>(std::fabs(r)));
      for (std::size_t i = 0; i < x.size(); ++i) e = std::max(e, static_cast<double>(std::fabs(x[i] - ref[i])));
      return e / scale;
    };
    for (const int mode : {0, 1, 2}) {  // fp32; bf16; bf16 with the forward's bf16 operands kept for the backward
      const bool bf16 = mode > 0;
      const index_t kept_floats = mode == 2 ? dev.attention_packed_floats(R, W, true) : 0;
      float* kept = kept_floats ? static_cast<float*>(gpu.allocate(static_cast<std::size_t>(kept_floats) * 4)) : nullptr;
      auto* d_qkv = static_cast<float*>(gpu.allocate(qkv.size() * 4));
      auto* d_dout = static_cast<float*>(gpu.allocate(dout.size() * 4));
      auto* d_o = static_cast<float*>(gpu.allocate(o.size() * 4));
      auto* d_lse = static_cast<float*>(gpu.allocate(lse.size() * 4));
      auto* d_dqkv = static_cast<float*>(gpu.allocate(dqkv.size() * 4));
      dev.copy(d_qkv, qkv.data(), qkv.size() * 4);
      dev.copy(d_dout, dout.data(), dout.size() * 4);
      const auto fused_before = gpu.fused_attention_calls();
      dev.attention_forward(B, T, H, hd, d_qkv, d_o, d_lse, bf16, kept);
      dev.attention_backward(B, T, H, hd, d_qkv, d_o, d_lse, d_dout, d_dqkv, bf16, kept);
      std::vector<float> o_g(o.size()), lse_g(lse.size()), dqkv_g(dqkv.size());
      dev.copy(o_g.data(), d_o, o_g.size() * 4);
      dev.copy(lse_g.data(), d_lse, lse_g.size() * 4);
      dev.copy(dqkv_g.data(), d_dqkv, dqkv_g.size() * 4);
      dev.synchronize();
      for (auto* p : {d_qkv, d_dout, d_o, d_lse, d_dqkv}) gpu.deallocate(p, 0);
      if (kept) gpu.deallocate(kept, 0);
      const bool fused = gpu.fused_attention_calls() == fused_before + 2;
      const std::string what = "attention B " + std::to_string(B) + " T " + std::to_string(T) + " H " +
                               std::to_string(H) + (bf16 ? (fused ? " (bf16, cuDNN)" : " (bf16, steps)") : " (fp32)") +
                               (kept ? ", operands kept" : "");
      // cuDNN: bf16 operands carry 8 bits, and o and d(qkv) come back as bf16; the steps run in fp32
      const double tol = fused ? 2e-2 : 1e-4, dtol = fused ? 3e-2 : 1e-4;
      const double eo = worst(o_g, o), el = worst(lse_g, lse), ed = worst(dqkv_g, dqkv);
      check(eo <= tol, what + ": output differs from the CPU by " + std::to_string(eo));
      check(el <= tol, what + ": log-sum-exp differs from the CPU by " + std::to_string(el));
      check(ed <= dtol, what + ": d(qkv) differs from the CPU by " + std::to_string(ed));
#if defined(WHALE_HAS_CUDNN_FRONTEND)
      check(!bf16 || fused, what + ": cuDNN's fused attention was not taken");
#endif
      std::printf("%s: output %.2e, lse %.2e, d(qkv) %.2e from the CPU\n", what.c_str(), eo, el, ed);
    }
  }
}

void allocator_steady_state(cuda_backend& gpu) {
  const auto before = gpu.allocator().upstream_allocations;
  std::int64_t after_first = 0;
  for (int step = 0; step < 5; ++step) {
    std::vector<void*> held;
    for (std::size_t n : {std::size_t{1000}, std::size_t{3} << 20, std::size_t{64} << 10}) held.push_back(gpu.allocate(n));
    for (void* p : held) gpu.deallocate(p, 0);
    if (step == 0) after_first = gpu.allocator().upstream_allocations;
  }
  check(gpu.allocator().upstream_allocations == after_first,
        "caching allocator: cudaMalloc calls after the first step: " +
            std::to_string(gpu.allocator().upstream_allocations - after_first));
  std::printf("allocator: %lld cudaMalloc calls in all (%lld before this test), none after the first step\n",
              static_cast<long long>(gpu.allocator().upstream_allocations), static_cast<long long>(before));
}
}  // namespace

int main() {
  if (cuda_device_count() == 0) {
    std::printf("cuda_backend: skipped: no CUDA device\n");
    return 77;
  }
  try {
    cuda_backend gpu;
    kernel_bodies(gpu);
    gemms(gpu);
    backend_ref_on_gpu(gpu);
    attention_on_gpu(gpu);
    allocator_steady_state(gpu);
  } catch (const std::exception& e) {
    std::printf("FAILED: %s\n", e.what());
    return 1;
  }
  std::printf("cuda_backend: %s\n", failures ? "FAILED" : "all checks passed");
  return failures ? 1 : 0;
}
