// Training in a device's memory, without a GPU: the guarded backend keeps
// its memory closed to host code (PROT_NONE outside its own calls), so a
// network placed on it -- parameters, gradients, optimizer state,
// activations, inputs -- trains only if no host code reads or writes any of
// it. Its arithmetic is the CPU's, so the results must equal the CPU
// backend's bit for bit: any difference means a different code path, and
// any host access kills the process with SIGSEGV (the case that proves the
// guard works does it on purpose, in a child process). The suite builds
// tests at -O1; examples/13_device_memory.cpp checks the same equality at -O3.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "whale/backend/guarded.hpp"
#include "whale/models/gpt.hpp"
#include "whale/nn/gelu.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/network.hpp"
#include "whale/nn/recompute.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/residual.hpp"
#include "whale/nn/rms_norm.hpp"
#include "whale/nn/rotary_attention.hpp"
#include "whale/nn/swiglu_mlp.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/train/data.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;

namespace {
using tiny_gpt = models::gpt_model<32, 8, 16, 2, 32, 2>;
// Llama's layers: RMSNorm, rotary grouped-query attention, SwiGLU, a head without bias
using tiny_llama = sequential<embedding<32, 16>,
                              repeat<2, sequential<residual<rms_norm<16>, rotary_attention<16, 4, 2>>,
                                                   residual<rms_norm<16>, swiglu_mlp<16, 24>>>>,
                              rms_norm<16>, linear<16, 32, no_bias>, softmax_cross_entropy>;
using small_mlp = sequential<linear<8, 16>, relu, recompute<sequential<linear<16, 16>, gelu>>, linear<16, 5>,
                             softmax_cross_entropy>;

struct batch {
  std::vector<std::int32_t> tokens, labels;
  std::vector<float> features;
};
// Step s's batch: B sequences of T tokens (gpt) or B*T rows of 8 features (mlp).
batch make_batch(int s, index_t rows, index_t classes) {
  batch b;
  for (index_t i = 0; i < rows; ++i) {
    b.tokens.push_back(static_cast<std::int32_t>((i * 7 + 3 * s + 1) % 32));
    b.labels.push_back(static_cast<std::int32_t>((i * 5 + s) % classes));
    for (int f = 0; f < 8; ++f) b.features.push_back(static_cast<float>(((i * 13 + f * 5 + s) % 17) - 8) / 8.f);
  }
  return b;
}

struct run_result {
  std::vector<double> losses;
  std::vector<float> params;
  std::int64_t upstream_after_two = -1, upstream_at_end = -1;
};

// Train `steps` steps of M with optimizer `opt` (clipping gradients to
// `max_norm` when positive) on backend `be`.
template <class M, class O>
run_result train(backend_ref be, const O& opt, double max_norm, int steps, const guarded_backend* g = nullptr) {
  network<M> net(seed{5}, be);
  auto st = net.make_optimizer_state(opt);
  if (g) {  // everything the step keeps is in the guarded region
    CHECK(g->contains(net.params().data()));
    CHECK(g->contains(net.grads().data()));
    if constexpr (requires { st.m; }) CHECK((!st.m.on_host() && g->contains(st.m.data()) && g->contains(st.v.data())));
    if constexpr (requires { st.buf; })
      if (st.buf.data() != nullptr) CHECK((!st.buf.on_host() && g->contains(st.buf.data())));
  }
  constexpr bool tokens = std::is_same_v<typename M::input_type, std::int32_t>;
  constexpr index_t B = 2, T = 8;
  run_result r;
  for (int s = 0; s < steps; ++s) {
    const auto b = make_batch(s % 2, B * T, tokens ? 32 : 5);  // two batches, in turn
    step_ctx c;
    c.be = be;
    c.batch = tokens ? B : B * T;
    c.seq = tokens ? T : 1;
    c.global_rows = B * T;
    double loss = 0;
    if constexpr (tokens)
      loss = net.train_step(c, cview<std::int32_t>(b.tokens.data(), {B, T}), cview<std::int32_t>(b.labels.data(), {B * T}));
    else
      loss = net.train_step(c, cview<float>(b.features.data(), {B * T, 8}), cview<std::int32_t>(b.labels.data(), {B * T}));
    r.losses.push_back(loss);
    const float k = max_norm > 0 ? clip_coefficient(net.grad_norm(), max_norm) : 1.f;
    net.apply_optimizer(opt, st, k);
    if (g && s == 1) r.upstream_after_two = g->allocator().upstream_allocations;
  }
  if (g) r.upstream_at_end = g->allocator().upstream_allocations;
  r.params = net.params_on_host();
  return r;
}

// epilogue: the device computes each layer's bias gradient in its weight
// GEMM's epilogue (as cuBLASLt's BGRADB does), in the CPU's order here.
template <class M, class O> void same_as_cpu(const O& opt, double max_norm, bool epilogue = false) {
  const auto host = train<M>(backend_ref{}, opt, max_norm, 5);
  guarded_backend g;
  g.set_fused_bias_grads(epilogue);
  const auto dev = train<M>(backend_ref(g), opt, max_norm, 5, &g);
  CHECK((g.ledger().bias_grad_epilogues > 0) == epilogue);
  if (epilogue) CHECK(g.ledger().kernels.count("column_tile_sums<column_sums>") == 0);
  REQUIRE(host.params.size() == dev.params.size());
  CHECK(host.losses == dev.losses);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < host.params.size(); ++i) differ += host.params[i] != dev.params[i];
  CHECK_MESSAGE(differ == 0, differ, " of ", host.params.size(), " parameters differ from the CPU's");
  CHECK(host.losses[4] < host.losses[0]);  // it trained (steps 0, 2 and 4 see the same batch)
  // from the third step on, every block comes from the caching allocator's
  // cache (the MLP's recomputed block takes one more in step 2 than in step 1)
  CHECK(dev.upstream_after_two > 0);
  CHECK(dev.upstream_at_end == dev.upstream_after_two);
}
}  // namespace

TEST_CASE("guarded memory: host code that touches it dies of SIGSEGV with a message; the backend's calls reach it") {
  int err[2];
  REQUIRE(::pipe(err) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // never returns into the test runner
    ::dup2(err[1], 2);
    ::close(err[0]);
    try {
      guarded_backend g;
      tensor<float> t;
      {
        const place_scope on(g.memory());
        t = tensor<float>({64}, mem_kind::workspace);
      }
      const volatile float* p = t.data();
      const float v = p[3];  // host code reading device memory: must not return
      ::_exit(v == 0.f ? 3 : 4);
    } catch (...) {
      ::_exit(5);
    }
  }
  ::close(err[1]);
  std::string said;
  char buf[512];
  for (ssize_t n; (n = ::read(err[0], buf, sizeof buf)) > 0;) said.append(buf, static_cast<std::size_t>(n));
  ::close(err[0]);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGSEGV);
  CHECK(said.find("host code read or wrote device memory") != std::string::npos);

  // through the backend the same memory is ordinary
  guarded_backend g;
  const backend_ref be(g);
  CHECK(!be.on_cpu());
  CHECK(std::string(be.name()) == "guarded");
  tensor<float> t;
  {
    const place_scope on(be.memory());
    t = tensor<float>({1000}, mem_kind::workspace);
  }
  CHECK(!t.on_host());
  CHECK(g.contains(t.data()));
  std::vector<float> in(1000), out(1000);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i) * 0.5f - 7.f;
  be.copy(t.data(), in.data(), 4000);
  be.launch(1000, kernels::scale{t.data(), 2.f});
  std::vector<float> keep;
  const auto h = be.host_readable(cview<float>(t), keep);
  CHECK(h.data() == keep.data());
  for (std::size_t i = 0; i < in.size(); ++i) out[i] = h[static_cast<index_t>(i)];
  for (std::size_t i = 0; i < in.size(); ++i) CHECK(out[i] == in[i] * 2.f);
  // the norm the optimizer clips by: the device's per-block sums give the CPU's value exactly
  CHECK(be.sum_squares(1000, t.data()) == cpu::sum_squares(1000, out.data()));

  // the opposite mistake, where the backend can see it: host buffers handed to it as device memory
  std::vector<float> a(4, 1.f), c(4, 0.f);
  CHECK_THROWS_WITH_AS(be.gemm(trans::no, trans::no, 2, 2, 2, 1.f, a.data(), t.data(), 0.f, t.data()),
                       doctest::Contains("a GEMM's A is host memory"), std::logic_error);
  CHECK_THROWS_WITH_AS(be.fill_zero(c.data(), 16), doctest::Contains("a fill's target is host memory"), std::logic_error);
  CHECK_THROWS_WITH_AS(be.copy(c.data(), a.data(), 16), doctest::Contains("neither side is device memory"),
                       std::logic_error);
}

TEST_CASE("sum_squares_blocks is cpu::sum_squares, block for block, to the bit") {
  for (index_t n : {index_t{0}, index_t{5}, index_t{16}, index_t{4096}, index_t{4097}, index_t{20000}}) {
    std::vector<float> x(static_cast<std::size_t>(n));
    for (index_t i = 0; i < n; ++i) x[static_cast<std::size_t>(i)] = static_cast<float>((i * 37) % 101) / 7.f - 6.f;
    const index_t nb = kernels::sum_squares_blocks::blocks(n);
    std::vector<double> part(static_cast<std::size_t>(nb));
    cpu::launch(nb, kernels::sum_squares_blocks{x.data(), part.data(), n});
    double total = 0;
    for (double v : part) total += v;
    CHECK(total == cpu::sum_squares(n, x.data()));
  }
}

TEST_CASE("a GPT trained in guarded device memory equals the CPU's, with SGD and with AdamW and clipping") {
  SUBCASE("sgd with momentum") { same_as_cpu<tiny_gpt>(sgd{.lr = 0.2f, .momentum = 0.9f}, 0); }
  SUBCASE("adamw, clipped to norm 0.05") { same_as_cpu<tiny_gpt>(adamw{.lr = 1e-2f}, 0.05); }
  SUBCASE("sgd, bias gradients in the weight GEMMs' epilogue") {
    same_as_cpu<tiny_gpt>(sgd{.lr = 0.2f, .momentum = 0.9f}, 0, true);
  }
  SUBCASE("adamw, clipped, bias gradients in the weight GEMMs' epilogue") {
    same_as_cpu<tiny_gpt>(adamw{.lr = 1e-2f}, 0.05, true);
  }
}

TEST_CASE("a Llama-like decoder (RMSNorm, rotary grouped attention, SwiGLU) trained in guarded device memory equals the CPU's") {
  SUBCASE("sgd with momentum") { same_as_cpu<tiny_llama>(sgd{.lr = 0.2f, .momentum = 0.9f}, 0); }
  SUBCASE("adamw, clipped to norm 0.05") { same_as_cpu<tiny_llama>(adamw{.lr = 1e-2f}, 0.05); }
}

TEST_CASE("an MLP with a recomputed block trained in guarded device memory equals the CPU's") {
  SUBCASE("sgd") { same_as_cpu<small_mlp>(sgd{.lr = 0.1f}, 0); }
  SUBCASE("adamw, clipped") { same_as_cpu<small_mlp>(adamw{.lr = 1e-2f}, 0.05); }
  SUBCASE("adamw, clipped, bias gradients in the weight GEMMs' epilogue") {
    same_as_cpu<small_mlp>(adamw{.lr = 1e-2f}, 0.05, true);
  }
}

TEST_CASE("on a device: logits come back to the host, evaluation and --check-finite read through copies") {
  constexpr index_t B = 2, T = 8;
  const auto b = make_batch(0, B * T, 32);
  const cview<std::int32_t> x(b.tokens.data(), {B, T}), y(b.labels.data(), {B * T});
  auto ctx = [] {
    step_ctx c;
    c.batch = B;
    c.seq = T;
    c.global_rows = B * T;
    c.check_finite = true;
    return c;
  };
  network<tiny_gpt> host(seed{3});
  auto ch = ctx();
  const auto lh = host.forward(ch, x);
  auto ch2 = ctx();
  const double eh = host.evaluate(ch2, x, y);

  guarded_backend g;
  network<tiny_gpt> dev(seed{3}, backend_ref(g));
  CHECK(g.contains(dev.params().data()));
  auto cd = ctx();
  const auto ld = dev.forward(cd, x);
  CHECK(ld.on_host());
  REQUIRE(ld.numel() == lh.numel());
  CHECK(std::equal(lh.begin(), lh.end(), ld.begin()));
  auto cd2 = ctx();
  CHECK(dev.evaluate(cd2, x, y) == eh);
  auto cd3 = ctx();
  const double loss = dev.train_step(cd3, x, y);  // every leaf's output checked on host copies
  CHECK(loss == eh);

  // bad labels and tokens are the CPU's errors, read through host copies
  std::vector<std::int32_t> bad = b.labels;
  bad[3] = 99;
  auto cd4 = ctx();
  CHECK_THROWS_WITH_AS(dev.train_step(cd4, x, cview<std::int32_t>(bad.data(), {B * T})),
                       doctest::Contains("label 99 out of range for 32 classes"), std::out_of_range);
  std::vector<std::int32_t> bad_tokens = b.tokens;
  bad_tokens[5] = -2;
  auto cd5 = ctx();
  CHECK_THROWS_WITH_AS(dev.train_step(cd5, cview<std::int32_t>(bad_tokens.data(), {B, T}), y),
                       doctest::Contains("token -2 is outside the vocabulary of 32"), std::out_of_range);
}

TEST_CASE("the trainer runs a network on a device: the CPU's losses and parameters, in fp32 and bf16, and its checkpoint") {
  const auto dir = (std::filesystem::temp_directory_path() / ("whale-device-trainer-" + std::to_string(::getpid()))).string();
  auto run = [&](backend_ref be, precision p) {
    network<tiny_gpt> net(seed{9}, be, p);  // the network's precision, which the trainer trains in
    markov_data data(seed{7}, 32, 8, 4);
    trainer_options o;
    o.progress = false;
    o.max_grad_norm = 0.1;
    o.checkpoint_dir = dir;
    trainer t(net, adamw{.lr = 1e-2f}, o);
    const auto r = t.run(data, steps{6});
    const auto saved = t.save();  // from the device's memory, through host copies
    network<tiny_gpt> back(seed{1}, p);  // a CPU network loads it
    trainer tb(back, adamw{.lr = 1e-2f}, o);
    tb.load(saved);
    CHECK(std::vector<float>(back.params().begin(), back.params().end()) == net.params_on_host());
    return std::pair{std::vector<double>{r.loss_first(), r.loss_last()}, net.params_on_host()};
  };
  for (precision p : {precision::fp32, precision::bf16}) {
    INFO((p == precision::bf16 ? "bf16" : "fp32"));
    const auto host = run(backend_ref{}, p);
    guarded_backend g;
    const auto dev = run(backend_ref(g), p);
    CHECK(host.first == dev.first);
    CHECK(host.second == dev.second);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("bf16 on a device with fused attention and bias-gradient epilogues (modelled): the CPU's bf16 training within bf16's rounding") {
  auto run = [](backend_ref be) {
    network<tiny_gpt> net(seed{9}, be, precision::bf16);
    markov_data data(seed{7}, 32, 8, 4);
    trainer_options o;
    o.progress = false;
    o.max_grad_norm = 0.5;
    o.log_every = 3;
    trainer t(net, adamw{.lr = 1e-2f}, o);
    const auto r = t.run(data, steps{6});
    return std::vector<double>{r.loss_first(), r.loss_last()};
  };
  const auto host = run(backend_ref{});
  guarded_backend g;
  g.set_fused_attention(true);
  g.set_fused_bias_grads(true);
  const auto dev = run(backend_ref(g));
  // each block's attention: the forward packs Q, K, V; the backward reads them from the kept buffer
  // and packs only d(o); every bias gradient comes from a GEMM's epilogue
  const auto& l = g.ledger();
  CHECK(l.attention_calls == 6 * 2 * 2);
  CHECK(l.kernels.at("pack_bf16").launches == l.attention_calls);
  CHECK(l.bias_grad_epilogues > 0);
  CHECK(l.kernels.count("column_tile_sums<column_sums>") == 0);
  for (std::size_t i = 0; i < host.size(); ++i) CHECK(dev[i] == doctest::Approx(host[i]).epsilon(5e-3));
}

TEST_CASE("trainer_options::log_every: steps queue without a host wait, with the losses and parameters of reading every step") {
  struct outcome {
    std::vector<double> losses, seen, norms;
    std::vector<float> params;
    std::int64_t syncs = -1, reads_d2h = -1, copies = -1;
  };
  auto run = [&](backend_ref be, guarded_backend* g, std::int64_t every, bool use_sgd, precision p) {
    network<tiny_gpt> net(seed{9}, be, p);
    markov_data data(seed{7}, 32, 8, 4);
    outcome out;
    trainer_options o;
    o.progress = false;
    o.max_grad_norm = 0.05;  // clipping acts on most steps
    o.log_every = every;
    o.on_step = [&](const step_report& r) {
      out.seen.push_back(r.loss);
      out.norms.push_back(r.grad_norm);
    };
    auto go = [&](auto opt) {
      trainer t(net, opt, o);
      t.run(data, steps{2});  // the first steps allocate
      if (g) g->ledger().clear();
      const auto r = t.run(data, steps{6});
      if (g) out.syncs = g->ledger().host_syncs, out.reads_d2h = g->ledger().device_to_host, out.copies = g->ledger().copies;
      out.losses = r.losses;
      CHECK(t.next_step() == 8);
    };
    if (use_sgd) go(sgd{.lr = 0.05f, .momentum = 0.9f});
    else go(adamw{.lr = 1e-2f});
    out.params = net.params_on_host();
    return out;
  };
  // Under bf16 the queued steps keep the master weights apart: the optimizer's
  // pass writes the rounded weights, and only the first step after each read
  // copies the master weights aside (the read puts them back). The same bits.
  for (const precision p : {precision::fp32, precision::bf16})
    for (const bool use_sgd : {false, true}) {
      const std::string what = std::string(use_sgd ? "sgd with momentum" : "adamw") + (p == precision::bf16 ? ", bf16" : ", fp32");
      INFO(what);
      const auto every_step = run(backend_ref{}, nullptr, 1, use_sgd, p);
      REQUIRE(every_step.losses.size() == 6);
      for (const std::int64_t every : {3, 4}) {
        INFO("log_every " << every);
        const auto cpu = run(backend_ref{}, nullptr, every, use_sgd, p);
        std::int64_t fp32_copies = -1;  // the same run's copies in fp32
        if (p == precision::bf16) {
          guarded_backend g32;
          fp32_copies = run(backend_ref(g32), &g32, every, use_sgd, precision::fp32).copies;
        }
        guarded_backend g;
        const auto dev = run(backend_ref(g), &g, every, use_sgd, p);
        for (const auto* r : {&cpu, &dev}) {
          CHECK(r->losses == every_step.losses);
          CHECK(r->seen == every_step.seen);  // on_step saw every step, with its own loss and norm
          CHECK(r->norms == every_step.norms);
          CHECK(r->params == every_step.params);
        }
        // reads: at every `every` steps and at the end of run(); each is the one host wait
        const std::int64_t reads = 2;  // every 3: after steps 3 and 6; every 4: after step 4 and at the end
        CHECK(dev.syncs == reads);
        CHECK(dev.reads_d2h == reads);
        // the master weights aside and back, once a read; and one copy fewer a step (6 steps), the position
        // embedding's d(input) being stored rounded by a kernel under bf16 (a copy under fp32)
        if (p == precision::bf16) CHECK(dev.copies - fp32_copies == 2 * reads - 6);
      }
      guarded_backend g;
      const auto dev_every_step = run(backend_ref(g), &g, 1, use_sgd, p);
      CHECK(dev_every_step.syncs >= 2 * 6);  // the loss and the norm, every step
    }
}

TEST_CASE("trainer_options::log_every: a non-finite step found later is named, and nothing after it was updated") {
  auto run = [&](backend_ref be, std::int64_t every, precision p) {
    network<tiny_gpt> net(seed{9}, be, p);
    markov_data data(seed{7}, 32, 8, 4);
    trainer_options o;
    o.progress = false;
    o.log_every = every;
    o.lr_schedule = [](std::int64_t s) { return s == 2 ? 1e30 : 1e-2; };  // step 3 blows the weights up
    trainer t(net, adamw{}, o);
    std::string what;
    try {
      t.run(data, steps{7});
    } catch (const std::runtime_error& e) {
      what = e.what();
    }
    return std::tuple{what, t.next_step(), t.optimizer_state().steps, net.params_on_host()};
  };
  for (const precision p : {precision::fp32, precision::bf16}) {  // bf16: the master weights put back, unchanged by the faulty step
    INFO((p == precision::bf16 ? "bf16" : "fp32"));
    const auto every_step = run(backend_ref{}, 1, p);
    REQUIRE(!std::get<0>(every_step).empty());
    CHECK(std::get<0>(every_step).find("whale::trainer: step 4: the loss is") != std::string::npos);
    guarded_backend g;
    for (const auto& r : {run(backend_ref{}, 7, p), run(backend_ref(g), 7, p), run(backend_ref(g), 2, p)}) {
      CHECK(std::get<0>(r) == std::get<0>(every_step));
      CHECK(std::get<1>(r) == std::get<1>(every_step));
      CHECK(std::get<2>(r) == std::get<2>(every_step));
      CHECK(std::get<3>(r) == std::get<3>(every_step));
    }
  }
}
