// The GPU's GEMM limit at a model's own shapes: every GEMM of one training step
// of `gpt-gpu` (12 layers, width 1024, 16 heads, seq 1024, vocab 32768; 8
// sequences), or of GPT-2 124M's shape with --model gpt2-124m (width 768, 12
// heads, vocab 50304, untied head) -- forward, input gradient and weight
// gradient of each projection, the attention products per head
// (strided-batched), the LM head -- timed alone through cuda_backend on
// operands of hashed values (never zeros), in bf16 (inputs bf16, fp32
// accumulation; fp32 and TF32 with --precision). Prints one JSON line: the
// step's GEMM FLOPs, their time and the rate (the denominator of MFU). Under
// bf16 a line before it times the same GEMMs as the layers run them: fp32
// operands holding bf16 values, cuBLASLt's bf16 math. With --step S it then
// trains the model on the GPU with the trainer, as a program does: every
// layer through backend_ref on cuda_backend, parameters, gradients, AdamW
// state and activations in device memory, S steps in one run() that reads
// the losses once at its end (trainer_options::log_every = S), after 2
// warm-up steps; a line gives the step (the run's time over S), tokens/s,
// model FLOPs by the workloads.md formula, and MFU against the GEMM rate of
// the last limit line and against the dense bf16 peak (989 TFLOP/s). Then 3
// more steps with CUDA events around every call: one line per kind of work
// (gemm, attention, row, column_reduction, optimizer, elementwise) with its
// GPU milliseconds a step.
// With bf16, --step trains under bf16 mixed precision as the layers do it on
// a GPU today: bf16 storage emulated by rounding (the producing kernels store
// rounded values, the trainer rounds the weights), GEMMs on the bf16 tensor
// cores (the trainer's bf16 products), bias gradients in the weight GEMM's
// epilogue, attention through cuDNN's fused call where the program is linked
// with whale::cudnn (the line counts the fused calls and the epilogues).
// Without a GPU: a clear error, exit 2.
//
//   gpu_gemm [--model gpt-gpu|gpt2-124m] [--precision bf16|fp32|tf32] [--reps R] [--sequences B] [--step S]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "whale/backend/cuda.hpp"
#include "whale/detail/parse.hpp"
#include "whale/models/gpt.hpp"
#include "whale/nn/network.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/train/data.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;

namespace {
struct shape_t {
  const char* what;
  trans ta, tb;
  index_t M, N, K, count;  // count > 1: strided-batched
  int per_step;            // how many times one step runs it
};

// GEMMs of one step (forward + backward) of a decoder with width D, FFN 4D,
// H heads, B sequences of T tokens, L layers, vocabulary V.
std::vector<shape_t> step_gemms(index_t B, index_t T, index_t D, index_t H, index_t L, index_t V) {
  const index_t R = B * T, hd = D / H;
  const int l = static_cast<int>(L);
  return {
      {"qkv fwd", trans::no, trans::yes, R, 3 * D, D, 1, l},
      {"qkv dx", trans::no, trans::no, R, D, 3 * D, 1, l},
      {"qkv dw", trans::yes, trans::no, 3 * D, D, R, 1, l},
      {"out fwd", trans::no, trans::yes, R, D, D, 1, l},
      {"out dx", trans::no, trans::no, R, D, D, 1, l},
      {"out dw", trans::yes, trans::no, D, D, R, 1, l},
      {"fc1 fwd", trans::no, trans::yes, R, 4 * D, D, 1, l},
      {"fc1 dx", trans::no, trans::no, R, D, 4 * D, 1, l},
      {"fc1 dw", trans::yes, trans::no, 4 * D, D, R, 1, l},
      {"fc2 fwd", trans::no, trans::yes, R, D, 4 * D, 1, l},
      {"fc2 dx", trans::no, trans::no, R, 4 * D, D, 1, l},
      {"fc2 dw", trans::yes, trans::no, D, 4 * D, R, 1, l},
      {"scores QK^T", trans::no, trans::yes, T, T, hd, B * H, l},
      {"P V", trans::no, trans::no, T, hd, T, B * H, l},
      {"dP = dO V^T", trans::no, trans::yes, T, T, hd, B * H, l},
      {"dV = P^T dO", trans::yes, trans::no, T, hd, T, B * H, l},
      {"dQ = dS K", trans::no, trans::no, T, hd, T, B * H, l},
      {"dK = dS^T Q", trans::yes, trans::no, T, hd, T, B * H, l},
      {"lm head fwd", trans::no, trans::yes, R, V, D, 1, 1},
      {"lm head dx", trans::no, trans::no, R, D, V, 1, 1},
      {"lm head dw", trans::yes, trans::no, V, D, R, 1, 1},
  };
}
/// The two decoders measured: gpt-gpu (workloads.md) and GPT-2 124M's shape (untied head).
struct model_shape {
  const char* name;
  index_t V, T, D, H, L;
};
constexpr model_shape gpt_gpu_shape{"gpt-gpu", 32768, 1024, 1024, 16, 12};
constexpr model_shape gpt2_shape{"gpt2-124m", 50304, 1024, 768, 12, 12};

// A decoder of shape `m` trained on the GPU by the trainer, as a user trains
// it: 2 warm-up steps, then `steps` steps in one run() with log_every = steps,
// so the host reads the losses once, after the last step, and never waits in
// between. The step time is the run's wall time over its steps. One JSON line.
template <class Model>
void train_steps(cuda_backend& gpu, const model_shape& m, const std::string& precision, index_t B, index_t steps,
                 double gemm_rate) {
  network<Model> net(seed{1}, backend_ref(gpu), precision == "bf16" ? whale::precision::bf16 : whale::precision::fp32);
  markov_data data(seed{7}, m.V, m.T, B);
  trainer_options o;
  o.progress = false;
  o.max_grad_norm = 1.0;
  o.log_every = steps;
  trainer t(net, adamw{.lr = 1e-4f}, o);  // under bf16 it turns on the GPU's bf16 products for each step
  const auto warm = t.run(data, whale::steps{2});
  const auto mallocs_warm = gpu.allocator().upstream_allocations;
  const auto fused_before = gpu.fused_attention_calls();
  const auto bias_before = gpu.fused_bias_grads();
  const auto biases_before = gpu.fused_biases();
  const auto gelus_before = gpu.fused_gelus();
  gpu.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = t.run(data, whale::steps{steps});
  gpu.synchronize();
  const double step = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / static_cast<double>(steps);
  // workloads.md: 6 x params (without the token and position tables) x tokens, plus attention's 12 L T^2 D B
  const double params = static_cast<double>(net.param_count() - m.V * m.D - m.T * m.D);
  const double model_flops = 6.0 * params * static_cast<double>(B * m.T) +
                             12.0 * static_cast<double>(m.L * m.T * m.T * m.D) * static_cast<double>(B);
  std::printf("{\"workload\": \"%s\", \"backend\": \"cuda\", \"plan\": \"single\", \"precision\": \"%s\", "
              "\"sequences\": %lld, \"seq\": %lld, \"steps\": %lld, \"host_reads\": 1, \"step_s\": %.6g, \"tokens_per_s\": %.6g, "
              "\"model_flops_per_step\": %.6g, \"achieved_tflops\": %.3f, \"gemm_tflops\": %.3f, \"mfu_vs_gemm\": %.4f, "
              "\"mfu_vs_dense_bf16_peak\": %.4f, \"loss_first\": %.6g, \"loss_last\": %.6g, \"cuda_mallocs_after_warmup\": %lld, "
              "\"device_bytes_peak\": %lld, \"layers\": \"%s\", \"fused_attention_calls\": %lld, "
              "\"bias_grad_epilogues\": %lld, \"bias_epilogues\": %lld, \"gelu_epilogues\": %lld, \"cublaslt_refused_plans\": %lld}\n",
              m.name, precision.c_str(), static_cast<long long>(B), static_cast<long long>(m.T), static_cast<long long>(steps),
              step, static_cast<double>(B * m.T) / step, model_flops, model_flops / step / 1e12, gemm_rate / 1e12,
              model_flops / step / gemm_rate, model_flops / step / 989e12, warm.loss_first(), r.loss_last(),
              static_cast<long long>(gpu.allocator().upstream_allocations - mallocs_warm),
              static_cast<long long>(gpu.allocator().peak_bytes_in_use),
              precision == "bf16" ? "bf16 storage emulated by rounding, GEMMs on bf16 tensor cores, biases, GELU and bias "
                                    "gradients in the GEMM epilogues, attention fused by cuDNN where linked"
                                  : "fp32 storage, GEMMs in the backend's math, biases, GELU and bias gradients in the GEMM epilogues",
              static_cast<long long>(gpu.fused_attention_calls() - fused_before),
              static_cast<long long>(gpu.fused_bias_grads() - bias_before),
              static_cast<long long>(gpu.fused_biases() - biases_before),
              static_cast<long long>(gpu.fused_gelus() - gelus_before), static_cast<long long>(gpu.lt_refused_plans()));
  // where the time goes: CUDA events around every call of a few more steps, summed by kind of work
  constexpr index_t profiled = 3;
  gpu.set_kernel_timing(true);
  t.run(data, whale::steps{profiled});
  const auto times = gpu.kernel_times();
  gpu.set_kernel_timing(false);
  double total = 0;
  for (const auto& [what, k] : times) total += k.ms;
  for (const auto& [what, k] : times)
    std::printf("{\"workload\": \"%s\", \"backend\": \"cuda\", \"measure\": \"kernel_class\", \"precision\": \"%s\", "
                "\"class\": \"%s\", \"ms_per_step\": %.4f, \"calls_per_step\": %.1f, \"share_of_timed\": %.4f, "
                "\"step_s_untimed\": %.6g}\n",
                m.name, precision.c_str(), what.c_str(), k.ms / profiled, static_cast<double>(k.calls) / profiled,
                total > 0 ? k.ms / total : 0.0, step);
}

/// Fills x[0, n) with values in [-1, 1) from a hash of the index (never zeros: a GEMM on zeros runs faster).
struct fill_hashed {
  float* x;
  std::uint32_t salt;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u ^ salt;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    x[i] = (static_cast<float>(h >> 8) + 0.5f) * (2.f / 16777216.f) - 1.f;  // (k + 1/2) 2^-23 - 1: never 0
  }
};
}  // namespace

int main(int argc, char** argv) {
  try {
    std::string precision = "bf16";
    index_t reps = 10, B = 8, steps = 0;
    model_shape m = gpt_gpu_shape;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--precision" && i + 1 < argc) {
        precision = argv[++i];
        if (precision != "bf16" && precision != "fp32" && precision != "tf32")
          throw std::invalid_argument("gpu_gemm: --precision '" + precision + "': expected bf16, fp32 or tf32");
      } else if (a == "--reps" && i + 1 < argc) reps = detail::parse_int(argv[++i], "--reps", 1, 1000);
      else if (a == "--sequences" && i + 1 < argc) B = detail::parse_int(argv[++i], "--sequences", 1, 512);
      else if (a == "--step" && i + 1 < argc) steps = detail::parse_int(argv[++i], "--step", 1, 1000);
      else if (a == "--model" && i + 1 < argc) {
        const std::string v = argv[++i];
        if (v == gpt_gpu_shape.name) m = gpt_gpu_shape;
        else if (v == gpt2_shape.name) m = gpt2_shape;
        else throw std::invalid_argument("gpu_gemm: --model '" + v + "': expected gpt-gpu or gpt2-124m");
      } else throw std::invalid_argument("gpu_gemm: unknown argument " + a + " (have --precision, --reps, --sequences, --step, --model)");
    }
    if (cuda_device_count() == 0) {
      std::fprintf(stderr, "gpu_gemm: no CUDA device found: the GPU benchmark needs a GPU (use the CPU backend here)\n");
      return 2;
    }
    cuda_backend gpu;
    gpu.set_tf32(precision == "tf32");
    const index_t T = m.T;
    const auto gemms = step_gemms(B, m.T, m.D, m.H, m.L, m.V);
    std::size_t most = 0;
    for (const auto& g : gemms) most = std::max({most, static_cast<std::size_t>(g.M * g.K * g.count),
                                                 static_cast<std::size_t>(g.K * g.N * g.count),
                                                 static_cast<std::size_t>(g.M * g.N * g.count)});
    // operands of hashed values, never zeros (bf16: rounded, then packed below)
    void* A = gpu.allocate(most * 4);
    void* Bm = gpu.allocate(most * 4);
    void* C = gpu.allocate(most * 4);
    const auto n_most = static_cast<index_t>(most);
    gpu.launch(n_most, fill_hashed{static_cast<float*>(A), 1u});
    gpu.launch(n_most, fill_hashed{static_cast<float*>(Bm), 2u});
    gpu.fill_zero(C, most * 4);
    bool fp32_operands = precision != "bf16";  // bf16: a second pass times the layers' form (fp32 operands, bf16 math)
    auto run = [&](const shape_t& g) {
      const index_t lda = g.ta == trans::yes ? g.M : g.K, ldb = g.tb == trans::yes ? g.K : g.N;
      if (!fp32_operands) {
        if (g.count == 1) gpu.gemm_bf16(g.ta, g.tb, g.M, g.N, g.K, 1.f, A, lda, Bm, ldb, 0.f, C, g.N, true);
        else
          for (index_t b = 0; b < g.count; ++b)  // per problem: cublasGemmStridedBatchedEx is the next step
            gpu.gemm_bf16(g.ta, g.tb, g.M, g.N, g.K, 1.f, static_cast<char*>(A) + b * g.M * g.K * 2, lda,
                          static_cast<char*>(Bm) + b * g.K * g.N * 2, ldb, 0.f,
                          static_cast<char*>(C) + b * g.M * g.N * 2, g.N, true);
      } else if (g.count == 1) {
        gpu.gemm(g.ta, g.tb, g.M, g.N, g.K, 1.f, static_cast<float*>(A), lda, static_cast<float*>(Bm), ldb, 0.f,
                 static_cast<float*>(C), g.N);
      } else {
        gpu.gemm_strided_batched(g.ta, g.tb, g.M, g.N, g.K, 1.f, static_cast<float*>(A), lda, g.M * g.K,
                                 static_cast<float*>(Bm), ldb, g.K * g.N, 0.f, static_cast<float*>(C), g.N,
                                 g.M * g.N, g.count);
      }
    };
    double flops = 0, seconds = 0;
    auto measure = [&](const char* measure_name) {
      flops = 0, seconds = 0;
      std::string per_shape;
      for (const auto& g : gemms) {
        run(g);  // warm-up (cuBLASLt plans, workspace)
        gpu.synchronize();
        const auto t0 = std::chrono::steady_clock::now();
        for (index_t r = 0; r < reps; ++r) run(g);
        gpu.synchronize();
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
        const double f = 2.0 * g.M * g.N * g.K * g.count;
        flops += f * g.per_step;
        seconds += s * g.per_step;
        char b[160];
        std::snprintf(b, sizeof b, "%s\"%s\": %.1f", per_shape.empty() ? "" : ", ", g.what, f / s / 1e12);
        per_shape += b;
      }
      std::printf("{\"workload\": \"%s\", \"backend\": \"cuda\", \"measure\": \"%s\", \"precision\": \"%s\", "
                  "\"sequences\": %lld, \"seq\": %lld, \"gemm_flops_per_step\": %.6g, \"gemm_only_step_s\": %.6g, "
                  "\"gemm_tflops\": %.2f, \"tflops_by_shape\": {%s}, \"cuda_mallocs\": %lld}\n",
                  m.name, measure_name, precision.c_str(), static_cast<long long>(B), static_cast<long long>(T), flops,
                  seconds, flops / seconds / 1e12, per_shape.c_str(),
                  static_cast<long long>(gpu.allocator().upstream_allocations));
    };
    if (precision == "bf16") {
      // the layers' form first: fp32 operands holding bf16 values, multiplied on the bf16 tensor cores
      // (the batched products stay fp32 there, as attention's unfused steps run them)
      fp32_operands = true;
      gpu.set_math(gemm_math::bf16);
      gpu.launch(n_most, fill_hashed{static_cast<float*>(A), 1u});
      gpu.launch(n_most, fill_hashed{static_cast<float*>(Bm), 2u});
      gpu.launch(n_most, kernels::to_bf16{static_cast<float*>(A)});
      gpu.launch(n_most, kernels::to_bf16{static_cast<float*>(Bm)});
      measure("gemm_limit_fp32_operands_bf16_math");
      gpu.set_math(gemm_math::fp32);
      gpu.launch(n_most, kernels::pack_bf16{static_cast<float*>(A), static_cast<std::uint16_t*>(C)});
      gpu.copy(A, C, most * 2);
      gpu.launch(n_most, kernels::pack_bf16{static_cast<float*>(Bm), static_cast<std::uint16_t*>(C)});
      gpu.copy(Bm, C, most * 2);
      fp32_operands = false;
    }
    measure("gemm_limit");  // the denominator of MFU: bf16 operands in bf16 storage, or fp32 / TF32
    for (void* p : {A, Bm, C}) gpu.deallocate(p, 0);
    if (steps > 0) {
      if (m.D == gpt_gpu_shape.D)
        train_steps<models::gpt_model<gpt_gpu_shape.V, gpt_gpu_shape.T, gpt_gpu_shape.D, gpt_gpu_shape.H,
                                      4 * gpt_gpu_shape.D, gpt_gpu_shape.L>>(gpu, m, precision, B, steps, flops / seconds);
      else
        train_steps<models::gpt_model<gpt2_shape.V, gpt2_shape.T, gpt2_shape.D, gpt2_shape.H, 4 * gpt2_shape.D,
                                      gpt2_shape.L>>(gpu, m, precision, B, steps, flops / seconds);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_gemm: %s\n", e.what());
    return 2;
  }
}
