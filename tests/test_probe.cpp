// GPU steps priced from the layers' kernels (plan/probe.hpp, a profile's
// `kernels` mode in plan/simulate.hpp): the simulated single-GPU step of a GPT
// against the ledger of the same step trained on the count-only guarded
// backend (as bench/gpu_ledger prices it), term by term: GEMM and attention
// FLOPs, launches, and the other kernels' bytes.
#include <doctest/doctest.h>

#include <sstream>
#include <string>

#include "whale/backend/guarded.hpp"
#include "whale/models/gpt.hpp"
#include "whale/nn/network.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/plan/lower.hpp"
#include "whale/plan/memory.hpp"
#include "whale/plan/probe.hpp"
#include "whale/plan/simulate.hpp"
#include "whale/train/data.hpp"
#include "whale/train/ledger.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;

namespace {
using model = models::gpt;  // 4 blocks of width 256, 4 heads, FFN 1024, vocabulary 8192
constexpr index_t batch = 2, seq = models::gpt_seq;

/// One steady training step's ledger, AdamW with clipping, the loss left on the device.
device_ledger step_ledger(bool bf16) {
  guarded_backend g(std::size_t{8} << 30);
  g.set_count_only(true);
  g.set_fused_attention(true);
  g.set_fused_bias_grads(true);
  network<model> net(seed{1}, backend_ref(g), bf16 ? precision::bf16 : precision::fp32);
  markov_data data(seed{2}, model::vocab, seq, batch);
  trainer_options to;
  to.progress = false;
  to.max_grad_norm = 1.0;
  to.log_every = 1000;
  trainer t(net, adamw{.lr = 1e-4f}, to);
  return steady_step_ledger(g, t, data);
}

/// A profile that prices one term only: GEMM FLOPs at 1 TFLOP/s, bytes at 1 GB/s
/// or one second a launch, the other two free.
device_profile pricing(const char* term, bool bf16) {
  const bool flops = std::string(term) == "flops", bytes = std::string(term) == "bytes";
  std::istringstream in(std::string("device test\ngemm 1024 1024 1024 0 0 ") + (flops ? "1000" : "1e9") +
                        "\nbandwidth " + (bytes ? "1" : "1e6") + "\nkernels " + (bf16 ? "bf16" : "fp32") + " " +
                        (flops || bytes ? "0" : "1e6") +
                        "\nstreams 2\nlink node all_reduce 8 5 100\nlink node all_gather 8 5 100\nlink node reduce_scatter 8 5 100"
                        "\nlink node broadcast 8 5 100\nlink node p2p 2 5 100\n");
  return device_profile::parse(in, "test");
}

double simulated(const device_profile& dev, bool bf16) {
  const auto d = describe_kernels<model>();
  lower_options o;
  o.global_batch = batch;
  o.seq = seq;
  o.bf16 = bf16;
  return simulate(d, {lower(d, mesh_shape::parse("data=1", 1, "test"), 0, o)}, dev).step_s;
}

/// The compute seconds of every rank of plan P on `mesh` (`world` ranks, m micro-batches), summed.
template <class P> double compute_of(const char* mesh, int world, int m, const device_profile& dev) {
  const auto d = describe_kernels<P>();
  lower_options o;
  o.global_batch = 4;
  o.seq = seq;
  o.micro_batches = m;
  o.bf16 = true;
  std::vector<program> all;
  const auto sh = mesh_shape::parse(mesh, world, "test");
  for (int r = 0; r < world; ++r) all.push_back(lower(d, sh, r, o));
  double s = 0;
  for (const auto& r : simulate(d, all, dev).ranks) s += r.compute_s;
  return s;
}
constexpr index_t V = model::vocab, S = model::max_seq, D = model::width;
using block = transformer_block<D, model::heads, model::ffn>;
using tensor_parallel = sequential<split<embedding<V, D>>, position_embedding<S, D>, repeat<model::layers, split<block>>, layer_norm<D>,
                                   split<sequential<linear<D, V>, softmax_cross_entropy>>>;
}  // namespace

TEST_CASE("a GPU profile prices a step from its layers' kernels: the network's GEMM FLOPs exactly, its launches and bytes closely") {
  for (const bool bf16 : {true, false}) {
    CAPTURE(bf16);
    const auto l = step_ledger(bf16);
    const double flops = l.gemm_flops + l.batched_gemm_flops + l.attention_flops;
    const double bytes = l.kernel_effective_bytes + static_cast<double>(l.copy_bytes + l.fill_bytes);
    // GEMMs and attention's products: every one a layer computes, none other
    CHECK(simulated(pricing("flops", bf16), bf16) == doctest::Approx(flops / 1e12).epsilon(1e-4));
    // launches: the layers' and the blocks' as a whole, the optimizer's and the norm's
    const double launches = simulated(pricing("launches", bf16), bf16);
    MESSAGE("launches: simulated " << launches << ", the step's ledger " << l.launches());
    CHECK(launches == doctest::Approx(static_cast<double>(l.launches())).epsilon(0.1));
    // bytes: the gradient norm's kernels at their bytes (at this size the ledger
    // scales them up as launches that fill a fraction of an H200)
    double norm_extra = 0;
    for (const char* k : {"sum_squares_blocks", "sum_blocks", "sum_in_order", "check_step"})
      if (const auto it = l.kernels.find(k); it != l.kernels.end()) norm_extra += it->second.effective_bytes - static_cast<double>(it->second.bytes);
    const double b = simulated(pricing("bytes", bf16), bf16) * 1e9;
    MESSAGE("bytes: simulated " << b << ", the step's ledger " << bytes << " (" << bytes - norm_extra << " with the norm's at their bytes)");
    CHECK(b == doctest::Approx(bytes - norm_extra).epsilon(0.2));
  }
}

TEST_CASE("a unit's kernels: a sharded form is priced at its share of the whole layer's, a folded GELU at nothing") {
  const auto d = describe_kernels<model>();
  int gelus = 0;
  for (const auto& u : d.units) {
    REQUIRE(static_cast<bool>(u.kernels));
    const auto k = u.kernels(batch, seq, u.in_width, u.out_width, true);
    if (u.name == "gelu") {
      ++gelus;
      CHECK(k.forward.launches == 0);
      CHECK(k.backward.launches == 0);
    } else {
      CHECK(k.forward.launches > 0);
    }
    // a split backward's halves do what the whole backward does, in as many GEMM FLOPs
    CHECK(k.backward_input.gemm_flops + k.weight.gemm_flops == doctest::Approx(k.backward.gemm_flops));
  }
  CHECK(gelus == 4);
  CHECK(static_cast<bool>(d.block_kernels));
}

TEST_CASE("bf16 mixed precision: master weights in the memory prediction, and ZeRO-3 refused as the trainer refuses it") {
  lower_options o;
  o.global_batch = 4;
  o.seq = seq;
  const auto d = describe<replicate<model>>();
  const auto mesh = mesh_shape::parse("data=2", 2, "test");
  const auto fp32 = predict_memory(d, lower(d, mesh, 0, o));
  o.bf16 = true;
  const auto p = lower(d, mesh, 0, o);
  const auto with_master = predict_memory(d, p);
  CHECK(with_master.optimizer - fp32.optimizer == 4 * p.totals().params_held);
  o.zero_level = 3;
  CHECK_THROWS_WITH_AS(lower(d, mesh, 0, o), doctest::Contains("bf16 mixed precision with ZeRO-3 is not implemented"),
                       std::invalid_argument);
  std::istringstream bad("device x\ngemm 1 1 1 0 0 1\nbandwidth 1\nkernels fp16 3\n");
  CHECK_THROWS_WITH_AS(device_profile::parse(bad, "p"), doctest::Contains("kernels precision 'fp16' (have bf16, fp32)"),
                       std::invalid_argument);
}

TEST_CASE("split plans share the single GPU's GEMMs: tensor-parallel forms at their share, a split backward's halves once each") {
  const auto dev = pricing("flops", true);
  const double single = compute_of<model>("data=1", 1, 1, dev);
  REQUIRE(single > 0);
  // every GEMM FLOP of the model, once, over the ranks (the optimizer's bytes are free here)
  CHECK(compute_of<replicate<pipeline<one_f_one_b, tensor_parallel>>>("data=1,pipe=2,model=2", 4, 2, dev) ==
        doctest::Approx(single).epsilon(1e-3));
  CHECK(compute_of<replicate<pipeline<zb_h1, model>>>("data=1,pipe=2", 2, 4, dev) == doctest::Approx(single).epsilon(1e-3));
  CHECK(compute_of<replicate<model>>("data=2", 2, 1, dev) == doctest::Approx(single).epsilon(1e-3));
}

TEST_CASE("kernel probes run beside a guarded backend that computes (auto_plan under the guarded backend)") {
  guarded_backend computing(std::size_t{1} << 30);
  const auto d = describe_kernels<model>();
  for (const auto& u : {d.units.front(), d.units.back()}) {  // the token table and the loss: they read ids on the host
    CAPTURE(u.name);
    const auto k = u.kernels(batch + 1, seq, u.in_width, u.out_width, true);  // a shape not probed before
    CHECK(k.forward.launches > 0);
    CHECK(k.forward.host_waits == 0);  // from the batch's host copies, as a step reads them
  }
}
