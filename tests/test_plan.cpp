// Lowering (plan/): hand-computed programs for small meshes, without MPI —
// what each rank holds and the bytes of each collective and message of one
// step — and the run-time twins of the plan rules. The same programs are
// checked against the bytes the communicators count in tests/mpi_plan.cpp.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <sstream>
#include <string>

#include "whale/models/gpt.hpp"
#include "whale/nn/gelu.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/recompute.hpp"
#include "whale/nn/relu.hpp"
#include "whale/plan/lower.hpp"
#include "whale/plan/memory.hpp"
#include "whale/plan/simulate.hpp"
#include "whale/nn/residual.hpp"
#include "whale/runtime/options.hpp"

using namespace whale;

namespace {
// Legend: B sequences per step. mlp: 8 -> 16 -> 4 classes (212 parameters).
using mlp = sequential<linear<8, 16>, relu, linear<16, 4>, softmax_cross_entropy>;
using megatron = sequential<split<sequential<linear<8, 16>, gelu, linear<16, 8>>>, softmax_cross_entropy>;
using two_stages = pipeline<gpipe, stage<linear<8, 16>, relu>, stage<linear<16, 4>, softmax_cross_entropy>>;

// Without the trainer's gradient-norm all-reduce, so that the hand-computed
// bytes below are the plan's own (its 8 bytes are checked on their own).
lower_options batch(index_t b, index_t seq = 1) {
  lower_options o;
  o.global_batch = b;
  o.seq = seq;
  o.grad_norm = false;
  return o;
}
std::int64_t sent(const program& p, op_kind k) {
  std::int64_t s = 0;
  for (const auto& o : p.ops)
    if (o.kind == k) s += o.bytes_sent;
  return s;
}
int count(const program& p, op_kind k) {
  int n = 0;
  for (const auto& o : p.ops) n += o.kind == k;
  return n;
}
}  // namespace

TEST_CASE("lowering a single-process model: every layer forward then backward, no communication") {
  const auto p = lower<mlp>(mesh_shape(1, 1, 1), 0, batch(8));
  CHECK(p.holds.size() == 4);
  CHECK(p.totals().params_held == 212);
  CHECK(p.full_params == 212);
  CHECK(count(p, op_kind::forward) == 4);
  CHECK(count(p, op_kind::backward) == 4);
  CHECK(count(p, op_kind::collective) == 0);
  CHECK(p.totals().bytes_sent == 0);
  // FLOPs from the layers' metadata: linear<8, 16> on 8 rows is 2*8*16 per row forward, twice that backward
  for (const auto& o : p.ops)
    if (o.what == "linear<8, 16>") CHECK(o.flops == (o.kind == op_kind::forward ? 8.0 * 2 * 8 * 16 : 8.0 * 4 * 8 * 16));
}

TEST_CASE("lowering replicate: one all-reduce per bucket over data, bytes of the ring model") {
  using P = replicate<mlp>;
  const auto p = lower<P>(mesh_shape(4, 1, 1), 1, batch(8));
  CHECK(p.local_sequences == 2);
  CHECK(p.holds[0].replicated_over == axes(axis::data));
  // one 25 MiB bucket of 212 floats: 2 (p-1)/p * 848 B = 1272 B, and the loss (8 B): 12 B
  CHECK(count(p, op_kind::collective) == 2);
  CHECK(p.totals().bytes_sent == 1272 + 12);
  CHECK(p.bytes_sent_over(axis::data) == 1272);  // the loss is summed over the world
  // by default the trainer's gradient norm adds one more 8-byte all-reduce over the world: 12 B more
  auto with_norm = batch(8);
  with_norm.grad_norm = true;
  const auto pn = lower<P>(mesh_shape(4, 1, 1), 1, with_norm);
  CHECK(count(pn, op_kind::collective) == 3);
  CHECK(pn.totals().bytes_sent == 1272 + 12 + 12);
  // buckets of 68 floats, from the last layer: [144, 212), [76, 144), [8, 76), [0, 8)
  auto o = batch(8);
  o.bucket_mib = 68 * 4 / 1048576.0;
  const auto q = lower<P>(mesh_shape(4, 1, 1), 0, o);
  std::vector<std::int64_t> elems;
  const op* first = nullptr;
  for (const auto& x : q.ops)
    if (x.kind == op_kind::collective && x.what.find("bucket") != std::string::npos) {
      elems.push_back(x.elements);
      if (!first) first = &x;
    }
  CHECK(elems == std::vector<std::int64_t>{68, 68, 68, 8});
  // the first bucket (linear<16, 4>'s parameters) waits for that layer's backward, not for all of backward
  REQUIRE(first);
  REQUIRE(first->deps.size() == 1);
  CHECK(q.ops[static_cast<std::size_t>(first->deps[0])].kind == op_kind::backward);
  CHECK(q.ops[static_cast<std::size_t>(first->deps[0])].what == "linear<16, 4>");
}

TEST_CASE("lowering split: Megatron's pair holds halves and all-reduces once forward, once backward") {
  const auto p = lower<megatron>(mesh_shape(1, 1, 2), 1, batch(4));
  // column_linear<8,16>: (8+1)*16/2 = 72; row_linear<16,8>: 16*8/2 + 8 (bias) = 72
  index_t held = 0;
  for (const auto& h : p.holds) held += h.local_params;
  CHECK(held == 144);
  CHECK(p.full_params == 8 * 16 + 16 + 16 * 8 + 8);
  bool col = false, row = false;
  for (const auto& h : p.holds) {
    if (h.name.find("column_linear<8, 16>") == 0) col = h.local_params == 72 && h.split_over == axes(axis::model);
    if (h.name.find("row_linear<16, 8>") == 0) row = h.local_params == 72 && h.layout_in == layout_kind::S1;
  }
  CHECK(col);
  CHECK(row);
  // 4 rows x 8 features = 128 B all-reduced over 2 ranks: 128 B sent each way, forward and backward;
  // and the loss (8 B) summed over the world
  CHECK(count(p, op_kind::collective) == 3);
  CHECK(p.totals().bytes_sent == 256 + 8);
  CHECK(p.bytes_sent_over(axis::model) == 256);
  // the sharded forms report their own per-rank cost: half the GEMM FLOPs
  const auto single = lower<sequential<linear<8, 16>, gelu, linear<16, 8>, softmax_cross_entropy>>(mesh_shape(1, 1, 1), 0, batch(4));
  double f1 = 0, f2 = 0;
  for (const auto& o : p.ops)
    if (o.kind == op_kind::forward && o.what.find("linear") != std::string::npos) f2 += o.flops;
  for (const auto& o : single.ops)
    if (o.kind == op_kind::forward && o.what.find("linear") != std::string::npos) f1 += o.flops;
  CHECK(f2 == doctest::Approx(f1 / 2));
}

TEST_CASE("lowering the class-split loss: row statistics all-reduced, logits never gathered") {
  using xc = sequential<replicate<sequential<linear<8, 16>, relu>>, split<sequential<linear<16, 40>, softmax_cross_entropy>>>;
  const auto p = lower<xc>(mesh_shape(1, 1, 2), 0, batch(4));
  // entry (backward all-reduce of d(input): 4 x 16 floats), row maxima (4 floats), sums and targets (8)
  std::int64_t gathers = 0;
  for (const auto& o : p.ops) gathers += o.kind == op_kind::collective && o.coll == coll_kind::all_gather;
  CHECK(gathers == 0);
  CHECK(p.totals().bytes_sent == 4 * 16 * 4 + 4 * 4 + 8 * 4 + 8);  // + the loss over the world
}

TEST_CASE("lowering a pipeline: activations forward and gradients back per micro-batch") {
  auto o = batch(8);
  o.micro_batches = 4;
  const auto s0 = lower<two_stages>(mesh_shape(1, 2, 1), 0, o);
  const auto s1 = lower<two_stages>(mesh_shape(1, 2, 1), 1, o);
  CHECK(s0.stages == 2);
  CHECK(s0.holds.size() == 2);
  CHECK(s1.holds.size() == 2);
  CHECK(s0.totals().params_held == 8 * 16 + 16);
  CHECK(s1.totals().params_held == 16 * 4 + 4);
  // 4 micro-batches of 2 rows x 16 features: 128 B each way per micro-batch; the loss over the world: 8 B
  CHECK(sent(s0, op_kind::send) == 4 * 128);
  CHECK(sent(s1, op_kind::send) == 4 * 128);
  CHECK(count(s0, op_kind::recv) == 4);
  CHECK(s0.totals().bytes_sent == 4 * 128 + 8);
  // GPipe: all forwards first
  CHECK(s0.ops[0].kind == op_kind::forward);
  CHECK(s0.ops[0].micro == 0);
  // a send waits for the forward that made it
  for (const auto& x : s0.ops)
    if (x.kind == op_kind::send) {
      REQUIRE(x.deps.size() == 1);
      CHECK(s0.ops[static_cast<std::size_t>(x.deps[0])].kind == op_kind::forward);
    }
  // with a data axis: buckets of each stage's own parameters over its data group
  using R = replicate<two_stages>;
  const auto r = lower<R>(mesh_shape(2, 2, 1), 3, o);
  CHECK(r.stage == 1);
  CHECK(r.local_sequences == 4);
  CHECK(r.bytes_sent_over(axis::data) == (16 * 4 + 4) * 4);  // 2 (p-1)/p with p = 2
}

namespace {
// The passes a program's compute operations run, in order: consecutive forward,
// backward, recompute or weight operations of one micro-batch and chunk are one
// pass (recompute belongs to the backward it serves).
std::vector<pipe_action> passes_of(const program& p) {
  std::vector<pipe_action> out;
  for (const auto& o : p.ops) {
    if (o.kind != op_kind::forward && o.kind != op_kind::backward && o.kind != op_kind::recompute && o.kind != op_kind::weight)
      continue;
    const auto kind = o.kind == op_kind::forward ? pipe_action::forward : o.kind == op_kind::weight ? pipe_action::weight : pipe_action::backward;
    int chunk = 0;
    for (const auto& h : p.holds)
      if (h.unit == o.unit) chunk = h.chunk;
    const pipe_action a{kind, o.micro, chunk};
    if (out.empty() || !(out.back() == a)) out.push_back(a);
  }
  return out;
}
// A schedule's own lists against the order lowering stored, on every rank of a pipe of p.
template <class Plan> void check_order(int p, int m, index_t rows = 8, index_t seq = 1) {
  using S = typename Plan::schedule;
  lower_options o;
  o.global_batch = rows;
  o.seq = seq;
  o.micro_batches = m;
  const auto rep = check_schedule<S>(p, m);
  const auto lists = schedule_lists<S>(p, m);
  for (int s = 0; s < p; ++s) {
    CAPTURE(s);
    const auto prog = lower<Plan>(mesh_shape(1, p, 1), s, o);
    const auto& order = prog.order;
    REQUIRE(order.micro_batches == m);
    CHECK(order.actions[1] == S::actions(s, p, m));
    CHECK(order.report.peak_live == rep.peak_live);
    CHECK(order.report.slot == rep.slot);
    CHECK(order.report.free_at == rep.free_at);
    CHECK(order.rounds[1] == rep.round[static_cast<std::size_t>(s)]);
    CHECK(order.actions[0] == detail::forwards_of(lists)[static_cast<std::size_t>(s)]);
    CHECK(order.messages[1] == detail::message_order(lists, rep.round, p, m, chunks_v<S>, s));
    const auto fwd = detail::forwards_of(lists);
    const auto fr = detail::replay(fwd, p, m, chunks_v<S>);
    CHECK(order.rounds[0] == fr.round[static_cast<std::size_t>(s)]);
    CHECK(order.messages[0] == detail::message_order(fwd, fr.round, p, m, chunks_v<S>, s));
    CHECK(passes_of(prog) == order.actions[1]);  // the operations run in the stored order
  }
}
}  // namespace

TEST_CASE("the program's order of passes is its schedule's, and its operations follow it") {
  using small_gpt = models::gpt_model<64, 16, 32, 2, 64, 4>;
  check_order<two_stages>(2, 4);
  check_order<pipeline<one_f_one_b, small_gpt>>(2, 4, 8, 16);
  check_order<pipeline<zb_h1, small_gpt>>(2, 4, 8, 16);
  check_order<pipeline<interleaved_1f1b<2>, small_gpt>>(2, 4, 8, 16);
  check_order<pipeline<one_f_one_b, stage<recompute<sequential<linear<8, 16>, relu>>>, stage<linear<16, 4>, softmax_cross_entropy>>>(2, 4);
  // without a pipeline: each micro-batch's forward then its backward (accumulation in one step)
  lower_options o = batch(8);
  o.micro_batches = 2;
  const auto one = lower<mlp>(mesh_shape(1, 1, 1), 0, o);
  const std::vector<pipe_action> fb{{pipe_action::forward, 0}, {pipe_action::backward, 0}, {pipe_action::forward, 1}, {pipe_action::backward, 1}};
  CHECK(one.order.actions[1] == fb);
  CHECK(passes_of(one) == fb);
  CHECK(one.order.messages[1].empty());
  // a schedule that cannot run the count is refused by lowering, naming it
  lower_options bad = batch(8, 16);
  bad.micro_batches = 3;  // interleaving needs a multiple of the pipe ranks
  using interleaved = pipeline<interleaved_1f1b<2>, small_gpt>;
  CHECK_THROWS_WITH_AS(lower<interleaved>(mesh_shape(1, 2, 1), 0, bad), doctest::Contains("interleaved"), std::invalid_argument);
}

TEST_CASE("lowering ZeRO: levels partition optimizer state, gradients and parameters") {
  for (int level = 1; level <= 3; ++level) {
    auto o = batch(8);
    o.zero_level = level;
    const auto p = lower<replicate<mlp>>(mesh_shape(2, 1, 1), 1, o);
    CHECK(p.owned_begin == 106);
    CHECK(p.owned_end == 212);
    const auto t = p.totals();
    CHECK(t.optimizer_bytes == 8 * 106);
    CHECK(t.grad_bytes == 4 * (level >= 2 ? 106 : 212));
    CHECK(t.param_bytes == 4 * (level >= 3 ? 106 : 212));
    int gathers = 0, scatters = 0, uneven = 0;
    for (const auto& x : p.ops) {
      gathers += x.kind == op_kind::collective && x.coll == coll_kind::all_gather;
      scatters += x.kind == op_kind::collective && x.coll == coll_kind::reduce_scatter;
      if (x.kind == op_kind::collective && x.coll != coll_kind::all_reduce) {
        // the bytes of an even split of the same buffer (what the link curves were measured on),
        // never more than the busiest member's
        CHECK(x.even_bytes == x.elements * 4 / 2);
        CHECK(x.slowest_bytes >= x.even_bytes);
        uneven += x.slowest_bytes > x.even_bytes;
      }
    }
    // ZeRO-2/3's reduce-scatters: the first leaf (144 parameters) is cut at 106, not at its
    // middle, and the second (68) lies in rank 1's range alone
    if (level >= 2) CHECK(uneven > 0);
    // level 1: one bucket all-reduced, parameters gathered after the update
    // level 2: each leaf with parameters reduce-scattered, parameters gathered after the update
    // level 3: each leaf gathered for forward and for backward (the last one stays held), no gather after
    CHECK(scatters == (level >= 2 ? 2 : 0));
    CHECK(gathers == (level == 3 ? 3 : 1));
  }
  // shard<M, 3> reads its level from the type
  const auto z = lower<shard<mlp, 3>>(mesh_shape(2, 1, 1), 0, batch(8));
  CHECK(z.zero_level == 3);
}

TEST_CASE("lowering recompute: the block's forward runs again before its backward") {
  using R = sequential<recompute<sequential<linear<8, 16>, relu>>, linear<16, 4>, softmax_cross_entropy>;
  const auto p = lower<R>(mesh_shape(1, 1, 1), 0, batch(4));
  CHECK(count(p, op_kind::recompute) == 2);
  int first_recompute = -1, first_backward_of_block = -1;
  for (int i = 0; i < static_cast<int>(p.ops.size()); ++i) {
    if (p.ops[static_cast<std::size_t>(i)].kind == op_kind::recompute && first_recompute < 0) first_recompute = i;
    if (p.ops[static_cast<std::size_t>(i)].kind == op_kind::backward && p.ops[static_cast<std::size_t>(i)].what == "relu")
      first_backward_of_block = i;
  }
  CHECK(first_recompute >= 0);
  CHECK(first_recompute < first_backward_of_block);
}

TEST_CASE("lowering refuses a plan the mesh cannot run, naming the rule") {
  CHECK_THROWS_WITH_AS(lower<mlp>(mesh_shape(1, 2, 1), 0, batch(8)), doctest::Contains("pipe axis"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(lower<mlp>(mesh_shape(2, 1, 1), 0, batch(8)), doctest::Contains("data axis"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(lower<replicate<mlp>>(mesh_shape(1, 1, 2), 0, batch(8)), doctest::Contains("model axis"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(lower<two_stages>(mesh_shape(1, 4, 1), 0, batch(8)), doctest::Contains("2 stages"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(lower<megatron>(mesh_shape(1, 1, 3), 0, batch(8)), doctest::Contains("cannot be split 3 ways"),
                       std::invalid_argument);
  auto o = batch(8);
  o.micro_batches = 3;
  CHECK_THROWS_WITH_AS(lower<two_stages>(mesh_shape(1, 2, 1), 0, o), doctest::Contains("do not divide"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(lower<replicate<mlp>>(mesh_shape(16, 1, 1), 0, batch(8)), doctest::Contains("smaller than"),
                       std::invalid_argument);
}

TEST_CASE("lowering the reference gpt on 1,024 ranks (data 64 x pipe 4 x model 4) is cheap and consistent") {
  constexpr index_t V = 8192, S = 128, D = 256, H = 4, F = 1024;
  using block = transformer_block<D, H, F>;
  using tp_gpt = sequential<split<embedding<V, D>>, position_embedding<S, D>, repeat<4, split<block>>, layer_norm<D>,
                            split<sequential<linear<D, V>, softmax_cross_entropy>>>;
  using P = replicate<pipeline<one_f_one_b, tp_gpt>>;
  const auto d = describe<P>();
  const mesh_shape m(64, 4, 4);
  auto o = batch(256, 128);
  const auto t0 = std::chrono::steady_clock::now();
  index_t held_model0 = 0;
  std::int64_t bytes = 0;
  for (int r = 0; r < m.size(); ++r) {
    const auto p = lower(d, m, r, o);
    if (p.coords[0] == 0 && p.coords[2] == 0) held_model0 += p.totals().params_held;
    bytes += p.totals().bytes_sent;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("lowered 1,024 ranks in " << s << " s");
  CHECK(bytes > 0);
  // one data replica, model rank 0, all stages: every layer once, sharded ones by a quarter
  CHECK(held_model0 < models::gpt::cost().params);
  CHECK(held_model0 > models::gpt::cost().params / 4);
  std::ostringstream os;
  os << lower(d, m, 5, o);
  CHECK(os.str().find("program of rank 5") != std::string::npos);
}

TEST_CASE("predicted memory, by hand: model state by ZeRO level, activations by schedule, residual sums") {
  using M = sequential<linear<16, 32>, gelu, linear<32, 8>, softmax_cross_entropy>;
  const index_t n = 16 * 32 + 32 + 32 * 8 + 8;  // 808 parameters
  // per row: linear 4(16+32) and GELU's output 4 x 32 (the gelu in its GEMM), linear 4(32+8), loss 4 x 8 = 512
  // bytes; under ZeRO-2's hooks, which turn that off: the gelu's own 8 x 32 instead of the 4 x 32, 640 bytes
  auto o = batch(8);
  o.optimizer_bytes_per_param = 4;
  const auto one = predict_memory(describe<M>(), lower<M>(mesh_shape(1, 1, 1), 0, o));
  CHECK(one.params == 4 * n);
  CHECK(one.grads == 4 * n);
  CHECK(one.optimizer == 4 * n);
  CHECK(one.activations == 512 * 8);
  CHECK(one.comm == 0);
  CHECK(one.total() == 12 * n + 512 * 8);
  // ZeRO-2 on two data ranks: gradients and optimizer state halved, 4 rows each
  const auto z = predict_memory(describe<shard<M, 2>>(), lower<shard<M, 2>>(mesh_shape(2, 1, 1), 0, o));
  CHECK(z.params == 4 * n);
  CHECK(z.grads == 4 * (n / 2));
  CHECK(z.optimizer == 4 * (n / 2));
  CHECK(z.activations == 640 * 4);
  CHECK(z.comm > 0);  // the reduce-scatter buffers of the leaves in flight
  // GPipe on two stages, 4 micro-batches of 2 rows: stage 0 keeps all 4
  // (linear<8, 16> 96 B + relu 128 B per row), plus its outgoing message copies
  auto m4 = batch(8);
  m4.micro_batches = 4;
  const auto g = predict_memory(describe<two_stages>(), lower<two_stages>(mesh_shape(1, 2, 1), 0, m4));
  CHECK(g.live_micro_batches == 4);
  CHECK(g.rows == 2);
  CHECK(g.activations == 4 * 2 * (4 * (8 + 16) + 8 * 16));
  // a residual keeps its sum and its input gradient (8 bytes per feature), which no leaf counts
  using R = sequential<residual<linear<16, 16>>, linear<16, 4>, softmax_cross_entropy>;
  const auto r = predict_memory(describe<R>(), lower<R>(mesh_shape(1, 1, 1), 0, batch(2)));
  CHECK(r.activations == 2 * (4 * 32 + 8 * 16 + 4 * 20 + 4 * 4));
}

namespace {
// A profile read from `text` as the file bad.txt (errors name it and the line).
device_profile profile_text(const std::string& text) {
  std::istringstream s(text);
  return device_profile::parse(s, "bad.txt");
}
// The same after the least a profile needs (one GEMM rate, a bandwidth): `text` starts at line 3.
device_profile profile_after_minimum(const std::string& text) { return profile_text("gemm 8 8 8 0 0 1\nbandwidth 1\n" + text); }
// Each (text, message): the text after that minimum is refused with an error containing the message.
void check_refused(std::initializer_list<std::pair<const char*, const char*>> cases) {
  for (const auto& [text, message] : cases) {
    INFO("profile text: " << text);
    CHECK_THROWS_WITH_AS(profile_after_minimum(text), doctest::Contains(message), std::invalid_argument);
  }
}
device_profile flat_profile() {  // 100 GFLOP/s at every size, 10 GB/s, 10 us + 1 GB/s links
  std::istringstream in("device flat\ngemm 64 64 64 0 0 100\nbandwidth 10\nlink node all_reduce 2 10 1\n"
                        "link node all_gather 2 10 1\nlink node reduce_scatter 2 10 1\nlink node p2p 2 10 1\n");
  return device_profile::parse(in, "flat");
}
}  // namespace

TEST_CASE("device profile: a rate that falls with size is pooled with its neighbours") {
  // 2e6 FLOPs at 10, 2e7 at 50, 2e8 at 30 (a dip), 2e9 at 40: 50 and 30 pool to their mean, 40
  // (2e9 stays at its 40), so a product cut smaller is never priced faster than the whole
  std::istringstream in("device d\ngemm 100 100 100 0 0 10\ngemm 215 215 215 0 0 50\ngemm 464 464 464 0 0 30\n"
                        "gemm 1000 1000 1000 0 0 40\nbandwidth 8\n");
  const auto p = device_profile::parse(in, "d.txt");
  CHECK(p.gemm_rate(2e6) == doctest::Approx(10e9));
  CHECK(p.gemm_rate(2 * 464.0 * 464 * 464) == doctest::Approx(40e9));
  CHECK(p.gemm_rate(2 * 215.0 * 215 * 215) == doctest::Approx(40e9));
  CHECK(p.gemm_rate(2e9) == doctest::Approx(40e9));
  double last = 0;
  for (double f = 1e6; f < 1e10; f *= 1.5) {
    CHECK(p.gemm_rate(f) >= last);
    last = p.gemm_rate(f);
  }
}

TEST_CASE("device profile: a shape's transposes by their median; thin products priced by their rows") {
  // 1000^3 measured at 40, 10 (a noisy run) and 44: the median 40, not whichever sorts last
  std::istringstream in("device d\ngemm 100 100 100 0 0 10\ngemm 1000 1000 1000 0 0 40\ngemm 1000 1000 1000 0 1 10\n"
                        "gemm 1000 1000 1000 1 0 44\nbandwidth 8\n");
  const auto p = device_profile::parse(in, "d.txt");
  CHECK(p.gemm_rate(2e9) == doctest::Approx(40e9));
  CHECK(p.gemm_rate(std::sqrt(2e6 * 2e9)) == doctest::Approx(25e9));
  // thin shapes: 64 rows at half the size curve's rate, 512 rows at 90% of it (by the median of
  // the three forms); the size curve is left alone by them
  std::istringstream thin("device t\ngemm 100 100 100 0 0 10\ngemm 1000 1000 1000 0 0 40\n"
                          "gemm 64 16384 2048 0 1 20\ngemm 64 2048 16384 0 0 19\ngemm 16384 2048 64 1 0 21\n"
                          "gemm 512 16384 2048 0 1 36\ngemm 512 2048 16384 0 0 36\ngemm 16384 2048 512 1 0 30\nbandwidth 8\n");
  const auto q = device_profile::parse(thin, "t.txt");
  CHECK(q.gemm_rate(2e9) == doctest::Approx(40e9));               // rows not known: the size curve
  CHECK(q.gemm_rate(2e9, 64) == doctest::Approx(20e9));           // the 64-row factor, 0.5
  CHECK(q.gemm_rate(2e9, 16) == doctest::Approx(20e9));           // below the thinnest: its factor
  CHECK(q.gemm_rate(2e9, 512) == doctest::Approx(36e9));          // 0.9
  CHECK(q.gemm_rate(2e9, std::sqrt(64.0 * 512)) == doctest::Approx(28e9));  // halfway in log(rows)
  CHECK(q.gemm_rate(2e9, 4096) == doctest::Approx(40e9));         // 8 x 512 rows: no longer thin
  CHECK(q.gemm_rate(2e9, 512 * std::sqrt(8.0)) == doctest::Approx(38e9));  // halfway there
  CHECK(q.gemm_rate(2e6, 64) == doctest::Approx(5e9));            // the factor applies at every size
  // written and read back: the same rates
  std::ostringstream out;
  out << q;
  std::istringstream again(out.str());
  CHECK(device_profile::parse(again, "again").gemm_rate(2e9, 64) == doctest::Approx(20e9));
  // `thin` lines (factors measured in turns with a square product) are the factors when
  // present, in any order, and the thin gemm shapes then price nothing
  std::istringstream lines("device l\ngemm 100 100 100 0 0 10\ngemm 1000 1000 1000 0 0 40\n"
                           "gemm 64 16384 2048 0 1 20\nthin 512 0.9\nthin 32 0.25\nthin 128 0.5\nbandwidth 8\n");
  const auto l = device_profile::parse(lines, "l.txt");
  CHECK(l.gemm_rate(2e9) == doctest::Approx(40e9));
  CHECK(l.gemm_rate(2e9, 16) == doctest::Approx(10e9));   // below the thinnest line: its factor
  CHECK(l.gemm_rate(2e9, 64) == doctest::Approx(15e9));   // halfway between 32 and 128 rows in log
  CHECK(l.gemm_rate(2e9, 128) == doctest::Approx(20e9));  // not the 64-row gemm shape's 0.5 at 64
  CHECK(l.gemm_rate(2e9, 4096) == doctest::Approx(40e9));
  std::ostringstream written;
  written << l;
  std::istringstream read_back(written.str());
  CHECK(device_profile::parse(read_back, "again").gemm_rate(2e9, 64) == doctest::Approx(15e9));
  // thin lines of two layer widths (in x out; none given: 1024 x 4096): each width's factor at the
  // rows, interpolated in log(width) between them, the nearest's beyond; the width is flops / (2 rows)
  std::istringstream wide("device w\ngemm 1000 1000 1000 0 0 40\nthin 64 0.8\nthin 256 1.0\nthin 64 0.4 400000000\nbandwidth 8\n");
  const auto wd = device_profile::parse(wide, "w.txt");
  const double narrow = thin_point::default_width, broad = 4e8;
  CHECK(wd.gemm_rate(2 * 64 * narrow, 64) == doctest::Approx(32e9));
  CHECK(wd.gemm_rate(2 * 64 * broad, 64) == doctest::Approx(16e9));
  CHECK(wd.gemm_rate(2 * 64 * std::sqrt(narrow * broad), 64) == doctest::Approx(24e9));  // halfway in log(width)
  CHECK(wd.gemm_rate(2 * 64 * 1e10, 64) == doctest::Approx(16e9));  // wider than measured: the widest's factor
  CHECK(wd.gemm_rate(2 * 64 * 1e5, 64) == doctest::Approx(32e9));   // narrower: the narrowest's
  CHECK(wd.gemm_rate(2 * 128 * narrow, 128) == doctest::Approx(36e9));  // each width by its own rows
  CHECK(wd.gemm_rate(2 * 128 * broad, 128) == doctest::Approx(24e9));   // a third of the way to 1 at 8 x 64 rows
  CHECK(wd.gemm_rate(2 * 32 * broad, 32) == doctest::Approx(16e9));     // below its one line: its factor
  CHECK(wd.gemm_rate(2 * 64 * narrow) == doctest::Approx(40e9));        // rows not known: not thin
  std::ostringstream wide_out;
  wide_out << wd;
  CHECK(wide_out.str().find("thin 64 0.4 400000000\n") != std::string::npos);
  CHECK(wide_out.str().find("thin 64 0.8\n") != std::string::npos);  // the default width is not written
  std::istringstream wide_again(wide_out.str());
  CHECK(device_profile::parse(wide_again, "again").gemm_rate(2 * 64 * broad, 64) == doctest::Approx(16e9));
  const auto bad = profile_text;
  CHECK_THROWS_WITH_AS(bad("gemm 8 8 8 0 0 1\nthin 64\nbandwidth 1\n"), doctest::Contains("bad.txt:2: 'thin' takes ROWS FACTOR"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(bad("gemm 8 8 8 0 0 1\nthin 64 0\nbandwidth 1\n"), doctest::Contains("bad.txt:2: FACTOR '0'"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(bad("gemm 8 8 8 0 0 1\nthin 64 nan\nbandwidth 1\n"), doctest::Contains("bad.txt:2: FACTOR 'nan'"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(bad("gemm 8 8 8 0 0 1\nthin -5 0.5\nbandwidth 1\n"), doctest::Contains("bad.txt:2: ROWS '-5'"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(bad("gemm 8 8 8 0 0 1\nthin 64 0.5\nthin 64 0.6\nbandwidth 1\n"), doctest::Contains("bad.txt:3: a second 'thin' line for 64 rows"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(bad("gemm 8 8 8 0 0 1\nthin 64 0.5 9\nthin 64 0.6 9\nbandwidth 1\n"), doctest::Contains("bad.txt:3: a second 'thin' line for 64 rows through a layer of width 9"), std::invalid_argument);
  CHECK_NOTHROW(bad("gemm 8 8 8 0 0 1\nthin 64 0.5\nthin 64 0.6 9\nbandwidth 1\n"));  // another width
  CHECK_THROWS_WITH_AS(bad("gemm 8 8 8 0 0 1\nthin 64 0.5 2x\nbandwidth 1\n"), doctest::Contains("bad.txt:2: WIDTH '2x'"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(bad("gemm 8 8 8 0 0 1\nthin 64 0.5 0\nbandwidth 1\n"), doctest::Contains("bad.txt:2: WIDTH '0'"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(bad("gemm 8 8 8 0 0 1\nthin 64 0.5 9 9\nbandwidth 1\n"), doctest::Contains("bad.txt:2: 'thin' takes ROWS FACTOR [WIDTH]"), std::invalid_argument);
}

TEST_CASE("device profile: the text format, interpolated GEMM rates, α–β links, errors with file and line") {
  std::istringstream in("# a comment\ndevice d\ngemm 100 100 100 0 0 10\ngemm 1000 1000 1000 0 1 40\nbandwidth 8\n"
                        "link node all_reduce 4 20 2\n");
  const auto p = device_profile::parse(in, "d.txt");
  CHECK(p.name == "d");
  CHECK(p.gemm_rate(2e6) == doctest::Approx(10e9));    // the smallest shape's rate below it
  CHECK(p.gemm_rate(2e9) == doctest::Approx(40e9));    // the largest's above it
  CHECK(p.gemm_rate(std::sqrt(2e6 * 2e9)) == doctest::Approx(25e9));  // halfway in log(size)
  CHECK(p.gemm_rate(2e9, 64) == doctest::Approx(40e9));  // no thin shapes measured: rows change nothing
  CHECK(p.link_time(link_level::node, link_kind::all_reduce, 4, 2e9) == doctest::Approx(20e-6 + 1.0));
  CHECK(p.link_time(link_level::node, link_kind::all_reduce, 7, 0) == doctest::Approx(40e-6));  // 6 ring steps against 3
  CHECK_THROWS_WITH_AS(p.link_time(link_level::net, link_kind::all_reduce, 4, 1), doctest::Contains("no all_reduce figures for the net level"), std::logic_error);
  std::ostringstream round;
  round << p;
  std::istringstream again(round.str());
  CHECK(device_profile::parse(again, "again").gemm.size() == 2);
  const auto bad = profile_text;
  CHECK_THROWS_WITH_AS(bad("gemm 1 2\n"), doctest::Contains("bad.txt:1: 'gemm' takes M N K TA TB GFLOPS"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(bad("gemm 8 8 8 0 0 fast\nbandwidth 1\n"), doctest::Contains("bad.txt:1: GFLOPS 'fast'"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(bad("gemm 8 8 8 0 0 1\nbandwidth 1\nlink lan p2p 2 1 1\n"), doctest::Contains("bad.txt:3: link level 'lan'"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(bad("bandwidth 1\n"), doctest::Contains("no 'gemm' line"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(bad("speed 3\n"), doctest::Contains("unknown entry 'speed'"), std::invalid_argument);
}

TEST_CASE("device profile: attention's per-head products at their measured rate, by sequence and head width") {
  std::istringstream in("device a\ngemm 100 100 100 0 0 100\nattention 256 64 40\nattention 64 64 20\nattention 256 128 80\nbandwidth 8\n");
  const auto p = device_profile::parse(in, "a.txt");
  CHECK(p.attention_rate(64, 64) == doctest::Approx(20e9));   // on a line: its rate
  CHECK(p.attention_rate(128, 64) == doctest::Approx(30e9));  // halfway in log(seq)
  CHECK(p.attention_rate(16, 64) == doctest::Approx(20e9));   // below the shortest sequence: its rate
  CHECK(p.attention_rate(4096, 64) == doctest::Approx(40e9)); // beyond the longest: its rate
  CHECK(p.attention_rate(256, std::sqrt(64.0 * 128.0)) == doctest::Approx(60e9));  // halfway in log(head width)
  CHECK(p.attention_rate(64, 256) == doctest::Approx(80e9));  // beyond the widest head: its (only) line
  CHECK(p.attention_rate(64, 32) == doctest::Approx(20e9));
  CHECK(p.attention_rate(64, 0) == 0);  // no context products
  std::istringstream none("device n\ngemm 100 100 100 0 0 100\nbandwidth 8\n");
  CHECK(device_profile::parse(none, "n.txt").attention_rate(128, 64) == 0);  // not measured: priced as GEMMs
  std::ostringstream round;
  round << p;
  CHECK(round.str().find("attention 64 64 20\n") != std::string::npos);
  std::istringstream again(round.str());
  CHECK(device_profile::parse(again, "again").attention_rate(128, 64) == doctest::Approx(30e9));
  check_refused({{"attention 64 64\n", "bad.txt:3: 'attention' takes SEQ HEAD_DIM GFLOPS"},
                 {"attention 64 64 nan\n", "bad.txt:3: GFLOPS 'nan'"},
                 {"attention 64 64 0\n", "bad.txt:3: GFLOPS '0'"},
                 {"attention -5 64 1\n", "bad.txt:3: SEQ '-5'"},
                 {"attention 64 2x 1\n", "bad.txt:3: HEAD_DIM '2x'"},
                 {"attention 64 64 1\nattention 64 64 2\n", "bad.txt:4: a second 'attention' line for sequence 64 and head width 64"}});
}

TEST_CASE("device profile: a layer's backward products at the factor for its narrower side") {
  const auto p = profile_after_minimum("backward 4096 0.96\nbackward 256 0.8\n");
  CHECK(p.backward_factor(256) == doctest::Approx(0.8));
  CHECK(p.backward_factor(1024) == doctest::Approx(0.88));  // halfway in log(width)
  CHECK(p.backward_factor(64) == doctest::Approx(0.8));     // narrower than every line: the narrowest's
  CHECK(p.backward_factor(16384) == doctest::Approx(0.96));
  CHECK(p.backward_factor(0) == 1.0);                        // not known
  CHECK(profile_after_minimum("").backward_factor(256) == 1.0);  // no lines
  std::ostringstream round;
  round << p;
  CHECK(round.str().find("backward 256 0.8\n") != std::string::npos);
  std::istringstream again(round.str());
  CHECK(device_profile::parse(again, "again").backward_factor(1024) == doctest::Approx(0.88));
  check_refused({{"backward 256\n", "bad.txt:3: 'backward' takes NARROW FACTOR"},
                 {"backward 256 nan\n", "bad.txt:3: FACTOR 'nan'"},
                 {"backward 256 2.5\n", "bad.txt:3: FACTOR '2.5'"},
                 {"backward -5 0.9\n", "bad.txt:3: NARROW '-5'"},
                 {"backward 256 0.9\nbackward 256 0.8\n", "bad.txt:4: a second 'backward' line for layers 256 features wide"}});
}

TEST_CASE("device profile: several runs of one measurement make one profile of their medians") {
  // three runs of the same entries, one of them a fast spell: each figure is the middle run's
  auto run = [](double gemm, double thin, double att, double back, double bw, double alpha_us, double point_us) {
    std::ostringstream t;
    t << "device vm-2-ranks\ngemm 64 64 64 0 0 " << gemm << "\ngemm 64 64 64 0 1 " << 2 * gemm << "\nthin 16 " << thin
      << " 4194304\nattention 128 64 " << att << "\nbackward 256 " << back << "\nbandwidth " << bw
      << "\ncores 2 2 " << bw / 100 << "\nlink node all_reduce 2 " << alpha_us << " 1\npoint node all_reduce 4096 " << point_us
      << "\npoint node all_reduce 8192 " << 2 * point_us << "\n";
    return profile_text(t.str());
  };
  const auto m = median_profile({run(100, 0.5, 70, 0.9, 10, 5, 20), run(130, 0.7, 90, 0.8, 12, 4, 10), run(110, 0.6, 75, 0.95, 11, 6, 30)});
  CHECK(m.gemm.at(0).gflops == doctest::Approx(110));
  CHECK(m.gemm.at(1).gflops == doctest::Approx(220));
  CHECK(m.thin.at(0).factor == doctest::Approx(0.6));
  CHECK(m.attention_rate(128, 64) == doctest::Approx(75e9));
  CHECK(m.backward_factor(256) == doctest::Approx(0.9));
  CHECK(m.bandwidth_bps == doctest::Approx(11e9));
  CHECK(m.waiting_share == doctest::Approx(0.11));  // the bandwidth's hundredth in each run
  const auto& ar = m.links[0][0];
  CHECK(ar.alpha_s == doctest::Approx(5e-6));
  CHECK(ar.points.at(0).second == doctest::Approx(20e-6));
  CHECK(ar.points.at(1).second == doctest::Approx(40e-6));
  CHECK(m.gemm_rate(2.0 * 64 * 64 * 64) == doctest::Approx(165e9));  // the size curve settled on the medians
  // runs of different measurements are refused, naming what differs
  CHECK_THROWS_WITH_AS(median_profile({run(1, 1, 1, 1, 1, 1, 1), profile_after_minimum("")}),
                       doctest::Contains("the runs differ in how many 'gemm' lines they have"), std::invalid_argument);
  auto edited = [&](const std::string& from, const std::string& to) {
    std::ostringstream t;
    t << run(1, 1, 1, 1, 1, 1, 1);
    std::string text = t.str();
    REQUIRE(text.find(from) != std::string::npos);
    text.replace(text.find(from), from.size(), to);
    return profile_text(text);
  };
  CHECK_THROWS_WITH_AS(median_profile({run(1, 1, 1, 1, 1, 1, 1), edited("gemm 64 64 64 0 1", "gemm 64 64 64 1 0")}),
                       doctest::Contains("the runs differ in 'gemm' line 2"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(median_profile({run(1, 1, 1, 1, 1, 1, 1), edited("cores 2 2", "cores 4 2")}),
                       doctest::Contains("'cores' lines"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(median_profile({run(1, 1, 1, 1, 1, 1, 1), edited("point node all_reduce 8192", "point node all_reduce 16384")}),
                       doctest::Contains("'point' lines' sizes"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(median_profile({}), doctest::Contains("no runs"), std::invalid_argument);
}

TEST_CASE("simulate: a layer's backward GEMMs at the backward factor, its forward as before") {
  // one linear layer 256 -> 64 (narrower side 64) and the loss: its backward GEMMs are 4 FLOPs per
  // weight per row; at half the rate they take twice as long, and nothing else moves
  using M = sequential<linear<256, 64>, softmax_cross_entropy>;
  const auto d = describe<M>();
  const index_t rows = 32;
  const auto p = lower(d, mesh_shape(1, 1, 1), 0, batch(rows));
  const auto flat = flat_profile();  // every GEMM at 100 GFLOP/s
  std::istringstream in("device half-backward\ngemm 64 64 64 0 0 100\nbackward 64 0.5\nbackward 1024 0.9\nbandwidth 10\n");
  const auto half = device_profile::parse(in, "half-backward");
  const double backward_gemm = 4.0 * 256 * 64 * rows;
  const double before = simulate(d, {p}, flat).step_s, after = simulate(d, {p}, half).step_s;
  CHECK((after - before) / (backward_gemm / 100e9) == doctest::Approx(1.0).epsilon(1e-9));
}

TEST_CASE("simulate: a split layer's backward factor is read at this rank's share of its weight") {
  // 256 -> 128 -> 256 split over 2 ranks: each holds 256 x 64 of the first (split along its
  // outputs) and 64 x 256 of the second (along its inputs), both 64 wide where the unsplit
  // layers are 128; a factor of 0.5 at 64 and 1 from 128 up doubles their backward GEMMs
  using M = sequential<split<sequential<linear<256, 128>, gelu, linear<128, 256>>>, softmax_cross_entropy>;
  const auto d = describe<M>();
  const index_t rows = 32;
  const auto p0 = lower(d, mesh_shape(1, 1, 2), 0, batch(rows)), p1 = lower(d, mesh_shape(1, 1, 2), 1, batch(rows));
  const auto flat = flat_profile();
  auto slow = flat;
  slow.backward = {{64, 0.5}, {128, 1.0}};
  const double backward_gemm = 2 * 4.0 * 256 * 64 * rows;  // both layers, this rank's share
  const double before = simulate(d, {p0, p1}, flat).step_s, after = simulate(d, {p0, p1}, slow).step_s;
  CHECK((after - before) / (backward_gemm / 100e9) == doctest::Approx(1.0).epsilon(1e-9));
  // unsplit, the same layers are 128 wide: factor 1, nothing moves
  const auto one = lower(d, mesh_shape(1, 1, 1), 0, batch(rows));
  CHECK(simulate(d, {one}, slow).step_s == doctest::Approx(simulate(d, {one}, flat).step_s).epsilon(1e-12));
}

TEST_CASE("simulate: attention's context products at the profile's attention rate, the rest of its GEMMs as before") {
  // attention of 2 heads of width 8 on sequences of 32: Q K^T and P V are 4 D FLOPs per row per
  // token of context, twice that backward; its head width reaches the cost whole when split
  using A = causal_self_attention<16, 2>;
  static_assert(A::cost().seq_inner == 8);
  static_assert(detail::shard_of(A::cost(), 2, 0, 0).seq_inner == 8);
  static_assert((A::cost() += linear<16, 16>::cost()).seq_inner == 8);
  using M = sequential<A, linear<16, 4>, softmax_cross_entropy>;
  const auto d = describe<M>();
  const index_t seqs = 4, T = 32;
  const auto p = lower(d, mesh_shape(1, 1, 1), 0, batch(seqs, T));
  const auto flat = flat_profile();  // every GEMM at 100 GFLOP/s
  std::istringstream in("device flat-attention\ngemm 64 64 64 0 0 100\nattention 32 8 25\nbandwidth 10\n");
  const auto att = device_profile::parse(in, "flat-attention");
  const double context = 3.0 * static_cast<double>(seqs * T) * 4.0 * 16 * T;  // forward once, backward twice
  const double before = simulate(d, {p}, flat).step_s, after = simulate(d, {p}, att).step_s;
  // as a ratio, to 1e-9: counted twice it would be 4/3, backward once 2/3
  CHECK((after - before) / (context / 25e9 - context / 100e9) == doctest::Approx(1.0).epsilon(1e-9));
}

TEST_CASE("device profile: measured link points are followed between and beyond them, α–β without them") {
  std::istringstream in("device d\ngemm 8 8 8 0 0 1\nbandwidth 1\nlink node all_reduce 4 10 1\n"
                        "point node all_reduce 1000000 1000\npoint node all_reduce 2000000 4000\n");
  const auto p = device_profile::parse(in, "d.txt");
  const auto ar = [&](double bytes, int ranks = 4) { return p.link_time(link_level::node, link_kind::all_reduce, ranks, bytes); };
  CHECK(ar(1e6) == doctest::Approx(1e-3));                 // on a point: its time
  CHECK(ar(1.5e6) == doctest::Approx(2.5e-3));             // between two: linear
  CHECK(ar(3e6) == doctest::Approx(7e-3));                 // beyond the last: the last slope (3 ms per MB)
  CHECK(ar(5e5) == doctest::Approx(0.5 * (10e-6 + 1e-3)));  // below the first: from (0, alpha)
  CHECK(ar(1e6, 7) == doctest::Approx(1e-3 + 10e-6 * 2));  // 6 ring steps against 3: two more latencies
  // an uneven collective (the busiest rank sends 3 MB where an even split of its buffer sends
  // 1.5 MB): the points read at the even split (2.5 ms), the part past the latency scaled by 2;
  // read at 3 MB they would have said 7 ms (the last slope, a bigger buffer's cache regime)
  const auto uneven = [&](double bytes, double even) {
    return p.link_time(link_level::node, link_kind::all_reduce, 4, bytes, 1, even);
  };
  CHECK(uneven(3e6, 1.5e6) == doctest::Approx(10e-6 + (2.5e-3 - 10e-6) * 2));
  CHECK(uneven(1.5e6, 1.5e6) == doctest::Approx(ar(1.5e6)));  // even: as before
  CHECK(uneven(1.5e6, 0) == doctest::Approx(ar(1.5e6)));      // not given: as before
  std::ostringstream round;
  round << p;
  std::istringstream again(round.str());
  CHECK(device_profile::parse(again, "again").link_time(link_level::node, link_kind::all_reduce, 4, 1.5e6) == doctest::Approx(2.5e-3));
  const auto bad = profile_after_minimum;
  CHECK_THROWS_WITH_AS(bad("point node p2p 100 1\n"), doctest::Contains("bad.txt:3: a point of node p2p before its 'link' line"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(bad("link node p2p 2 1 1\npoint node p2p 100 5\npoint node p2p 50 6\n"),
                       doctest::Contains("bad.txt:5: the points of node p2p must grow"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(bad("link node p2p 2 1 1\npoint node p2p 100 -5\n"), doctest::Contains("bad.txt:4: MICROSECONDS"),
                       std::invalid_argument);
  // without points: alpha + bytes / beta, as before
  std::istringstream plain("gemm 8 8 8 0 0 1\nbandwidth 1\nlink node p2p 2 10 1\n");
  CHECK(device_profile::parse(plain, "p").link_time(link_level::node, link_kind::p2p, 2, 1e9) == doctest::Approx(1.0 + 10e-6));
}

TEST_CASE("simulate: data parallel ranks end together, communication is the sum of α–β times, a pipeline idles") {
  const auto dev = flat_profile();
  using M = sequential<linear<64, 64>, relu, linear<64, 8>, softmax_cross_entropy>;
  auto o = batch(64);
  // one rank: compute only, GEMMs at 100 GFLOP/s plus the kept bytes at 10 GB/s, nothing waits
  const auto d1 = describe<M>();
  const auto one = simulate(d1, {lower(d1, mesh_shape(1, 1, 1), 0, o)}, dev);
  CHECK(one.ranks[0].comm_s == 0);
  CHECK(one.ranks[0].wait_s == 0);
  CHECK(one.step_s == doctest::Approx(one.ranks[0].compute_s));
  const double gemm = 3 * 2.0 * (64 * 64 + 64 + 64 * 8 + 8) * 64;  // forward and backward (twice) of both linears
  CHECK(one.ranks[0].compute_s > gemm / 100e9);
  // two replicas: the same end, and their communication is each collective's α + bytes/β
  const auto d2 = describe<replicate<M>>();
  std::vector<program> ps;
  for (int r = 0; r < 2; ++r) ps.push_back(lower(d2, mesh_shape(2, 1, 1), r, o));
  const auto two = simulate(d2, ps, dev);
  CHECK(two.ranks[0].end_s == doctest::Approx(two.ranks[1].end_s));
  double comm = 0;
  for (const auto& op : ps[0].ops)
    if (op.kind == op_kind::collective) comm += 10e-6 + static_cast<double>(op.bytes_sent) / 1e9;
  CHECK(two.ranks[0].comm_s == doctest::Approx(comm));
  CHECK(two.step_s == doctest::Approx(two.ranks[0].compute_s + comm + two.ranks[0].wait_s));
  // a pipeline of two stages: each rank waits for the other (the bubble)
  std::vector<program> pp;
  auto m = batch(8);
  m.micro_batches = 4;
  for (int r = 0; r < 2; ++r) pp.push_back(lower(describe<two_stages>(), mesh_shape(1, 2, 1), r, m));
  const auto pipe = simulate(describe<two_stages>(), pp, dev);
  CHECK(pipe.bubble() > 0);
  CHECK(pipe.step_s > pipe.ranks[0].compute_s);
  CHECK(pipe.spans.size() > pp[0].ops.size());
}

TEST_CASE("simulate: an uneven ZeRO reduce-scatter reads the measured points at its buffer's even split") {
  // reduce-scatter points with a cliff past 300 bytes (a buffer leaving the caches)
  std::istringstream in("device cliff\ngemm 64 64 64 0 0 100\nbandwidth 10\nlink node all_reduce 2 10 1\n"
                        "link node all_gather 2 10 1\nlink node p2p 2 10 1\nlink node reduce_scatter 2 1 1\n"
                        "point node reduce_scatter 100 1\npoint node reduce_scatter 300 3\npoint node reduce_scatter 400 100\n");
  const auto dev = device_profile::parse(in, "cliff");
  auto o = batch(8);
  o.zero_level = 2;
  const auto d = describe<replicate<mlp>>();
  std::vector<program> ps;
  for (int r = 0; r < 2; ++r) ps.push_back(lower(d, mesh_shape(2, 1, 1), r, o));
  auto flat = ps;  // the same programs priced at the busiest member's bytes
  double expect = 0;
  int uneven = 0;
  for (auto& p : flat)
    for (auto& x : p.ops) x.even_bytes = 0;
  for (const auto& x : ps[0].ops)
    if (x.kind == op_kind::collective && x.coll == coll_kind::reduce_scatter) {
      const double b = static_cast<double>(x.slowest_bytes), e = static_cast<double>(x.even_bytes);
      expect += dev.link_time(link_level::node, link_kind::reduce_scatter, 2, b, 1, e) -
                dev.link_time(link_level::node, link_kind::reduce_scatter, 2, b);
      uneven += b > e;
    }
  CHECK(uneven == 2);  // the 144-parameter leaf cut at 106 (424 B busiest, 288 even), the 68 in rank 1's range
  CHECK(expect < 0);   // 424 B lies past the cliff, 288 B before it
  const auto a = simulate(d, ps, dev), b = simulate(d, flat, dev);
  CHECK(a.ranks[0].comm_s - b.ranks[0].comm_s == doctest::Approx(expect));
}

TEST_CASE("simulate with ranks sharing cores: alone a rank runs faster than figures measured with all busy, all together as measured") {
  auto shared = flat_profile();
  shared.cores = 1;                 // 2 ranks on 1 core,
  shared.cores_measured_ranks = 2;  // and the figures measured with both computing
  CHECK(shared.sharing_slowdown(2, 2) == doctest::Approx(1.0));
  CHECK(shared.sharing_slowdown(1, 2) == doctest::Approx(0.5));    // the other rank waits and yields its core
  CHECK(shared.sharing_slowdown(0.5, 2) == doctest::Approx(0.5));  // never faster than one rank on its own core
  CHECK(flat_profile().sharing_slowdown(1, 3) == 1.0);             // no `cores` entry: a device per rank
  auto polling = shared;
  polling.waiting_share = 0.5;  // a waiting rank polls, taking half a core
  CHECK(polling.sharing_slowdown(1, 2) == doctest::Approx(0.75));
  // a pipeline of one micro-batch: the stages take turns, so every compute runs alone, at twice the figures
  std::vector<program> pp;
  auto m = batch(8);
  m.micro_batches = 1;
  const auto d = describe<two_stages>();
  for (int r = 0; r < 2; ++r) pp.push_back(lower(d, mesh_shape(1, 2, 1), r, m));
  const auto own = simulate(d, pp, flat_profile()), turns = simulate(d, pp, shared);
  for (int r = 0; r < 2; ++r)
    CHECK(turns.ranks[static_cast<std::size_t>(r)].compute_s ==
          doctest::Approx(0.5 * own.ranks[static_cast<std::size_t>(r)].compute_s).epsilon(1e-6));
  // two replicas compute at the same times: as the figures say
  using M = sequential<linear<64, 64>, relu, linear<64, 8>, softmax_cross_entropy>;
  const auto d2 = describe<replicate<M>>();
  std::vector<program> ps;
  for (int r = 0; r < 2; ++r) ps.push_back(lower(d2, mesh_shape(2, 1, 1), r, batch(64)));
  CHECK(simulate(d2, ps, shared).step_s == doctest::Approx(simulate(d2, ps, flat_profile()).step_s));
  // many micro-batches: the stages overlap between the fill and the drain, so the step lies in between
  m.micro_batches = 8;
  std::vector<program> p8;
  for (int r = 0; r < 2; ++r) p8.push_back(lower(d, mesh_shape(1, 2, 1), r, m));
  const double a = simulate(d, p8, flat_profile()).step_s, b = simulate(d, p8, shared).step_s;
  CHECK(b < a);
  CHECK(b > 0.5 * a);
  CHECK(simulate(d, p8, polling).step_s > b);  // waiting ranks that poll leave less to the others
  // the entry round-trips and is checked
  std::ostringstream os;
  os << shared;
  std::istringstream back(os.str());
  const auto again = device_profile::parse(back, "again");
  CHECK(again.cores == 1);
  CHECK(again.cores_measured_ranks == 2);
  const auto bad = profile_after_minimum;
  CHECK_THROWS_WITH_AS(bad("cores 0 2 0\n"), doctest::Contains("bad.txt:3: CORES"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(bad("cores 2 2 1.5\n"), doctest::Contains("bad.txt:3: WAITING"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(bad("cores 2 2\n"), doctest::Contains("'cores' takes CORES RANKS WAITING"), std::invalid_argument);
}

TEST_CASE("simulate with two streams: a gradient bucket hides under the backward that follows it, nothing else moves") {
  auto one = flat_profile();
  auto two = flat_profile();
  two.streams = 2;
  std::ostringstream printed;
  printed << two;
  std::istringstream again(printed.str());
  CHECK(device_profile::parse(again, "two").streams == 2);
  std::istringstream bad("gemm 8 8 8 0 0 1\nbandwidth 1\nstreams 3\n");
  CHECK_THROWS_WITH_AS(device_profile::parse(bad, "bad.txt"), doctest::Contains("bad.txt:3: streams"), std::invalid_argument);
  using M = sequential<linear<64, 64>, relu, linear<64, 8>, softmax_cross_entropy>;
  const auto d = describe<replicate<M>>();
  auto run = [&](const device_profile& dev, double bucket_mib) {
    auto o = batch(512);
    o.bucket_mib = bucket_mib;
    std::vector<program> ps;
    for (int r = 0; r < 2; ++r) ps.push_back(lower(d, mesh_shape(2, 1, 1), r, o));
    return std::pair{simulate(d, ps, dev), ps[0]};
  };
  // one bucket: it waits for the last backward, so there is nothing to overlap
  const auto [a1, p1] = run(one, 25);
  const auto [a2, p2] = run(two, 25);
  CHECK(a2.step_s == doctest::Approx(a1.step_s));
  // buckets of 520 floats: linear<64, 8>'s gradients are one bucket, ready before the
  // backward of relu and linear<64, 64>; with two streams exactly its time is hidden
  const double mib = 520.0 * 4 / 1048576.0;
  const auto [b1, q1] = run(one, mib);
  const auto [b2, q2] = run(two, mib);
  double early = 0;  // the bucket of the second linear's parameters [4160, 4680)
  int buckets = 0;
  for (const auto& op : q1.ops)
    if (op.kind == op_kind::collective && op.what.find("gradient bucket") != std::string::npos) {
      ++buckets;
      if (op.what.find("[4160, 4680)") != std::string::npos) early = 10e-6 + static_cast<double>(op.bytes_sent) / 1e9;
    }
  REQUIRE(buckets == 9);
  REQUIRE(early > 0);
  CHECK(b1.step_s == doctest::Approx(a1.step_s + 8 * 10e-6));  // one stream: 8 more latencies, nothing hidden
  CHECK(b2.step_s == doctest::Approx(b1.step_s - early));
  // the compute stream's end is its compute plus its stalls; the communication stream's time is all of it
  CHECK(b2.ranks[0].end_s == doctest::Approx(b2.ranks[0].compute_s + b2.ranks[0].wait_s));
  CHECK(b2.ranks[0].comm_s == doctest::Approx(b1.ranks[0].comm_s));
}

TEST_CASE("the shipped device profiles parse and price a 3-D plan on 64 ranks") {
  using P = replicate<pipeline<one_f_one_b, models::gpt_model<64, 16, 32, 2, 64, 4>>>;
  const auto d = describe<P>();
  const auto mesh = mesh_shape(16, 4, 1);
  auto o = batch(64, 16);
  o.micro_batches = 4;
  std::vector<program> all;
  for (int r = 0; r < mesh.size(); ++r) all.push_back(lower(d, mesh, r, o));
  for (const char* f : {"vm-1.txt", "vm-2.txt", "vm-4.txt", "datasheet-v100-8x-25gbe.txt", "datasheet-h200-8x-ib400.txt"}) {
    INFO(f);
    const auto dev = device_profile::load(std::string(WHALE_PROFILES_DIR) + "/" + f);
    if (dev.links[0][0].ranks == 0) continue;  // a one-rank profile has no links
    const auto sim = simulate(d, all, dev);
    CHECK(sim.step_s > 0);
    CHECK(sim.ranks.size() == 64u);
    // by symmetry: the first data replica's 4 programs give the same step and the same ranks' times
    const auto first = simulate(d, std::vector<program>(all.begin(), all.begin() + 4), dev);
    CHECK(first.step_s == doctest::Approx(sim.step_s));
    REQUIRE(first.ranks.size() == 4u);
    for (int r = 0; r < 4; ++r) {
      CHECK(first.ranks[r].comm_s == doctest::Approx(sim.ranks[r].comm_s));
      CHECK(first.ranks[r].wait_s == doctest::Approx(sim.ranks[r].wait_s));
    }
    // a data-parallel stage 3 alone cannot stand for the mesh: its pipeline peers are missing
    CHECK_THROWS_AS(simulate(d, std::vector<program>(all.begin() + 3, all.begin() + 4), dev), std::invalid_argument);
    // and with the stages across nodes (profiles of a cluster: with figures between nodes)
    const auto placed = pipe_outer_devices(mesh);
    if (dev.links[1][static_cast<int>(link_kind::p2p)].ranks) CHECK(simulate(d, std::vector<program>(all.begin(), all.begin() + 4), dev, 8, placed).step_s ==
          doctest::Approx(simulate(d, all, dev, 8, placed).step_s));
  }
  CHECK_THROWS_WITH_AS(simulate(d, std::vector<program>(all.begin(), all.begin() + 5), flat_profile()),
                       doctest::Contains("5 programs for a mesh of 64 ranks"), std::invalid_argument);
}

TEST_CASE("placement: stages across nodes, and a group with k ranks on each node gets k times the net figure") {
  // mesh data=2, pipe=2, model=2: Megatron's order puts model innermost, then data, then pipe
  const auto dev = pipe_outer_devices(mesh_shape(2, 2, 2));
  CHECK(dev == std::vector<int>{0, 1, 4, 5, 2, 3, 6, 7});
  // tensor x pipeline x data: one rank per stage (data 0, model 0) stands for all 8, placed or not
  {
    using blk = transformer_block<32, 2, 64>;
    using small_tp = sequential<split<embedding<64, 32>>, position_embedding<16, 32>, repeat<4, split<blk>>, layer_norm<32>,
                                split<sequential<linear<32, 64>, softmax_cross_entropy>>>;
    using P = replicate<pipeline<one_f_one_b, small_tp>>;
    const auto dp = describe<P>();
    const auto m3 = mesh_shape(2, 2, 2);
    auto o = batch(8, 16);
    o.micro_batches = 2;
    std::vector<program> every, stages;
    for (int r = 0; r < 8; ++r) {
      every.push_back(lower(dp, m3, r, o));
      if (m3.coord(r, axis::data) == 0 && m3.coord(r, axis::model) == 0) stages.push_back(every.back());
    }
    REQUIRE(stages.size() == 2u);
    const auto h200 = device_profile::load(std::string(WHALE_PROFILES_DIR) + "/datasheet-h200-8x-ib400.txt");
    for (int per_node : {8, 2}) {
      CHECK(simulate(dp, stages, h200, per_node).step_s == doctest::Approx(simulate(dp, every, h200, per_node).step_s));
      CHECK(simulate(dp, stages, h200, per_node, dev).step_s == doctest::Approx(simulate(dp, every, h200, per_node, dev).step_s));
    }
    // 3 ranks per node cut the replicas unlike the first: no replay by symmetry there
    CHECK(replicas_alike(m3, axes(axis::data) | axes(axis::model), 2));
    CHECK(!replicas_alike(m3, axes(axis::data) | axes(axis::model), 3));
    CHECK_THROWS_WITH_AS(simulate(dp, stages, h200, 3), doctest::Contains("replay by symmetry needs every replica placed"),
                         std::invalid_argument);
    CHECK(simulate(dp, every, h200, 3).step_s > 0);
  }
  std::istringstream in("gemm 64 64 64 0 0 100\nbandwidth 10\nlink node all_reduce 8 10 100\nlink net all_reduce 16 50 1\n");
  const auto p = device_profile::parse(in, "nic");
  CHECK(p.link_time(link_level::net, link_kind::all_reduce, 16, 8e9) == doctest::Approx(50e-6 * 15 / 15 + 8.0));
  CHECK(p.link_time(link_level::net, link_kind::all_reduce, 16, 8e9, 8) == doctest::Approx(50e-6 + 1.0));
  CHECK(p.link_time(link_level::net, link_kind::all_reduce, 16, 8e9, 1000) == doctest::Approx(50e-6 + 0.08));  // at most the node figure
  // data parallel over 2 nodes of 4: the group has 4 ranks on each node, so its all-reduce runs at 4 x 1 GB/s
  using M = sequential<linear<64, 64>, relu, linear<64, 8>, softmax_cross_entropy>;
  const auto d = describe<replicate<M>>();
  std::vector<program> ps;
  for (int r = 0; r < 8; ++r) ps.push_back(lower(d, mesh_shape(8, 1, 1), r, batch(64)));
  std::istringstream in2("gemm 64 64 64 0 0 100\nbandwidth 10\nlink node all_reduce 8 10 100\nlink net all_reduce 8 50 1\n");
  const auto two_nodes = simulate(d, ps, device_profile::parse(in2, "nic2"), 4);
  double comm = 0;
  for (const auto& op : ps[0].ops)
    if (op.kind == op_kind::collective && op.group_size > 1) comm += 50e-6 + static_cast<double>(op.bytes_sent) / 4e9;
  CHECK(two_nodes.ranks[0].comm_s == doctest::Approx(comm));
  // inter-node bytes, by hand: each ring step's sender whose next rank is on another node
  double sent = 0;  // one rank's bytes over every collective of the step
  for (const auto& op : ps[0].ops)
    if (op.kind == op_kind::collective && op.group_size > 1) sent += static_cast<double>(op.bytes_sent);
  REQUIRE(sent > 0);
  std::istringstream in3(in2.str());
  const auto nic = device_profile::parse(in3, "nic3");
  CHECK(simulate(d, ps, nic, 8).inter_node_bytes == 0);  // one node
  CHECK(two_nodes.inter_node_bytes == doctest::Approx(2 * sent));  // ranks 3 -> 4 and 7 -> 0 cross
  std::vector<int> round_robin;  // rank r on node r % 2: every ring step crosses
  for (int r = 0; r < 8; ++r) round_robin.push_back((r % 2) * 4 + r / 2);
  const auto dealt = simulate(d, ps, nic, 4, round_robin);
  CHECK(dealt.inter_node_bytes == doctest::Approx(8 * sent));
  // and each node's link carries 4 members' bytes (the ring leaves it 4 times), not 1
  double comm_dealt = 0;
  for (const auto& op : ps[0].ops)
    if (op.kind == op_kind::collective && op.group_size > 1) comm_dealt += 50e-6 + static_cast<double>(op.bytes_sent) / 1e9;
  CHECK(dealt.ranks[0].comm_s == doctest::Approx(comm_dealt));
  CHECK(p.link_time(link_level::net, link_kind::all_reduce, 16, 8e9, 8, 0, 2) == doctest::Approx(50e-6 + 2.0));
  // a pipeline's messages cross where its stages sit on two nodes; one rank per stage
  // stands for the 4 replicas of data=4 x pipe=2 (2 ranks a node: each replica's stages on one)
  {
    auto m = batch(16);
    m.micro_batches = 4;
    std::istringstream in4("gemm 64 64 64 0 0 100\nbandwidth 10\nlink node all_reduce 8 10 100\nlink net all_reduce 8 50 1\n"
                           "link node p2p 2 10 100\nlink net p2p 2 50 1\n");
    const auto links = device_profile::parse(in4, "nic4");
    const auto d2 = describe<replicate<two_stages>>();
    const auto mesh = mesh_shape(4, 2, 1);
    std::vector<program> all, first;
    for (int r = 0; r < 8; ++r) {
      all.push_back(lower(d2, mesh, r, m));
      if (mesh.coord(r, axis::data) == 0) first.push_back(all.back());
    }
    // one replica's activations and gradients; each stage's gradient all-reduce over
    // data (one member's bytes); the step's loss, summed over all 8 ranks
    double messages = 0, grads = 0, loss = 0;
    for (const auto& q : first)
      for (const auto& op : q.ops) {
        if (op.kind == op_kind::send) messages += static_cast<double>(op.bytes_sent);
        if (op.kind == op_kind::collective && op.group_size == 4) grads += static_cast<double>(op.bytes_sent);
        if (op.kind == op_kind::collective && op.group_size == 8 && q.rank == 0) loss += static_cast<double>(op.bytes_sent);
      }
    REQUIRE(messages > 0);
    REQUIRE(loss > 0);
    // pipe-inner (whale's order): a replica's two stages on one node, the messages stay
    // there; each stage's data ring has its 4 members on 4 nodes, so every step crosses,
    // and the loss's ring of ranks 0-7 crosses at 4 of its 8 steps
    const auto inner = simulate(d2, all, links, 2);
    CHECK(inner.inter_node_bytes == doctest::Approx(4 * grads + 4 * loss));
    CHECK(simulate(d2, first, links, 2).inter_node_bytes == doctest::Approx(inner.inter_node_bytes));
    // pipe-outer (stages across nodes): every message crosses, the data rings stay on
    // their node, the loss's ring alternates nodes
    const auto outer = pipe_outer_devices(mesh);
    CHECK(simulate(d2, all, links, 4, outer).inter_node_bytes == doctest::Approx(4 * messages + 8 * loss));
    CHECK(simulate(d2, first, links, 4, outer).inter_node_bytes == doctest::Approx(4 * messages + 8 * loss));
  }
}

TEST_CASE("the program cuts a pipelined repeat once, and refuses cuts that leave a stage without a layer, in words") {
  // the repeat first: nothing comes before it, so the first stage needs a block as each inner stage does
  using first = pipeline<one_f_one_b, sequential<repeat<3, sequential<linear<8, 8>, relu>>, linear<8, 4>, softmax_cross_entropy>>;
  auto o = batch(8);
  o.micro_batches = 2;
  const auto p = lower<first>(mesh_shape(1, 2, 1), 0, o);
  REQUIRE(p.stage_blocks.size() == 2);
  CHECK(p.stage_blocks[0] + p.stage_blocks[1] == 3);
  CHECK(p.stage_blocks[0] >= 1);
  CHECK(lower<first>(mesh_shape(1, 4, 1), 0, o).stage_blocks == std::vector<int>{1, 1, 1, 0});
  CHECK_THROWS_WITH_AS(lower<first>(mesh_shape(1, 5, 1), 0, o), doctest::Contains("use at most 4 stages"), std::invalid_argument);
  o.stage_blocks = {0, 3};
  CHECK_THROWS_WITH_AS(lower<first>(mesh_shape(1, 2, 1), 1, o), doctest::Contains("stage 0 of 2 holds no layer"), std::invalid_argument);
  o.stage_blocks = {2, 2};
  CHECK_THROWS_WITH_AS(lower<first>(mesh_shape(1, 2, 1), 1, o), doctest::Contains("stage blocks {2,2} do not fit"), std::invalid_argument);
  o.stage_blocks = {2, 1};
  CHECK(lower<first>(mesh_shape(1, 2, 1), 1, o).stage_blocks == std::vector<int>{2, 1});
}

TEST_CASE("the program's gradient buckets cover what is summed over data, from the buffer's end") {
  auto o = batch(8);
  o.bucket_mib = 128.0 / 1048576.0;  // 32 floats a bucket
  const auto p = lower<replicate<mlp>>(mesh_shape(2, 1, 1), 0, o);
  const index_t n = p.totals().params_held;
  REQUIRE(!p.grad_buckets.empty());
  CHECK(p.grad_buckets.front().second == n);  // the last layer's gradients are final first
  index_t covered = 0;
  for (const auto& [b, e] : p.grad_buckets) {
    CHECK(e - b <= 32);
    covered += e - b;
  }
  CHECK(covered == n);
  CHECK(detail::merged_ranges(p.grad_buckets) == std::vector<std::pair<index_t, index_t>>{{0, n}});
  CHECK(lower<shard<mlp, 2>>(mesh_shape(2, 1, 1), 0, batch(8)).grad_buckets.empty());  // ZeRO 2-3 reduce-scatter instead
  CHECK(lower<mlp>(mesh_shape(1, 1, 1), 0, batch(8)).grad_buckets.empty());
}

TEST_CASE("each gradient bucket's all-reduce waits for the backward that finishes it, or for the whole backward without overlap") {
  auto o = batch(8);
  o.bucket_mib = 128.0 / 1048576.0;  // 32 floats a bucket
  o.micro_batches = 2;
  const auto p = lower<replicate<mlp>>(mesh_shape(2, 1, 1), 0, o);
  const auto at = p.bucket_launches();
  REQUIRE(at.size() == p.grad_buckets.size());
  REQUIRE(at.size() > 2);
  for (std::size_t i = 0, k = 0; i < p.ops.size(); ++i) {
    const auto& b = p.ops[i];
    if (b.bucket < 0) continue;
    INFO("bucket " << k << " [" << p.grad_buckets[k].first << ", " << p.grad_buckets[k].second << ") at op " << i);
    CHECK(b.bucket == static_cast<int>(k));
    // the unit whose backward finishes it: the last (in flat order) that starts at or before it
    index_t finisher = -1;
    for (const auto& h : p.holds)
      if (h.local_params > 0 && h.local_offset <= p.grad_buckets[k].first) finisher = std::max(finisher, h.local_offset);
    CHECK(at[k] == finisher);
    REQUIRE(b.deps.size() == 1);
    const auto& d = p.ops[static_cast<std::size_t>(b.deps[0])];
    CHECK(d.kind == op_kind::backward);
    CHECK(d.micro == 1);  // the step's last micro-batch
    CHECK(b.deps[0] < static_cast<int>(i));
    ++k;
  }
  CHECK(at.front() > at.back());  // the first bucket goes during the backward, the last at its end
  o.overlap_buckets = false;      // plan_options::overlap off: every bucket after the step's backward
  const auto late = lower<replicate<mlp>>(mesh_shape(2, 1, 1), 0, o);
  CHECK(late.grad_buckets == p.grad_buckets);
  for (const auto l : late.bucket_launches()) CHECK(l == program::after_backward);
  int late_backward = -1;
  for (std::size_t i = 0; i < late.ops.size(); ++i)
    if (late.ops[i].kind == op_kind::backward) late_backward = static_cast<int>(i);
  for (std::size_t i = 0; i < late.ops.size(); ++i)
    if (late.ops[i].bucket >= 0) CHECK(static_cast<int>(i) > late_backward);
  CHECK(lowering_of(plan_options{}, 8).overlap_buckets);
  plan_options off;
  off.overlap = false;
  CHECK_FALSE(lowering_of(off, 8).overlap_buckets);
}
