// split<...> (operator sharding with layouts in the type) and its hybrids
// with replicate, against single-process training on the same global batches:
// the unsplit parameters gathered from the shards after 5 steps agree with
// the single-process ones to a stated tolerance on every rank, at 1, 2 and 4
// ranks; also with AdamW, weight decay and active gradient clipping (the
// global gradient norm of split plans).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <string>

#include <mpi.h>

#include "whale/comm/context.hpp"
#include "whale/models/gpt.hpp"
#include "whale/models/xc.hpp"
#include "whale/nn/gelu.hpp"
#include "whale/nn/layer_norm.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/rms_norm.hpp"
#include "whale/nn/rotary_attention.hpp"
#include "whale/nn/swiglu_mlp.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/runtime/make.hpp"
#include "whale/train/trainer.hpp"
#include "support/plan_check.hpp"

using namespace whale;

namespace {

using test::quiet;
using test::on_mesh;

// Tolerance: |p_split - p_single| <= atol + rtol * |p_single| elementwise, fp32.
// Sharding changes only the order of float sums (partial products summed by
// all-reduce, softmax statistics combined across ranks).
constexpr double atol = 5e-6, rtol = 1e-4;

/// The unsplit parameters this rank gathers from the shards against `single`'s.
template <class Split, class Single>
test::diff compare_full(executor<Split>& h, const network<Single>& single, double at, double rt) {
  auto full = h.full_params();  // collective over the model axis
  CHECK(full.numel() == single.param_count());
  if (full.numel() != single.param_count()) return {0.0, 1};
  return test::compare(full, single.params(), at, rt);
}

template <class Split, class Single, class MakeData>
void check_split(const std::string& mesh, MakeData make_data, int n_steps = 5) {
  auto ctx = on_mesh(mesh);
  const auto opt = sgd{.lr = 0.05f, .momentum = 0.9f};
  auto h = make<Split>(ctx, seed{42});
  {
    auto data = make_data();
    trainer t(h, opt, quiet());
    t.run(data, steps{n_steps});
  }
  // every rank trains the single-process model and checks its own gathered copy
  network<Single> single(seed{42});
  {
    auto data = make_data();
    trainer t(single, opt, quiet());
    t.run(data, steps{n_steps});
  }
  const auto d = test::over_ranks(ctx.world(), compare_full(h, single, atol, rtol));
  if (ctx.rank() == 0) MESSAGE(mesh << ": max |split - single| over all ranks = " << d.max_abs);
  CHECK(d.bad == 0);
}

// Clipped AdamW (test::clip_adamw) for 4 steps. Tolerance: |p_split - p_single|
// <= 1e-5 + 1e-4 |p_single|, looser than SGD's: Adam divides by sqrt(v), which
// magnifies rounding differences in small gradients. The gradient norms the
// trainer clips with agree to a relative 1e-5 on every rank.
constexpr double clip_atol = 1e-5, clip_rtol = 1e-4, norm_rtol = 1e-5;
constexpr int clip_steps = 4;

/// Train Split and Single clipped at `max_norm`, which the single-process
/// gradient norm at step 0 must exceed (so that clipping is active).
template <class Split, class Single, class MakeData>
void check_split_clipped(const std::string& mesh, MakeData make_data, double max_norm) {
  auto ctx = on_mesh(mesh);
  try {
  auto h = make<Split>(ctx, seed{42});
  const auto r = test::run_clipped<Single>(ctx.world(), h, make_data, max_norm, clip_steps,
                                           [&](network<Single>& single) { return compare_full(h, single, clip_atol, clip_rtol); });
  if (ctx.rank() == 0)
    MESSAGE(mesh << " clipped at " << max_norm << " (single-process norm at step 0: " << r.single_norm0
                 << "): max |split - single| = " << r.params.max_abs << ", max norm rel. diff = " << r.norm_rel);
  CHECK(r.single_norm0 > max_norm);
  CHECK(r.norms == static_cast<std::size_t>(clip_steps));
  CHECK(r.norm_rel <= norm_rtol);
  CHECK(r.params.bad == 0);
  } catch (const std::exception& e) { FAIL_CHECK(std::string(e.what())); }
}

std::string all_on(const char* axis, int n) { return std::string(axis) + "=" + std::to_string(n); }

// Megatron's MLP pair inside a small classifier.
using mlp_single = sequential<sequential<linear<16, 32>, gelu, linear<32, 16>>, linear<16, 8>, softmax_cross_entropy>;
using mlp_split = sequential<split<sequential<linear<16, 32>, gelu, linear<32, 16>>>, linear<16, 8>, softmax_cross_entropy>;
auto mlp_data() { return teacher_data(seed{5}, 16, 8, 12); }
// The same pair without biases (Llama's projections): no bias pass, no replicated row-parallel bias.
using nobias_inner = sequential<linear<16, 32, no_bias>, gelu, linear<32, 16, no_bias>>;
using nobias_single = sequential<nobias_inner, linear<16, 8, no_bias>, softmax_cross_entropy>;
using nobias_split = sequential<split<nobias_inner>, linear<16, 8, no_bias>, softmax_cross_entropy>;
using nobias_forced = sequential<split<sequential<row<linear<16, 32, no_bias>>, gelu, column<linear<32, 16, no_bias>>>>,
                                 linear<16, 8, no_bias>, softmax_cross_entropy>;

// Llama's layers in a decoder: rotary grouped-query attention split by key/value
// groups (8 query heads reading 4 KV heads), the SwiGLU MLP split by hidden
// features (gate and up column-split together, down row-split), a head without bias split by class.
using llama_block = sequential<residual<rms_norm<32>, rotary_attention<32, 8, 4>>, residual<rms_norm<32>, swiglu_mlp<32, 48>>>;
using llama_kv2 = sequential<embedding<64, 32>, residual<rms_norm<32>, rotary_attention<32, 4, 2>>, rms_norm<32>,
                             linear<32, 64, no_bias>, softmax_cross_entropy>;
using llama_like = sequential<embedding<64, 32>, repeat<2, llama_block>, rms_norm<32>, linear<32, 64, no_bias>, softmax_cross_entropy>;
auto llama_data() { return markov_data(seed{9}, 64, 16, 4); }

// Whale's 100k-class plan, shrunk: backbone replicated, classifier split by class over the same ranks.
using xc_small_backbone = sequential<linear<24, 48>, relu>;
using xc_small_classifier = sequential<linear<48, 1000>, softmax_cross_entropy>;
using xc_small_single = sequential<xc_small_backbone, xc_small_classifier>;
using xc_small_split = sequential<replicate<xc_small_backbone>, split<xc_small_classifier, axis::data>>;
auto xc_data() { return teacher_data(seed{6}, 24, 1000, 8); }

// A region that needs every kind of conversion: rows gathered, columns
// gathered (backward: sliced), and on the data axis an exit from split<1>
// back to rows split<0> through replicated.
using conv_single = sequential<sequential<linear<8, 16>, relu, layer_norm<16>, linear<16, 8>>, linear<8, 4>, softmax_cross_entropy>;
template <axis A>
using conv_split = sequential<split<sequential<linear<8, 16>, relu, layer_norm<16>, linear<16, 8>>, A>, linear<8, 4>, softmax_cross_entropy>;
auto conv_data() { return teacher_data(seed{8}, 8, 4, 8); }

// Split regions repeated inside a repeat<>: make<> must find them.
using rep_single = sequential<linear<8, 16>, repeat<2, sequential<linear<16, 32>, gelu, linear<32, 16>>>, linear<16, 4>,
                              softmax_cross_entropy>;
using rep_split = sequential<linear<8, 16>, repeat<2, split<sequential<linear<16, 32>, gelu, linear<32, 16>>>>,
                             linear<16, 4>, softmax_cross_entropy>;
static_assert(contains_split<rep_split>(), "contains_split must look inside repeat<>");

}  // namespace

TEST_CASE("split regions inside repeat<> (found by make<>) equal single-process training") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  check_split<rep_split, rep_single>(all_on("model", world), conv_data);
}

TEST_CASE("every layout conversion: all-gather rows and columns, slices, through replicated") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  check_split<conv_split<axis::data>, conv_single>(all_on("data", world), conv_data);
  check_split<conv_split<axis::model>, conv_single>(all_on("model", world), conv_data);
  std::ostringstream os;
  conv_split<axis::data>::print_structure(os, 0, 8);
  CHECK(os.str().find("all-gather(columns) over data: split<1> -> replicated; backward slice(columns)") != std::string::npos);
  CHECK(os.str().find("slice(rows) over data: replicated -> split<0>; backward all-gather(rows)") != std::string::npos);
}

TEST_CASE("column then row linear (Megatron pair) over the model axis equals single-process training") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  check_split<mlp_split, mlp_single>(all_on("model", world), mlp_data);
  if (world == 4) check_split<mlp_split, mlp_single>("data=2,model=2", mlp_data);
}

TEST_CASE("linears without bias: column then row (and forced row then column) equal single-process training") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  check_split<nobias_split, nobias_single>(all_on("model", world), mlp_data);
  check_split<nobias_forced, nobias_single>(all_on("model", world), mlp_data);
  check_split_clipped<nobias_split, nobias_single>(all_on("model", world), mlp_data, 0.05);
  if (world == 4) {
    check_split<nobias_split, nobias_single>("data=2,model=2", mlp_data);
    check_split_clipped<nobias_split, nobias_single>("data=2,model=2", mlp_data, 0.05);
  }
  std::ostringstream os;
  nobias_split::print_structure(os, 0, 8);
  CHECK(os.str().find("column_linear<16, 32, no_bias>/model") != std::string::npos);
  CHECK(os.str().find("row_linear<32, 16, no_bias>/model") != std::string::npos);
}

TEST_CASE("Llama's layers split (rotary attention by KV groups, SwiGLU by hidden features) equal single-process training") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  check_split<split<llama_like>, llama_like>(all_on("model", world), llama_data);
  check_split_clipped<split<llama_like>, llama_like>(all_on("model", world), llama_data, 0.5);
  if (world == 4) {
    check_split<split<llama_like>, llama_like>("data=2,model=2", llama_data);
    check_split_clipped<split<llama_like>, llama_like>("data=2,model=2", llama_data, 0.5);
  }
  std::ostringstream os;
  split<llama_like>::print_structure(os, 0, 8);
  CHECK(os.str().find("hidden_swiglu_mlp<32, 48>/model") != std::string::npos);
  CHECK(os.str().find("head_rotary_attention<32, 8, 4>/model") != std::string::npos);
  // 2 key/value heads: 1 or 2 ranks share them; 4 cannot, and every rank says why
  if (world <= 2) check_split<split<llama_kv2>, llama_kv2>(all_on("model", world), llama_data);
  else {
    auto ctx = on_mesh(all_on("model", world));
    CHECK_THROWS_WITH_AS(make<split<llama_kv2>>(ctx, seed{42}), doctest::Contains("the number of key/value heads (KVHeads) (2 % 4 != 0)"),
                         std::invalid_argument);
  }
}

TEST_CASE("xc plan: replicated backbone, class-split classifier over the data ranks") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  check_split<xc_small_split, xc_small_single>(all_on("data", world), xc_data);
}

TEST_CASE("gpt with tensor parallelism (vocab-split embedding and head, Megatron FFN), data parallel outside") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  using tiny = models::gpt_model<64, 16, 32, 4, 64, 2>;
  auto data = [] { return markov_data(seed{9}, 64, 16, 4); };
  check_split<split<tiny>, tiny>(all_on("model", world), data);
  if (world == 4) check_split<split<tiny>, tiny>("data=2,model=2", data);
  // labels of ignore_index (one in five) leave the split loss's mean and gradient to the others
  auto masked = [] {
    markov_data m(seed{9}, 64, 16, 8);
    const auto b = m.get(0, 0, 8);
    tensor<std::int32_t> x({8, 16}), y({8, 16});
    for (index_t i = 0; i < 8 * 16; ++i) {
      x[i] = b.inputs[i];
      y[i] = i % 5 == 2 ? ignore_index : b.labels[i];
    }
    return tensor_data<std::int32_t>(std::move(x), std::move(y), 4, {.seed = seed{2}});
  };
  check_split<split<tiny>, tiny>(all_on("model", world), masked);
}

TEST_CASE("split plans with AdamW, weight decay and active clipping equal single-process training on every rank") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  using tiny = models::gpt_model<64, 16, 32, 4, 64, 2>;
  auto gpt_data = [] { return markov_data(seed{9}, 64, 16, 4); };
  // model axis: sharded weights, replicated row-parallel biases and layer norms
  check_split_clipped<mlp_split, mlp_single>(all_on("model", world), mlp_data, 0.05);
  check_split_clipped<split<tiny>, tiny>(all_on("model", world), gpt_data, 0.5);
  // data axis: class-split classifier; a data-split region with a layer norm and a row-parallel bias
  check_split_clipped<xc_small_split, xc_small_single>(all_on("data", world), xc_data, 0.05);
  check_split_clipped<conv_split<axis::data>, conv_single>(all_on("data", world), conv_data, 0.05);
  if (world == 4) {
    check_split_clipped<mlp_split, mlp_single>("data=2,model=2", mlp_data, 0.05);
    check_split_clipped<split<tiny>, tiny>("data=2,model=2", gpt_data, 0.5);
    // a model axis that nothing is split over would only repeat work: refused on every rank
    auto ctx = on_mesh("data=2,model=2");
    CHECK_THROWS_WITH_AS(make<conv_split<axis::data>>(ctx, seed{42}),
                         doctest::Contains("has a model axis, but nothing is split over it"), std::invalid_argument);
  }
}

TEST_CASE("the 100k-class xc hybrid moves over 100x fewer bytes than data parallelism") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world == 1) return;  // nothing moves on one rank
  auto ctx = on_mesh(all_on("data", world));
  using xc_hybrid = sequential<replicate<models::xc_backbone>, split<models::xc_classifier, axis::data>>;
  auto h = make<xc_hybrid>(ctx, seed{1});
  auto data = models::xc_data(seed{7}, 2 * world);
  trainer t(h, sgd{.lr = 0.01f}, quiet());
  t.step(data, 0);  // warm-up
  auto& dc = ctx.mesh().comm(axis::data);
  dc.reset_stats();
  t.step(data, 1);
  const double hybrid_bytes = static_cast<double>(dc.stats().bytes_sent);
  // data parallelism all-reduces every gradient: 2 (p-1)/p of 4 bytes per parameter (ring)
  const double dp_bytes = 2.0 * (world - 1) / world * 4.0 * static_cast<double>(models::xc::cost().params);
  MESSAGE("bytes sent per step: hybrid " << hybrid_bytes << ", dp " << dp_bytes);
  CHECK(hybrid_bytes * 100 < dp_bytes);
  CHECK(h.param_count() < models::xc::cost().params / world + models::xc_backbone::cost().params + 1);
}

TEST_CASE("a split degree that does not divide the layer is a clear error on every rank") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world == 1) return;  // every degree divides
  auto ctx = on_mesh(all_on("model", world));
  using bad = sequential<split<sequential<linear<8, 33>, relu>>, linear<33, 4>, softmax_cross_entropy>;
  CHECK_THROWS_WITH_AS(make<bad>(ctx, seed{1}), doctest::Contains("split degree must divide out_features (33 %"),
                       std::invalid_argument);
}

TEST_CASE("a static split degree that the mesh does not have is a clear error") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  auto ctx = on_mesh(all_on("model", world));
  using three = sequential<split<sequential<linear<6, 6>, relu>, axis::model, 3>, linear<6, 2>, softmax_cross_entropy>;
  CHECK_THROWS_WITH_AS(make<three>(ctx, seed{1}), doctest::Contains("is split 3 ways, but the model axis has"),
                       std::invalid_argument);
}

TEST_CASE("a split plan allocates no tensor after its first step") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  auto ctx = on_mesh(all_on("model", world));
  auto h = make<split<models::gpt_model<64, 16, 32, 4, 64, 2>>>(ctx, seed{1});
  markov_data data(seed{2}, 64, 16, 4);
  trainer t(h, sgd{.lr = 0.01f, .momentum = 0.9f}, quiet());
  t.step(data, 0);
  const auto allocs = memory_snapshot().allocations;
  for (int s = 1; s < 4; ++s) t.step(data, s);
  CHECK(memory_snapshot().allocations == allocs);
}

TEST_CASE("layouts and collectives print layer by layer") {
  std::ostringstream os;
  mlp_split::print_structure(os, 0, 16);
  const auto s = os.str();
  CHECK(s.find("column_linear<16, 32>/model") != std::string::npos);
  CHECK(s.find("row_linear<32, 16>/model  (model: split<1> in)") != std::string::npos);
  CHECK(s.find("[all-reduce over model: partial -> replicated; backward none]") != std::string::npos);
  CHECK(s.find("[none over model: replicated -> replicated; backward all-reduce]") != std::string::npos);
  std::ostringstream xs;
  xc_small_split::print_structure(xs, 0, 24);
  CHECK(xs.str().find("[all-gather(rows) over data: split<0> -> replicated; backward reduce-scatter(rows)]") !=
        std::string::npos);
  CHECK(xs.str().find("split_softmax_cross_entropy/data  (data: split<1> in)") != std::string::npos);
}
