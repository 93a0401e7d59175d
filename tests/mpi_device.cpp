// Plans in a device's memory, without a GPU: every rank computes on its own
// guarded backend (memory host code may not touch; backend/guarded.hpp), so
// a step runs only if the executor keeps parameters, gradients, optimizer
// state, activations and inputs there and reaches them through the backend,
// summing gradients through host copies of each bucket. The arithmetic is the
// CPU's, so the parameters must equal the same plan's on the CPU backend bit
// for bit, on every rank, at whatever world size mpirun gives (1, 2, 4), with
// SGD and with AdamW and clipping, blocking and non-blocking buckets (at one
// rank there is no data axis, so no bucket is summed). Plans that do not run
// on a device yet are refused with a message.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "whale/backend/guarded.hpp"
#include "whale/comm/context.hpp"
#include "whale/models/gpt.hpp"
#include "whale/nn/gelu.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/runtime/make.hpp"
#include "whale/train/data.hpp"
#include "whale/train/trainer.hpp"
#include "support/plan_check.hpp"

using namespace whale;

namespace {
using tiny_gpt = models::gpt_model<32, 8, 16, 2, 32, 2>;

struct outcome {
  std::vector<float> params;
  std::vector<double> losses;
};

// Train replicate<tiny_gpt> 5 steps on backend `be`; this rank's parameters (a host copy) and the losses.
template <class O>
outcome train(const context& ctx, backend_ref be, const O& opt, double max_norm, bool blocking,
              const guarded_backend* g = nullptr) {
  plan_options o;
  o.backend = be;
  o.blocking = blocking;
  o.bucket_mib = 0.01;  // several buckets, so that overlap and the host copies are exercised
  auto dp = make<replicate<tiny_gpt>>(ctx, seed{42}, o);
  CHECK(std::string(dp.backend().name()) == be.name());  // the plan took the backend it was given
  if (g) CHECK(g->contains(dp.params().data()));
  trainer_options t;
  t.progress = false;
  t.max_grad_norm = max_norm;
  markov_data data(seed{7}, 32, 8, 8);
  trainer tr(dp, opt, t);
  outcome r;
  for (int s = 0; s < 5; ++s) r.losses.push_back(tr.step(data, s));
  r.params.resize(static_cast<std::size_t>(dp.param_count()));
  dp.backend().copy(r.params.data(), dp.params().data(), r.params.size() * sizeof(float));
  return r;
}

template <class O> void same_as_cpu(const O& opt, double max_norm, bool blocking) {
  auto ctx = context::init();
  const auto host = train(ctx, backend_ref{}, opt, max_norm, blocking);
  guarded_backend g;
  const auto dev = train(ctx, backend_ref(g), opt, max_norm, blocking, &g);
  INFO("rank " << ctx.rank() << " of " << ctx.size());
  CHECK(host.losses == dev.losses);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < host.params.size(); ++i) differ += host.params[i] != dev.params[i];
  CHECK_MESSAGE(differ == 0, differ, " of ", host.params.size(), " parameters differ from the CPU backend's");
  for (double l : dev.losses) CHECK(std::isfinite(l));
}
}  // namespace

TEST_CASE("replicate<gpt> in guarded device memory equals the CPU backend's, on every rank") {
  SUBCASE("sgd with momentum, blocking buckets") { same_as_cpu(sgd{.lr = 0.2f, .momentum = 0.9f}, 0, true); }
  SUBCASE("adamw clipped to 0.05, non-blocking buckets") { same_as_cpu(adamw{.lr = 1e-2f}, 0.05, false); }
}

TEST_CASE("on a device: logits come back to the host; ZeRO, pipelines and split regions are refused with a message") {
  auto ctx = context::init();
  guarded_backend g;
  plan_options o;
  o.backend = backend_ref(g);
  {
    auto dp = make<replicate<tiny_gpt>>(ctx, seed{42}, o);
    auto host = make<replicate<tiny_gpt>>(ctx, seed{42});
    std::vector<std::int32_t> tokens(16);
    for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 5 + 1) % 32);
    step_ctx c;
    c.batch = 2, c.seq = 8, c.global_rows = 16;
    const auto ld = dp.forward(c, cview<std::int32_t>(tokens.data(), {2, 8}));
    step_ctx c2 = c;
    const auto lh = host.forward(c2, cview<std::int32_t>(tokens.data(), {2, 8}));
    CHECK(ld.on_host());
    REQUIRE(ld.numel() == lh.numel());
    CHECK(std::equal(lh.begin(), lh.end(), ld.begin()));
  }
  using small_mlp = sequential<linear<8, 16>, relu, linear<16, 4>, softmax_cross_entropy>;
  auto zero1 = [&] { return make<shard<tiny_gpt, 1>>(ctx, seed{42}, o); };
  auto tensor_parallel = [&] { return make<split<small_mlp>>(ctx, seed{42}, o); };
  CHECK_THROWS_WITH_AS(zero1(), doctest::Contains("ZeRO (shard<..., 1>) with the network on a device (guarded) is not implemented yet"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(tensor_parallel(),
                       doctest::Contains("a split region with the network on a device (guarded) is not implemented yet"),
                       std::invalid_argument);
  plan_options bf = o;
  bf.bf16_reduce = true;
  auto bf16_sum = [&] { return make<replicate<tiny_gpt>>(ctx, seed{42}, bf); };
  CHECK_THROWS_WITH_AS(bf16_sum(), doctest::Contains("summing gradients in bf16 (bf16_reduce) with the network on a device"),
                       std::invalid_argument);
  if (ctx.size() == 1) {  // a model without a strategy is a network<M>: on the given backend too
    auto net = make<tiny_gpt>(ctx, seed{42}, o);
    CHECK(g.contains(net.params().data()));
  }
  if (ctx.size() % 2 == 0) {
    auto pc = test::on_mesh("data=" + std::to_string(ctx.size() / 2) + ",pipe=2");
    auto pipelined = [&] { return make<replicate<pipeline<one_f_one_b, tiny_gpt>>>(pc, seed{42}, o); };
    CHECK_THROWS_WITH_AS(pipelined(), doctest::Contains("a pipeline with the network on a device (guarded) is not implemented yet"),
                         std::invalid_argument);
  }
}
