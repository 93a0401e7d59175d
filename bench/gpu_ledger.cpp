// The GPU step without a GPU: gpt-gpu (12 blocks, width 1024, 16 heads, FFN
// 4096, seq 1024, vocabulary 32768, untied head; 8 sequences) trained on the
// guarded backend, which runs every GPU code path and keeps a ledger of what
// a GPU would be asked to do. At this size the CPU cannot compute a step in
// reasonable time, so the backend counts without computing (count_only): every
// launch, GEMM, copy, fill and host wait is recorded exactly as a computed
// step records it (tests/test_kernel_shapes.cpp checks that), and nothing is
// computed or touched. One JSON line per step after the first: the counts,
// and an H200 step predicted by a roofline: GEMMs and attention's products at
// --matmul-tflops (default 0.7 x the dense bf16 peak of 989 TFLOP/s), every
// other kernel's declared bytes at 4.0 TB/s, scaled down for launches that
// fill less of the GPU than one 256-thread block per SM (device_ledger), and
// 3 us per launch. A 1-block model of the same width gives launches per block.
// --workload gpt2-124m: GPT-2 124M's shape instead (12 blocks, width 768, 12
// heads, FFN 3072, seq 1024, vocabulary 50,304, the head tied to the table;
// 8 sequences), as scripts/gpu-check trains it.
//
// Under bf16 the attention is the CUDA backend's fused cuDNN call, as a
// program linked with whale::cudnn runs it (--attention steps: the batched-GEMM
// steps instead, as without cuDNN; fp32 always takes those). Each fully
// connected layer's bias gradient comes from its weight GEMM's epilogue, and
// biases and GELU ride on the GEMMs before them, as the CUDA backend's
// cuBLASLt computes them (--bias-grads reduction: no epilogue at all, a column
// reduction, a bias pass and a GELU kernel instead, as where cuBLASLt has no
// such algorithm).
//
//   gpu_ledger [--workload gpt-gpu|gpt2-124m] [--steps S] [--precision fp32|bf16] [--attention fused|steps]
//              [--bias-grads epilogue|reduction] [--matmul-tflops X] [--kernels]
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/guarded.hpp"
#include "whale/detail/parse.hpp"
#include "whale/models/gpt.hpp"
#include "whale/models/gpt2.hpp"
#include "whale/nn/network.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/train/data.hpp"
#include "whale/train/ledger.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;

namespace {
constexpr index_t B = 8, T = 1024, Blocks = 12;

/// The two shapes: gpt-gpu (workloads.md) and GPT-2 124M's (vocabulary padded to 50,304).
template <std::size_t L> using gpt_gpu = models::gpt_model<32768, T, 1024, 16, 4096, L>;
template <std::size_t L> using gpt2_124m = models::gpt2<L, 768, 12, 50304, T>;
struct shape {
  const char* name;
  index_t V, D;
};
constexpr shape gpt_gpu_shape{"gpt-gpu", 32768, 1024}, gpt2_shape{"gpt2-124m", 50304, 768};

struct options {
  shape w = gpt_gpu_shape;
  index_t steps = 3;
  bool bf16 = false, kernels = false, fused_attention = true, bias_grad_epilogue = true;
  double matmul_rate = 0.7 * 989e12, bytes_rate = 4.0e12, launch_s = 3e-6;
};

/// Ledgers of single training steps of gpt_model<..., L> on a count-only
/// guarded backend, as the trainer runs them with log_every > 1 (the loss,
/// the gradient norm and the clipping scale left in device memory), each
/// a steady step's (steady_step_ledger).
template <class Model> std::vector<device_ledger> ledgers(const options& o, index_t& params) {
  guarded_backend g(std::size_t{64} << 30);  // address space only: count_only touches no page
  g.set_count_only(true);
  g.set_fused_attention(o.fused_attention);
  g.set_fused_bias_grads(o.bias_grad_epilogue);
  std::vector<device_ledger> out;
  {
    network<Model> net(seed{1}, backend_ref(g), o.bf16 ? precision::bf16 : precision::fp32);
    params = net.param_count();
    markov_data data(seed{2}, o.w.V, T, B);
    trainer_options to;
    to.progress = false;
    to.max_grad_norm = 1.0;
    to.log_every = 1000;
    trainer t(net, adamw{.lr = 1e-4f}, to);
    for (index_t s = 0; s < o.steps; ++s) out.push_back(steady_step_ledger(g, t, data));
  }
  return out;
}

void print(const options& o, const device_ledger& l, const device_ledger& one_block, index_t params, index_t step) {
  const double launches = static_cast<double>(l.launches());
  const double per_block = (launches - static_cast<double>(one_block.launches())) / static_cast<double>(Blocks - 1);
  const index_t V = o.w.V, D = o.w.D;
  const double attention_flops = l.batched_gemm_flops + l.attention_flops;
  const double matmul_s = (l.gemm_flops + attention_flops) / o.matmul_rate;
  const double bytes_s = (l.kernel_effective_bytes + static_cast<double>(l.copy_bytes + l.fill_bytes)) / o.bytes_rate;
  const double launch_s = launches * o.launch_s;
  const double step_s = matmul_s + bytes_s + launch_s;
  // workloads.md: 6 x params (without the token and position tables; a tied head's copy counted) x tokens,
  // plus attention's 12 L T^2 D B
  const double model_params = static_cast<double>(params - V * D - T * D);
  const double model_flops = 6.0 * model_params * B * T + 12.0 * Blocks * T * T * D * static_cast<double>(B);
  std::printf("{\"workload\": \"%s\", \"backend\": \"guarded\", \"ledger\": \"count_only\", \"precision\": \"%s\", "
              "\"attention\": \"%s\", \"attention_calls_per_step\": %lld, \"bias_grads\": \"%s\", "
              "\"bias_grad_epilogues_per_step\": %lld, "
              "\"step\": %lld, \"sequences\": %lld, \"seq\": %lld, \"launches_per_step\": %lld, "
              "\"kernel_launches_per_step\": %lld, \"gemm_calls_per_step\": %lld, \"batched_gemm_calls_per_step\": %lld, "
              "\"copies_per_step\": %lld, \"fills_per_step\": %lld, \"launches_per_block\": %.1f, "
              "\"host_syncs_per_step\": %lld, \"device_to_host_copies_per_step\": %lld, "
              "\"host_to_device_copies_per_step\": %lld, \"underfilled_launches_per_step\": %lld, "
              "\"undeclared_launches_per_step\": %lld, \"nongemm_bytes_per_step\": %lld, "
              "\"nongemm_effective_bytes_per_step\": %.6g, \"gemm_flops_per_step\": %.6g, "
              "\"attention_flops_per_step\": %.6g, \"model_flops_per_step\": %.6g, \"matmul_tflops\": %.1f, "
              "\"predicted_h200_matmul_s\": %.6g, \"predicted_h200_bytes_s\": %.6g, \"predicted_h200_launch_s\": %.6g, "
              "\"predicted_h200_step_s\": %.6g, \"predicted_h200_mfu\": %.4f}\n",
              o.w.name, o.bf16 ? "bf16" : "fp32", l.attention_calls > 0 ? "fused" : "batched GEMM steps",
              static_cast<long long>(l.attention_calls), l.bias_grad_epilogues > 0 ? "gemm epilogue" : "column reduction",
              static_cast<long long>(l.bias_grad_epilogues), static_cast<long long>(step), static_cast<long long>(B),
              static_cast<long long>(T), static_cast<long long>(l.launches()),
              static_cast<long long>(l.kernel_launches), static_cast<long long>(l.gemms),
              static_cast<long long>(l.batched_gemms), static_cast<long long>(l.copies), static_cast<long long>(l.fills),
              per_block, static_cast<long long>(l.host_syncs), static_cast<long long>(l.device_to_host),
              static_cast<long long>(l.host_to_device), static_cast<long long>(l.underfilled_launches),
              static_cast<long long>(l.undeclared_launches), static_cast<long long>(l.kernel_bytes + l.copy_bytes + l.fill_bytes),
              l.kernel_effective_bytes + static_cast<double>(l.copy_bytes + l.fill_bytes), l.gemm_flops,
              attention_flops, model_flops, o.matmul_rate / 1e12, matmul_s, bytes_s, launch_s, step_s,
              model_flops / step_s / 989e12);
  if (!o.kernels) return;
  // one line per kernel, slowest first by the same roofline
  std::vector<std::pair<double, std::string>> rows;
  for (const auto& [name, k] : l.kernels)
    rows.emplace_back(k.effective_bytes / o.bytes_rate + static_cast<double>(k.launches) * o.launch_s, name);
  std::sort(rows.rbegin(), rows.rend());
  for (const auto& [s, name] : rows) {
    const auto& k = l.kernels.at(name);
    std::printf("{\"workload\": \"%s\", \"ledger_kernel\": \"%s\", \"launches\": %lld, \"bytes\": %lld, "
                "\"effective_bytes\": %.6g, \"threads_min\": %lld, \"underfilled\": %lld, \"predicted_h200_s\": %.6g}\n",
                o.w.name, name.c_str(), static_cast<long long>(k.launches), static_cast<long long>(k.bytes), k.effective_bytes,
                static_cast<long long>(k.threads_min), static_cast<long long>(k.underfilled), s);
  }
}
}  // namespace

int main(int argc, char** argv) {
  try {
    options o;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const bool has = i + 1 < argc;
      if (a == "--workload" && has) {
        const std::string v = argv[++i];
        if (v == "gpt-gpu") o.w = gpt_gpu_shape;
        else if (v == "gpt2-124m") o.w = gpt2_shape;
        else throw std::invalid_argument("--workload '" + v + "': expected gpt-gpu or gpt2-124m");
      } else if (a == "--steps" && has) o.steps = detail::parse_int(argv[++i], "--steps", 1, 100);
      else if (a == "--precision" && has) {
        const std::string p = argv[++i];
        if (p != "fp32" && p != "bf16")
          throw std::invalid_argument("--precision '" + p + "': expected fp32 or bf16");
        o.bf16 = p == "bf16";
      } else if (a == "--matmul-tflops" && has) o.matmul_rate = 1e12 * static_cast<double>(detail::parse_int(argv[++i], "--matmul-tflops", 1, 100000));
      else if (a == "--kernels") o.kernels = true;
      else if (a == "--attention" && has) {
        const std::string v = argv[++i];
        if (v != "fused" && v != "steps") throw std::invalid_argument("--attention '" + v + "': expected fused or steps");
        o.fused_attention = v == "fused";
      } else if (a == "--bias-grads" && has) {
        const std::string v = argv[++i];
        if (v != "epilogue" && v != "reduction")
          throw std::invalid_argument("--bias-grads '" + v + "': expected epilogue or reduction");
        o.bias_grad_epilogue = v == "epilogue";
      } else
        throw std::invalid_argument("unknown argument " + a +
                                    " (have --workload gpt-gpu|gpt2-124m, --steps S, --precision fp32|bf16, --attention fused|steps, "
                                    "--bias-grads epilogue|reduction, --matmul-tflops X, --kernels)");
    }
    index_t params = 0, params1 = 0;
    const bool gpt2 = o.w.V == gpt2_shape.V;
    const auto one = gpt2 ? ledgers<gpt2_124m<1>>(o, params1) : ledgers<gpt_gpu<1>>(o, params1);
    const auto full = gpt2 ? ledgers<gpt2_124m<Blocks>>(o, params) : ledgers<gpt_gpu<Blocks>>(o, params);
    for (std::size_t s = 0; s < full.size(); ++s) print(o, full[s], one[s], params, static_cast<index_t>(s + 1));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_ledger: %s\n", e.what());
    return 2;
  }
}
