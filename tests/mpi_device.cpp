// Plans in a device's memory, without a GPU: every rank computes on its own
// guarded backend (memory host code may not touch; backend/guarded.hpp), so
// a step runs only if the executor keeps parameters, gradients, optimizer
// state, activations and inputs there and reaches them through the backend,
// summing gradient buckets, ZeRO's reduce-scatters and gathers and the
// collectives of split regions on the device's buffers through its own
// communicator (and, a second time, through host copies), and pipeline
// messages over its own channels (matched in issue order, as NCCL matches
// them; a second time through host copies). The
// arithmetic is the CPU's, so the parameters must equal the same plan's on
// the CPU backend bit for bit, on every rank, at whatever
// world size mpirun gives (1, 2, 4), with SGD and with AdamW and clipping:
// data parallelism (blocking and non-blocking buckets; at one rank there is
// no data axis, so no bucket is summed), pipelines (1F1B, GPipe, interleaved;
// two stages, replicated when the world has four ranks), ZeRO 1-3 (also
// over a pipeline and over tensor parallelism), split regions over the model
// and the data axis (every layout conversion, the class-split loss on each
// axis), and tensor parallelism inside pipeline stages. The trainer's bf16
// mixed precision on a device equals the CPU's too, and checkpoints saved on
// a device load on the CPU and back (training goes on bit for bit). Steps
// queued without a host wait (log_every > 1) equal reading every step. Plans
// that do not run on a device yet are refused with a message, and so is a
// plan whose state does not fit its device's memory.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "whale/backend/guarded.hpp"
#include "whale/comm/context.hpp"
#include "whale/models/gpt.hpp"
#include "whale/nn/causal_self_attention.hpp"
#include "whale/nn/gelu.hpp"
#include "whale/nn/layer_norm.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/runtime/make.hpp"
#include "whale/train/data.hpp"
#include "whale/train/run_flags.hpp"
#include "whale/train/safetensors.hpp"
#include "whale/train/trainer.hpp"
#include "support/plan_check.hpp"

using namespace whale;

namespace {
using tiny_gpt = models::gpt_model<32, 8, 16, 2, 32, 2>;
using deep_tiny_gpt = models::gpt_model<32, 8, 16, 2, 32, 4>;  // 4 blocks: 2 chunks on each of 2 pipe ranks

struct outcome {
  std::vector<float> params, whole;  // this rank's (a host copy), and the whole model gathered
  std::vector<double> losses;
  std::int64_t device_ops = 0;  // operations on the device's own communicators
  std::int64_t pipe_ops = 0;    // of which on its pipeline channels
};

// Train plan P 5 steps on backend `be` on data from make_data(); this rank's parameters (a host copy) and the losses.
template <class P, class O, class D>
outcome train(const context& ctx, backend_ref be, const O& opt, double max_norm, plan_options o, D make_data,
              const guarded_backend* g = nullptr) {
  o.backend = be;
  o.bucket_mib = 0.01;  // several buckets, so that overlap and the host copies are exercised
  auto plan = make<P>(ctx, seed{42}, o);
  CHECK(std::string(plan.backend().name()) == be.name());  // the plan took the backend it was given
  if (g) CHECK(g->contains(plan.params().data()));
  trainer_options t;
  t.progress = false;
  t.max_grad_norm = max_norm;
  auto data = make_data();
  trainer tr(plan, opt, t);
  outcome r;
  for (int s = 0; s < 5; ++s) r.losses.push_back(tr.step(data, s));
  r.params.resize(static_cast<std::size_t>(plan.params().numel()));
  plan.backend().copy(r.params.data(), plan.params().data(), r.params.size() * sizeof(float));
  const auto whole = plan.full_params();
  CHECK(whole.on_host());
  r.whole.assign(whole.begin(), whole.end());
  r.device_ops = plan.device_traffic().operations;
  r.pipe_ops = plan.pipe_device_traffic().operations;
  return r;
}

markov_data tokens() { return markov_data(seed{7}, 32, 8, 8); }

// The device run's losses, this rank's parameters and the whole model equal the CPU run's, bit for bit.
void same_bits(const outcome& host, const outcome& dev) {
  CHECK(host.losses == dev.losses);
  REQUIRE(host.params.size() == dev.params.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < host.params.size(); ++i) differ += host.params[i] != dev.params[i];
  CHECK_MESSAGE(differ == 0, differ, " of ", host.params.size(), " parameters differ from the CPU backend's");
  CHECK(host.whole == dev.whole);
}

// P on the CPU, then on the guarded backend twice: collectives on the device's buffers through
// its own communicator (the default), and through host copies (device_collectives = false).
template <class P, class O, class D = decltype(&tokens)>
void same_as_cpu(const context& ctx, const O& opt, double max_norm, const plan_options& o = {}, D make_data = &tokens) {
  const auto host = train<P>(ctx, backend_ref{}, opt, max_norm, o, make_data);
  for (int way = 0; way < 2; ++way) {
    const bool direct = way == 0;
    plan_options od = o;
    od.device_collectives = direct;
    guarded_backend g;
    const auto dev = train<P>(ctx, backend_ref(g), opt, max_norm, od, make_data, &g);
    const std::string how = direct ? "on the device's buffers" : "through host copies";
    INFO("rank " << ctx.rank() << " of " << ctx.size() << ", " << layer_name<P>() << ", collectives " << how);
    same_bits(host, dev);
    for (double l : dev.losses) CHECK(std::isfinite(l));
    // the device's communicators carried the data and model axes' collectives, or nothing at all
    if (!direct) CHECK(dev.device_ops == 0);
    if (direct && ctx.mesh().size(axis::data | axis::model | axis::pipe) > 1) CHECK(dev.device_ops > 0);
    // the pipeline's messages on the pipe group's device communicator: at least one a micro-batch and step (5 steps of 4)
    if (direct && ctx.mesh().size(axis::pipe) > 1) CHECK(dev.pipe_ops >= 5 * 4);
  }
}
plan_options blocking(bool b) {
  plan_options o;
  o.blocking = b;
  return o;
}
/// Two pipe ranks (replicated over the rest) when the world is even; one otherwise.
context pipe_mesh(int world) { return test::on_mesh(world % 2 == 0 ? "data=" + std::to_string(world / 2) + ",pipe=2" : "pipe=1"); }
}  // namespace

TEST_CASE("replicate<gpt> in guarded device memory equals the CPU backend's, on every rank") {
  auto ctx = context::init();
  SUBCASE("sgd with momentum, blocking buckets") {
    same_as_cpu<replicate<tiny_gpt>>(ctx, sgd{.lr = 0.2f, .momentum = 0.9f}, 0, blocking(true));
  }
  SUBCASE("adamw clipped to 0.05, non-blocking buckets") {
    same_as_cpu<replicate<tiny_gpt>>(ctx, adamw{.lr = 1e-2f}, 0.05, blocking(false));
  }
}

TEST_CASE("pipelines in guarded device memory equal the CPU backend's, on every rank") {
  const int world = context::init().size();
  auto ctx = pipe_mesh(world);
  plan_options four;
  four.micro_batches = 4;
  SUBCASE("1f1b, sgd with momentum") {
    same_as_cpu<replicate<pipeline<one_f_one_b, deep_tiny_gpt>>>(ctx, sgd{.lr = 0.2f, .momentum = 0.9f}, 0, four);
  }
  SUBCASE("gpipe, adamw clipped to 0.05, non-blocking buckets") {
    plan_options o = four;
    o.blocking = false;
    same_as_cpu<replicate<pipeline<gpipe, deep_tiny_gpt>>>(ctx, adamw{.lr = 1e-2f}, 0.05, o);
  }
  SUBCASE("interleaved 1f1b, two chunks per pipe rank, adamw clipped") {
    same_as_cpu<replicate<pipeline<interleaved_1f1b<2>, deep_tiny_gpt>>>(ctx, adamw{.lr = 1e-2f}, 0.05, four);
  }
}

namespace {
// Split regions (legend: vocabulary 64, 16 positions, width 32, 4 heads, FFN 64): the
// vocabulary-split embedding, head-split attention, column- and row-parallel linears, and
// the class-split head with its layout conversion back to whole rows.
using tp_gpt = sequential<split<embedding<64, 32>>, position_embedding<16, 32>, repeat<2, split<transformer_block<32, 4, 64>>>,
                          layer_norm<32>, split<linear<32, 64>>, softmax_cross_entropy>;
markov_data tp_tokens() { return markov_data(seed{7}, 64, 16, 8); }
// Whale's classifier plan, shrunk: a replicated backbone, the classifier split by class over the data ranks
// (labels gathered, rows gathered and reduce-scattered, the class-split softmax cross-entropy).
using xc_split = sequential<replicate<sequential<linear<24, 48>, relu>>,
                            split<sequential<linear<48, 1000>, softmax_cross_entropy>, axis::data>>;
auto xc_rows() { return teacher_data(seed{6}, 24, 1000, 8); }
// Every layout conversion: rows and columns gathered, sliced, reduce-scattered, through replicated.
template <axis A>
using conv_split = sequential<split<sequential<linear<8, 16>, relu, layer_norm<16>, linear<16, 8>>, A>, linear<8, 4>,
                              softmax_cross_entropy>;
auto conv_rows() { return teacher_data(seed{8}, 8, 4, 8); }
// Attention after a column-split activation: its input is gathered by columns, and its partial
// output (and, backward, its partial input gradient) reduce-scattered by columns.
using cols_gpt = sequential<embedding<64, 32>, position_embedding<16, 32>,
                            split<sequential<linear<32, 64>, gelu, causal_self_attention<64, 4>, linear<64, 32>>>,
                            layer_norm<32>, linear<32, 64>, softmax_cross_entropy>;
// The classifier split by class over the model axis: the class-split softmax cross-entropy there.
using class_split = sequential<linear<24, 48>, relu, split<sequential<linear<48, 1000>, softmax_cross_entropy>>>;
std::string all_on(const char* axis, int n) { return std::string(axis) + "=" + std::to_string(n); }
}  // namespace

TEST_CASE("a schedule whose messages arrive out of reading order takes host copies on a device, and equals the CPU") {
  const int world = context::init().size();
  auto ctx = pipe_mesh(world);
  plan_options two;
  two.micro_batches = 2;
  using P = replicate<pipeline<test::swapped_schedule, deep_tiny_gpt>>;  // matched by issue order, its messages would swap
  const auto host = train<P>(ctx, backend_ref{}, adamw{.lr = 1e-2f}, 0.05, two, &tokens);
  guarded_backend g;
  const auto dev = train<P>(ctx, backend_ref(g), adamw{.lr = 1e-2f}, 0.05, two, &tokens, &g);
  INFO("rank " << ctx.rank() << " of " << ctx.size());
  CHECK(host.losses == dev.losses);
  CHECK(host.params == dev.params);
  CHECK(dev.pipe_ops == 0);  // none on the device's communicator
}

TEST_CASE("ZeRO 1-3 in guarded device memory equal the CPU backend's, on every rank") {
  auto ctx = context::init();
  SUBCASE("sgd with momentum") { same_as_cpu<shard<tiny_gpt, 1>>(ctx, sgd{.lr = 0.2f, .momentum = 0.9f}, 0); }
  SUBCASE("adamw clipped to 0.05") { same_as_cpu<shard<tiny_gpt, 1>>(ctx, adamw{.lr = 1e-2f}, 0.05); }
  SUBCASE("over a 1f1b pipeline, adamw clipped to 0.05") {
    auto pc = pipe_mesh(ctx.size());
    plan_options four;
    four.micro_batches = 4;
    same_as_cpu<shard<pipeline<one_f_one_b, deep_tiny_gpt>, 1>>(pc, adamw{.lr = 1e-2f}, 0.05, four);
  }
  // ZeRO 2-3: gradients reduce-scattered per layer in small buckets (0.01 MiB), two micro-batches
  // (the second adds to the owned gradients); ZeRO-3 gathers each layer's parameters, prefetching
  plan_options two;
  two.micro_batches = 2;
  SUBCASE("ZeRO-2, sgd with momentum") { same_as_cpu<shard<tiny_gpt, 2>>(ctx, sgd{.lr = 0.2f, .momentum = 0.9f}, 0, two); }
  SUBCASE("ZeRO-2, adamw clipped to 0.05") { same_as_cpu<shard<tiny_gpt, 2>>(ctx, adamw{.lr = 1e-2f}, 0.05, two); }
  SUBCASE("ZeRO-3, sgd with momentum") { same_as_cpu<shard<tiny_gpt, 3>>(ctx, sgd{.lr = 0.2f, .momentum = 0.9f}, 0, two); }
  SUBCASE("ZeRO-3, adamw clipped to 0.05, without prefetching") {
    plan_options o = two;
    o.prefetch = false;
    same_as_cpu<shard<tiny_gpt, 3>>(ctx, adamw{.lr = 1e-2f}, 0.05, o);
  }
  SUBCASE("ZeRO-2 over a 1f1b pipeline, ZeRO-3 over tensor parallelism") {
    auto pc = pipe_mesh(ctx.size());
    plan_options four;
    four.micro_batches = 4;
    same_as_cpu<shard<pipeline<one_f_one_b, deep_tiny_gpt>, 2>>(pc, adamw{.lr = 1e-2f}, 0.05, four);
    auto tc = test::on_mesh(ctx.size() == 4 ? "data=2,model=2" : "model=" + std::to_string(ctx.size()));
    same_as_cpu<shard<tp_gpt, 3>>(tc, sgd{.lr = 0.05f, .momentum = 0.9f}, 0, {}, &tp_tokens);
  }
}

TEST_CASE("split regions in guarded device memory equal the CPU backend's, on every rank") {
  const int world = context::init().size();
  const plan_options none;
  SUBCASE("tensor-parallel gpt over the model axis, sgd with momentum") {
    auto ctx = test::on_mesh(all_on("model", world));
    same_as_cpu<tp_gpt>(ctx, sgd{.lr = 0.05f, .momentum = 0.9f}, 0, none, &tp_tokens);
  }
  SUBCASE("tensor-parallel gpt over the model axis, adamw clipped to 0.05") {
    auto ctx = test::on_mesh(all_on("model", world));
    same_as_cpu<tp_gpt>(ctx, adamw{.lr = 1e-2f}, 0.05, none, &tp_tokens);
  }
  SUBCASE("the classifier split by class over the data axis, sgd and adamw clipped") {
    auto ctx = test::on_mesh(all_on("data", world));
    same_as_cpu<xc_split>(ctx, sgd{.lr = 0.05f, .momentum = 0.9f}, 0, none, &xc_rows);
    same_as_cpu<xc_split>(ctx, adamw{.lr = 1e-2f}, 0.05, none, &xc_rows);
  }
  SUBCASE("the classifier split by class over the model axis, adamw clipped") {
    auto ctx = test::on_mesh(all_on("model", world));
    same_as_cpu<class_split>(ctx, adamw{.lr = 1e-2f}, 0.05, none, &xc_rows);
  }
  SUBCASE("layout conversions: rows and columns gathered, sliced and reduce-scattered, over both axes") {
    std::ostringstream os;
    cols_gpt::print_structure(os, 0, 32);
    INFO(os.str());
    CHECK(os.str().find("reduce-scatter(columns)") != std::string::npos);
    CHECK(os.str().find("all-gather(columns)") != std::string::npos);
    auto dc = test::on_mesh(all_on("data", world));
    same_as_cpu<conv_split<axis::data>>(dc, adamw{.lr = 1e-2f}, 0.05, none, &conv_rows);
    auto mc = test::on_mesh(all_on("model", world));
    same_as_cpu<conv_split<axis::model>>(mc, sgd{.lr = 0.05f, .momentum = 0.9f}, 0, none, &conv_rows);
    same_as_cpu<cols_gpt>(mc, adamw{.lr = 1e-2f}, 0.05, none, &tp_tokens);
  }
  SUBCASE("tensor parallelism inside pipeline stages (pipe:2 x model:2 at 4 ranks), adamw clipped") {
    auto ctx = test::on_mesh(world == 4 ? "pipe=2,model=2" : all_on("model", world));
    plan_options four;
    four.micro_batches = 4;
    same_as_cpu<pipeline<one_f_one_b, tp_gpt>>(ctx, adamw{.lr = 1e-2f}, 0.05, four, &tp_tokens);
  }
}

namespace {
// Gradients summed in bf16 (bf16_reduce) on the device's buffers by its own communicator: P on the
// guarded backend equals P with bf16 sums on the CPU, bit for bit; the bf16 sums are in force where
// the data axis has two ranks or more (the parameters differ from fp32 sums).
template <class P, class O>
void bf16_sums_same_as_cpu(const context& ctx, const O& opt, double max_norm, plan_options o = {}) {
  const auto fp32 = train<P>(ctx, backend_ref{}, opt, max_norm, o, &tokens);
  o.bf16_reduce = true;
  const auto host = train<P>(ctx, backend_ref{}, opt, max_norm, o, &tokens);
  guarded_backend g;
  const auto dev = train<P>(ctx, backend_ref(g), opt, max_norm, o, &tokens, &g);
  INFO("rank " << ctx.rank() << " of " << ctx.size() << ", " << layer_name<P>() << ", gradients summed in bf16");
  same_bits(host, dev);
  if (ctx.mesh().size(axis::data) > 1) {
    CHECK(fp32.params != host.params);
    CHECK(dev.device_ops > 0);
  }
}
}  // namespace

TEST_CASE("gradients summed in bf16 on the device's buffers equal the CPU's bf16 sums, on every rank") {
  auto ctx = context::init();
  SUBCASE("data parallel, blocking buckets, sgd with momentum") {
    bf16_sums_same_as_cpu<replicate<tiny_gpt>>(ctx, sgd{.lr = 0.2f, .momentum = 0.9f}, 0, blocking(true));
  }
  SUBCASE("data parallel, non-blocking buckets, adamw clipped to 0.05") {
    bf16_sums_same_as_cpu<replicate<tiny_gpt>>(ctx, adamw{.lr = 1e-2f}, 0.05, blocking(false));
  }
  plan_options two;
  two.micro_batches = 2;
  SUBCASE("ZeRO-1, adamw clipped to 0.05") { bf16_sums_same_as_cpu<shard<tiny_gpt, 1>>(ctx, adamw{.lr = 1e-2f}, 0.05); }
  SUBCASE("ZeRO-2, two micro-batches, sgd with momentum") {
    bf16_sums_same_as_cpu<shard<tiny_gpt, 2>>(ctx, sgd{.lr = 0.2f, .momentum = 0.9f}, 0, two);
  }
  SUBCASE("ZeRO-3, two micro-batches, adamw clipped to 0.05") {
    bf16_sums_same_as_cpu<shard<tiny_gpt, 3>>(ctx, adamw{.lr = 1e-2f}, 0.05, two);
  }
}

TEST_CASE("on a device: logits come back to the host; bf16 sums through host copies are refused with a message") {
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
  plan_options bf = o;
  bf.bf16_reduce = true;
  bf.device_collectives = false;  // the packed buckets would be summed through host copies: not implemented
  auto bf16_sum = [&] { return make<replicate<tiny_gpt>>(ctx, seed{42}, bf); };
  CHECK_THROWS_WITH_AS(bf16_sum(), doctest::Contains("summing gradients in bf16 (bf16_reduce) with the network on a device (guarded) "
                                                     "needs the device's own communicator"),
                       std::invalid_argument);
  if (ctx.size() == 1) {  // a model without a strategy is a network<M>: on the given backend too
    auto net = make<tiny_gpt>(ctx, seed{42}, o);
    CHECK(g.contains(net.params().data()));
  }
}

TEST_CASE("a plan whose state does not fit its device's memory is refused on every rank, naming the device") {
  auto ctx = context::init();
  plan_options o;
  {
    guarded_backend small(std::size_t{16} << 10);  // 16 KiB: less than the parameters and gradients (44.2 KiB)
    o.backend = backend_ref(small);
    std::string said;
    try {
      (void)make<replicate<tiny_gpt>>(ctx, seed{42}, o);
    } catch (const std::runtime_error& e) {
      said = e.what();
    }
    INFO("rank " << ctx.rank() << ": " << said);
    CHECK(said.find("not enough memory: the guarded device of rank 0 needs ") != std::string::npos);
    if (ctx.rank() == 0) CHECK(said.find("are free by its guarded device") != std::string::npos);
    CHECK(small.allocator().peak_bytes_in_use == 0);  // refused before anything was placed there
  }
  guarded_backend roomy;  // the same plan on a device with room: not refused
  o.backend = backend_ref(roomy);
  CHECK_NOTHROW((void)make<replicate<tiny_gpt>>(ctx, seed{42}, o));
}

namespace {
namespace fs = std::filesystem;
std::string shared_dir(world_comm& w, const std::string& tag) { return test::shared_dir(w, "device-" + tag); }
using test::remove_dir;
struct leg {
  std::vector<float> params;  // this rank's, a host copy
  std::vector<double> losses;
};
// P on backend `be`, trained by a trainer with options `t` on data steps [from, to): loaded from
// `load` first, saved to `save` after (empty: neither).
template <class P, class O, class D>
leg trained(const context& ctx, backend_ref be, const O& opt, trainer_options t, plan_options o, D make_data, int from, int to,
            const std::string& load = {}, const std::string& save = {}) {
  o.backend = be;
  auto plan = make<P>(ctx, seed{42}, o);
  t.progress = false;
  auto data = make_data();
  trainer tr(plan, opt, t);
  leg r;
  if (!load.empty()) {
    const auto info = tr.load(load);
    CHECK(info.step == from);
  }
  for (int s = from; s < to; ++s) r.losses.push_back(tr.step(data, s));
  if (!save.empty()) tr.save(save);
  r.params.resize(static_cast<std::size_t>(plan.params().numel()));
  plan.backend().copy(r.params.data(), plan.params().data(), r.params.size() * sizeof(float));
  plan.backend().synchronize();
  return r;
}
std::size_t differing(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}
// bf16 mixed precision: P trained 5 steps on the guarded backend equals the CPU's, bit for bit.
template <class P, class O, class D = decltype(&tokens)>
void bf16_same_as_cpu(const context& ctx, const O& opt, double max_norm, const plan_options& o = {}, D make_data = &tokens) {
  trainer_options t;
  t.max_grad_norm = max_norm;
  plan_options in_bf16 = o;
  in_bf16.precision = precision::bf16;  // the plan's precision, which the trainer trains in
  const auto fp32 = trained<P>(ctx, backend_ref{}, opt, t, o, make_data, 0, 5);
  const auto host = trained<P>(ctx, backend_ref{}, opt, t, in_bf16, make_data, 0, 5);
  guarded_backend g;
  const auto dev = trained<P>(ctx, backend_ref(g), opt, t, in_bf16, make_data, 0, 5);
  INFO("rank " << ctx.rank() << " of " << ctx.size() << ", " << layer_name<P>() << ", bf16");
  CHECK(host.losses == dev.losses);
  const auto n = differing(host.params, dev.params);
  CHECK_MESSAGE(n == 0, n, " of ", host.params.size(), " parameters differ from the CPU backend's");
  CHECK(differing(fp32.params, host.params) > 0);  // bf16 was in force: it computes with other weights than fp32
}
// Checkpoints: 3 steps on one backend, saved; a fresh plan on the other loads them and trains 2
// more. Both ways (device -> CPU, CPU -> device) must equal 5 steps straight on the CPU, bit for bit.
template <class P, class O, class D = decltype(&tokens)>
void resumes_across_backends(const context& ctx, const std::string& tag, const O& opt, double max_norm, const plan_options& o = {},
                             D make_data = &tokens) {
  trainer_options t;
  t.max_grad_norm = max_norm;
  const auto straight = trained<P>(ctx, backend_ref{}, opt, t, o, make_data, 0, 5);
  const auto dir = shared_dir(ctx.world(), tag);
  for (bool from_device : {true, false}) {
    guarded_backend g;
    const backend_ref first = from_device ? backend_ref(g) : backend_ref{}, second = from_device ? backend_ref{} : backend_ref(g);
    const std::string at = dir + (from_device ? "/from-device" : "/from-cpu");
    const auto a = trained<P>(ctx, first, opt, t, o, make_data, 0, 3, {}, at);
    const auto b = trained<P>(ctx, second, opt, t, o, make_data, 3, 5, at);
    INFO("rank " << ctx.rank() << " of " << ctx.size() << ", " << layer_name<P>() << ", saved on " << std::string(first.name()) << ", loaded on "
                 << std::string(second.name()));
    std::vector<double> losses = a.losses;
    losses.insert(losses.end(), b.losses.begin(), b.losses.end());
    CHECK(losses == straight.losses);
    const auto n = differing(straight.params, b.params);
    CHECK_MESSAGE(n == 0, n, " of ", b.params.size(), " parameters differ from 5 steps straight on the CPU");
  }
  remove_dir(ctx.world(), dir);
}
}  // namespace

namespace {
// Steps queued without a host wait (trainer_options::log_every > 1): the loss, the gradient norm
// (summed over the world by the device's communicator) and the clipping scale stay where the
// plan runs, and the device's queue, not the host, waits for the gradient buckets, ZeRO's
// collectives and the pipeline's messages (device_comm::request::join). On the CPU and on the
// guarded backend the losses and parameters equal those of reading every step, and on the
// device a step waits for nothing: a run of 2 queued steps waits as often as a run of 1 (the
// read at the end), counting the backend's waits and those for its communicators.
template <class P, class O, class D = decltype(&tokens)>
void queued_same_as_read(const context& ctx, const O& opt, double max_norm, const plan_options& o = {}, D make_data = &tokens) {
  trainer_options each;
  each.max_grad_norm = max_norm;
  const auto read = trained<P>(ctx, backend_ref{}, opt, each, o, make_data, 0, 4);
  for (const bool on_device : {false, true}) {
    guarded_backend g;
    plan_options od = o;
    od.backend = on_device ? backend_ref(g) : backend_ref{};
    auto plan = make<P>(ctx, seed{42}, od);
    trainer_options t = each;
    t.progress = false;
    t.log_every = 100;
    auto data = make_data();
    trainer tr(plan, opt, t);
    auto waits = [&] { return g.ledger().host_syncs + g.ledger().device_to_host + plan.device_host_waits(); };
    std::vector<double> losses = tr.run(data, whale::steps{1}).losses;  // allocates, and reads once
    const auto w0 = waits();
    for (double l : tr.run(data, whale::steps{1}).losses) losses.push_back(l);
    const auto one = waits() - w0;
    for (double l : tr.run(data, whale::steps{2}).losses) losses.push_back(l);
    const auto two = waits() - w0 - one;
    std::vector<float> params(static_cast<std::size_t>(plan.params().numel()));
    plan.backend().copy(params.data(), plan.params().data(), params.size() * sizeof(float));
    plan.backend().synchronize();
    INFO("rank " << ctx.rank() << " of " << ctx.size() << ", " << layer_name<P>() << (on_device ? ", guarded" : ", cpu"));
    CHECK(losses == read.losses);
    const auto n = differing(read.params, params);
    CHECK_MESSAGE(n == 0, n, " of ", params.size(), " parameters differ from reading every step");
    if (on_device) CHECK_MESSAGE(two == one, "host waits: ", one, " in a run of 1 step, ", two, " in a run of 2");
  }
}
}  // namespace

TEST_CASE("steps queued on the device (log_every > 1): no host wait a step, the bits of reading every step, on every rank") {
  auto ctx = context::init();
  SUBCASE("data parallel, adamw clipped to 0.05") { queued_same_as_read<replicate<tiny_gpt>>(ctx, adamw{.lr = 1e-2f}, 0.05); }
  SUBCASE("ZeRO-2 and ZeRO-3, adamw clipped to 0.05") {
    queued_same_as_read<shard<tiny_gpt, 2>>(ctx, adamw{.lr = 1e-2f}, 0.05);
    queued_same_as_read<shard<tiny_gpt, 3>>(ctx, adamw{.lr = 1e-2f}, 0.05);
  }
  SUBCASE("a 1f1b pipeline, sgd with momentum clipped to 0.05") {
    plan_options four;
    four.micro_batches = 4;
    queued_same_as_read<replicate<pipeline<one_f_one_b, deep_tiny_gpt>>>(pipe_mesh(ctx.size()), sgd{.lr = 0.2f, .momentum = 0.9f},
                                                                          0.05, four);
  }
  SUBCASE("tensor parallelism, adamw clipped to 0.05") {
    queued_same_as_read<tp_gpt>(test::on_mesh(all_on("model", ctx.size())), adamw{.lr = 1e-2f}, 0.05, {}, &tp_tokens);
  }
}

TEST_CASE("the trainer on a device: bf16 mixed precision equals the CPU backend's, on every rank") {
  auto ctx = context::init();
  SUBCASE("data parallel, adamw clipped to 0.05") { bf16_same_as_cpu<replicate<tiny_gpt>>(ctx, adamw{.lr = 1e-2f}, 0.05); }
  SUBCASE("ZeRO-2, sgd with momentum") {
    plan_options two;
    two.micro_batches = 2;
    bf16_same_as_cpu<shard<tiny_gpt, 2>>(ctx, sgd{.lr = 0.2f, .momentum = 0.9f}, 0, two);
  }
  SUBCASE("a 1f1b pipeline, adamw clipped to 0.05") {
    plan_options four;
    four.micro_batches = 4;
    bf16_same_as_cpu<replicate<pipeline<one_f_one_b, deep_tiny_gpt>>>(pipe_mesh(ctx.size()), adamw{.lr = 1e-2f}, 0.05, four);
  }
  SUBCASE("tensor parallelism, adamw clipped to 0.05") {
    bf16_same_as_cpu<tp_gpt>(test::on_mesh(all_on("model", ctx.size())), adamw{.lr = 1e-2f}, 0.05, {}, &tp_tokens);
  }
}

TEST_CASE("checkpoints of a plan on a device load on the CPU, and back, and training continues bit for bit, on every rank") {
  auto ctx = context::init();
  SUBCASE("data parallel, adamw clipped to 0.05") {
    resumes_across_backends<replicate<tiny_gpt>>(ctx, "dp", adamw{.lr = 1e-2f}, 0.05);
  }
  SUBCASE("ZeRO-3, adamw clipped to 0.05 (the owned shard of the state on each rank)") {
    plan_options two;
    two.micro_batches = 2;
    resumes_across_backends<shard<tiny_gpt, 3>>(ctx, "zero3", adamw{.lr = 1e-2f}, 0.05, two);
  }
  SUBCASE("a 1f1b pipeline, sgd with momentum") {
    plan_options four;
    four.micro_batches = 4;
    resumes_across_backends<replicate<pipeline<one_f_one_b, deep_tiny_gpt>>>(pipe_mesh(ctx.size()), "pipe",
                                                                              sgd{.lr = 0.2f, .momentum = 0.9f}, 0, four);
  }
  SUBCASE("tensor parallelism, adamw clipped to 0.05") {
    resumes_across_backends<tp_gpt>(test::on_mesh(all_on("model", ctx.size())), "tp", adamw{.lr = 1e-2f}, 0.05, {}, &tp_tokens);
  }
  SUBCASE("save_every and resume through trainer_options, on the device") {
    trainer_options t;
    t.max_grad_norm = 0.05;
    const auto straight = trained<replicate<tiny_gpt>>(ctx, backend_ref{}, adamw{.lr = 1e-2f}, t, {}, &tokens, 0, 5);
    const auto dir = shared_dir(ctx.world(), "every");
    trainer_options s = t;
    s.checkpoint_dir = dir, s.save_every = 3;
    {
      guarded_backend g1;  // (one guarded backend at a time)
      (void)trained<replicate<tiny_gpt>>(ctx, backend_ref(g1), adamw{.lr = 1e-2f}, s, {}, &tokens, 0, 4);  // saves step 3
    }
    CHECK(fs::exists(dir + "/step-00000003/meta.txt"));
    guarded_backend g2;
    s.resume = true, s.save_every = 0;
    plan_options o;
    o.backend = backend_ref(g2);
    auto plan = make<replicate<tiny_gpt>>(ctx, seed{42}, o);
    s.progress = false;
    trainer tr(plan, adamw{.lr = 1e-2f}, s);
    auto data = tokens();
    (void)tr.run(data, steps{2});  // resumes at data step 3
    CHECK(tr.next_step() == 5);
    std::vector<float> p(static_cast<std::size_t>(plan.params().numel()));
    g2.copy(p.data(), plan.params().data(), p.size() * sizeof(float));
    INFO("rank " << ctx.rank() << " of " << ctx.size());
    CHECK(differing(straight.params, p) == 0);
    remove_dir(ctx.world(), dir);
  }
}

TEST_CASE("a network on a device: safetensors, the parameter checksum and checkpoints read and write it through the backend") {
  auto ctx = context::init();
  if (ctx.size() != 1) return;  // a network<M> is one process
  const auto dir = shared_dir(ctx.world(), "network");
  guarded_backend g;
  plan_options o;
  o.backend = backend_ref(g);
  auto cpu = make<tiny_gpt>(ctx, seed{42});
  auto dev = make<tiny_gpt>(ctx, seed{42}, o);
  REQUIRE(g.contains(dev.params().data()));
  CHECK(params_checksum(cpu) == params_checksum(dev));
  trainer_options t;
  t.progress = false;
  trainer tc(cpu, adamw{.lr = 1e-2f}, t);
  auto data = tokens();
  for (int s = 0; s < 2; ++s) (void)tc.step(data, s);
  export_safetensors(dir + "/cpu.safetensors", cpu);
  import_safetensors(dir + "/cpu.safetensors", dev);  // into the device's memory
  CHECK(params_checksum(cpu) == params_checksum(dev));
  CHECK(dev.params_on_host() == std::vector<float>(cpu.params().begin(), cpu.params().end()));
  export_safetensors(dir + "/dev.safetensors", dev);  // from the device's memory
  std::ifstream a(dir + "/cpu.safetensors", std::ios::binary), b(dir + "/dev.safetensors", std::ios::binary);
  CHECK(std::string(std::istreambuf_iterator<char>(a), {}) == std::string(std::istreambuf_iterator<char>(b), {}));
  // a checkpoint of the network on the device, loaded on the CPU: both continue alike
  trainer td(dev, adamw{.lr = 1e-2f}, t);
  td.load(tc.save(dir + "/ckpt"));  // parameters and AdamW's state, into the device
  const auto saved = td.save(dir + "/ckpt-dev");
  auto cpu2 = make<tiny_gpt>(ctx, seed{1});
  trainer tc2(cpu2, adamw{.lr = 1e-2f}, t);
  tc2.load(saved);
  for (int s = 2; s < 4; ++s) CHECK(tc.step(data, s) == td.step(data, s));
  for (int s = 2; s < 4; ++s) (void)tc2.step(data, s);
  CHECK(dev.params_on_host() == std::vector<float>(cpu.params().begin(), cpu.params().end()));
  CHECK(std::vector<float>(cpu2.params().begin(), cpu2.params().end()) == std::vector<float>(cpu.params().begin(), cpu.params().end()));
  fs::remove_all(dir);
}
