// Checkpoints: exact resume on every plan (k steps, save, a fresh model loads,
// N-k more steps: bit-identical to N straight steps, on every rank, with AdamW
// + clipping and with SGD + momentum); resharding across plans (dp <-> tp,
// pipeline <-> ZeRO-3, one process <-> the world): the loaded parameters are
// bit-identical to the saved ones and the next steps equal single-process
// training from the same checkpoint; the trainer's save_every / keep_last /
// resume; and corrupt, truncated, missing and foreign checkpoints refused on
// every rank with the file or tensor named. Adapts to the world size (1, 2, 4).
#include <doctest/doctest.h>
#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "whale/comm/context.hpp"
#include "whale/models/gpt.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/runtime/make.hpp"
#include "whale/train/init.hpp"
#include "whale/train/safetensors.hpp"
#include "whale/train/trainer.hpp"
#include "support/plan_check.hpp"

using namespace whale;
namespace fs = std::filesystem;

namespace {
using small_gpt = models::gpt_model<64, 16, 32, 4, 64, 4>;
using other_gpt = models::gpt_model<64, 16, 48, 4, 64, 4>;  // another width: another model
using block = transformer_block<32, 4, 64>;
using tp_gpt = sequential<split<embedding<64, 32>>, position_embedding<16, 32>, repeat<4, split<block>>, layer_norm<32>,
                          split<linear<32, 64>>, softmax_cross_entropy>;
using dp = replicate<small_gpt>;
using tp = tp_gpt;
using pp = pipeline<one_f_one_b, small_gpt>;
using zero3 = shard<small_gpt, 3>;
using zero1_tp = shard<tp_gpt, 1>;
using hybrid = replicate<pipeline<one_f_one_b, tp_gpt>>;
markov_data batches() { return markov_data(seed{7}, 64, 16, 8); }

// after a reshard the step order of float sums changes (as tests/mpi_compose.cpp)
constexpr double tol_abs = 1e-5, tol_rel = 1e-4;

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
std::string shared_dir(world_comm& w, const std::string& tag) { return test::shared_dir(w, "ckpt-" + tag); }
using test::remove_dir;
adamw clipped() { return adamw{.lr = 1e-2f, .eps = 1e-5f, .weight_decay = 0.1f}; }
trainer_options clip_opts() {
  auto o = test::quiet();
  o.max_grad_norm = 0.5;
  return o;
}
/// Every element equal on every rank (collective).
index_t bit_diffs(world_comm& w, cview<float> a, cview<float> b) {
  index_t bad = a.numel() == b.numel() ? 0 : 1;
  for (index_t i = 0; bad == 0 && i < a.numel(); ++i) bad += a[i] != b[i];
  all_reduce(w, view<index_t>(&bad, {1}));
  return bad;
}
std::string spec_for(const std::string& plan, int n) {
  const auto s = std::to_string(n);
  if (plan == "tp" || plan == "zero1_tp") return "model=" + s;
  if (plan == "pp") return "data=1,pipe=" + s;
  if (plan == "hybrid") return n >= 4 ? "data=" + std::to_string(n / 4) + ",pipe=2,model=2" : "data=1,pipe=" + s;
  return "data=" + s;
}

/// P trains 6 steps straight, and 3 + save + (a fresh P from another seed) load + 3: bit-identical.
template <class P, class Opt> void exact_resume(const std::string& plan, const Opt& opt, trainer_options o) {
  auto ctx = test::on_mesh(spec_for(plan, world_size()));
  const auto dir = shared_dir(ctx.world(), plan.c_str());
  try {
    tensor<float> straight;
    {
      auto net = make<P>(ctx, seed{42});
      auto data = batches();
      trainer t(net, opt, o);
      t.run(data, steps{6});
      straight = net.full_params();
    }
    {
      auto net = make<P>(ctx, seed{42});
      auto data = batches();
      trainer t(net, opt, o);
      t.run(data, steps{3});
      t.save(dir);
    }
    auto net = make<P>(ctx, seed{9});  // other initial values: all must come from the checkpoint
    auto data = batches();
    trainer t(net, opt, o);
    const auto info = t.load(dir);
    CHECK(info.step == 3);
    CHECK(t.next_step() == 3);
    t.run(data, steps{3});
    const auto resumed = net.full_params();
    CHECK(bit_diffs(ctx.world(), straight.v(), resumed.v()) == 0);
    if (ctx.rank() == 0) MESSAGE(plan << " (" << std::string(Opt::name()) << "): resumed at step 3 of 6, bit-identical");
  } catch (const std::exception& e) {
    FAIL_CHECK(plan << ": " << std::string(e.what()));
  }
  remove_dir(ctx.world(), dir);
}

/// From saves 3 AdamW steps; To loads: the same parameters bit for bit, then 3
/// more steps equal single-process training loaded from the same checkpoint.
template <class From, class To>
void reshard(const std::string& from, const std::string& to) {
  const int n = world_size();
  const auto dir = [&] {
    auto c = test::on_mesh("data=" + std::to_string(n));
    return shared_dir(c.world(), (from + "-" + to).c_str());
  }();
  try {
    tensor<float> saved;
    {
      auto ctx = test::on_mesh(spec_for(from, n));
      auto net = make<From>(ctx, seed{42});
      auto data = batches();
      trainer t(net, clipped(), clip_opts());
      t.run(data, steps{3});
      t.save(dir);
      saved = net.full_params();
    }
    auto ctx = test::on_mesh(spec_for(to, n));
    auto net = make<To>(ctx, seed{9});
    trainer t(net, clipped(), clip_opts());
    t.load(dir);
    CHECK(bit_diffs(ctx.world(), net.full_params().v(), saved.v()) == 0);
    auto data = batches();
    t.run(data, steps{3});
    network<small_gpt> single(seed{5});
    trainer ts(single, clipped(), clip_opts());
    ts.load(dir);
    auto d2 = batches();
    ts.run(d2, steps{3});
    const auto d = test::over_ranks(ctx.world(), test::compare(net.full_params().v(), single.params(), tol_abs, tol_rel));
    if (ctx.rank() == 0) MESSAGE(from << " -> " << to << " at " << n << " ranks: 3 steps after loading, max |plan - single| = " << d.max_abs);
    CHECK(d.bad == 0);
    remove_dir(ctx.world(), dir);
  } catch (const std::exception& e) {
    FAIL_CHECK(from << " -> " << to << ": " << std::string(e.what()));
  }
}

/// `f` throws on every rank with a message holding `expect`.
using test::refused;
}  // namespace

TEST_CASE("exact resume on every plan: 3 steps, save, a fresh model loads, 3 steps = 6 straight, bit for bit") {
  const int n = world_size();
  exact_resume<dp>("dp", clipped(), clip_opts());
  exact_resume<dp>("dp", sgd{.lr = 0.05f, .momentum = 0.9f}, test::quiet());
  exact_resume<tp>("tp", clipped(), clip_opts());
  exact_resume<pp>("pp", clipped(), clip_opts());
  exact_resume<zero3>("zero3", clipped(), clip_opts());
  exact_resume<zero3>("zero3", sgd{.lr = 0.05f, .momentum = 0.9f}, test::quiet());
  exact_resume<zero1_tp>("zero1_tp", clipped(), clip_opts());
  if (n == 4 || n == 1) exact_resume<hybrid>("hybrid", clipped(), clip_opts());
  // single process
  const auto dir = (fs::temp_directory_path() / ("whale-ckpt-single-" + std::to_string(::getpid()))).string();
  network<small_gpt> a(seed{42});
  {
    trainer t(a, clipped(), clip_opts());
    auto d = batches();
    t.run(d, steps{6});
  }
  {
    network<small_gpt> b(seed{42});
    trainer t(b, clipped(), clip_opts());
    auto d = batches();
    t.run(d, steps{3});
    t.save(dir);
  }
  network<small_gpt> c(seed{1});
  trainer t(c, clipped(), clip_opts());
  t.load(dir);
  auto d = batches();
  t.run(d, steps{3});
  index_t bad = 0;
  for (index_t i = 0; i < a.param_count(); ++i) bad += a.params()[i] != c.params()[i];
  CHECK(bad == 0);
  fs::remove_all(dir);
}

TEST_CASE("resharding: a checkpoint saved under one plan loads under another") {
  reshard<dp, tp>("dp", "tp");
  reshard<tp, dp>("tp", "dp");
  reshard<pp, zero3>("pp", "zero3");
  reshard<zero3, pp>("zero3", "pp");
  reshard<zero1_tp, hybrid>("zero1_tp", "hybrid");
}

/// gpt2_init under plan P: the gathered unsplit parameters equal one process's, bit for bit, on every rank.
template <class P> void same_init(const std::string& plan) {
  auto ctx = test::on_mesh(spec_for(plan, world_size()));
  auto net = make<P>(ctx, seed{42});
  initialize(net, seed{11});
  network<small_gpt> single(seed{1});
  initialize(single, seed{11});
  const auto bad = bit_diffs(ctx.world(), net.full_params().v(), single.params());
  if (bad != 0 && ctx.rank() == 0) MESSAGE(plan << ": " << bad << " parameters differ");
  CHECK(bad == 0);
}

TEST_CASE("gpt2_init gives every plan the unsplit model's values, bit for bit, on every rank") {
  same_init<dp>("dp");
  same_init<tp>("tp");
  same_init<pp>("pp");
  same_init<zero3>("zero3");
  same_init<zero1_tp>("zero1_tp");
  same_init<hybrid>("hybrid");
}

TEST_CASE("one process <-> the world: network<M>'s checkpoint loads under a plan, and back") {
  auto ctx = test::on_mesh("data=" + std::to_string(world_size()));
  const auto dir = shared_dir(ctx.world(), "single");
  network<small_gpt> single(seed{42});
  trainer ts(single, clipped(), clip_opts());
  auto d = batches();
  ts.run(d, steps{2});
  if (ctx.rank() == 0) ts.save(dir + "/from-single");
  barrier(ctx.world());
  auto net = make<zero3>(ctx, seed{3});
  trainer t(net, clipped(), clip_opts());
  t.load(dir + "/from-single");
  CHECK(bit_diffs(ctx.world(), net.full_params().v(), single.params()) == 0);
  t.run(d, steps{2});
  t.save(dir + "/from-plan");
  network<small_gpt> back(seed{1});
  trainer tb(back, clipped(), clip_opts());
  tb.load(dir + "/from-plan");
  CHECK(tb.next_step() == 4);
  CHECK(bit_diffs(ctx.world(), net.full_params().v(), back.params()) == 0);
  remove_dir(ctx.world(), dir);
}

TEST_CASE("trainer: save_every and keep_last, then resume continues bit-identically") {
  auto ctx = test::on_mesh("data=" + std::to_string(world_size()));
  const auto dir = shared_dir(ctx.world(), "trainer");
  tensor<float> straight;
  {
    auto net = make<dp>(ctx, seed{42});
    trainer t(net, clipped(), clip_opts());
    auto data = batches();
    t.run(data, steps{8});
    straight = net.full_params();
  }
  auto o = clip_opts();
  o.checkpoint_dir = dir, o.save_every = 2, o.keep_last = 2, o.resume = true;
  {
    auto net = make<dp>(ctx, seed{42});
    trainer t(net, clipped(), o);
    auto data = batches();
    t.run(data, steps{6});
  }
  barrier(ctx.world());
  CHECK(!fs::exists(dir + "/step-00000002"));
  CHECK(fs::exists(dir + "/step-00000004/meta.txt"));
  CHECK(fs::exists(dir + "/step-00000006/meta.txt"));
  auto net = make<dp>(ctx, seed{1});
  trainer t(net, clipped(), o);
  auto data = batches();
  t.run(data, steps{2});  // resumes at 6
  CHECK(t.next_step() == 8);
  CHECK(bit_diffs(ctx.world(), straight.v(), net.full_params().v()) == 0);
  CHECK_THROWS_WITH_AS(trainer(net, clipped(), [] { auto b = test::quiet(); b.save_every = 2; return b; }()),
                       doctest::Contains("need trainer_options::checkpoint_dir"), std::invalid_argument);
  remove_dir(ctx.world(), dir);
}

TEST_CASE("corrupt, truncated, missing and foreign checkpoints are refused on every rank, naming the file or tensor") {
  auto ctx = test::on_mesh("data=" + std::to_string(world_size()));
  auto& w = ctx.world();
  const auto dir = shared_dir(w, "corrupt");
  auto net = make<dp>(ctx, seed{42});
  trainer t(net, clipped(), clip_opts());
  auto data = batches();
  t.run(data, steps{1});
  const auto step_dir = t.save(dir);
  const auto file = step_dir + "/rank-00000.bin";
  const auto pristine = dir + "/pristine";
  if (w.rank() == 0) fs::copy(file, pristine);
  barrier(w);
  auto fresh = [&] { return trainer(net, clipped(), clip_opts()); };
  auto on0 = [&](auto&& f) {
    if (w.rank() == 0) f();
    barrier(w);
  };
  // a flipped byte in the data
  on0([&] {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-100, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(-100, std::ios::end);
    f.write(&c, 1);
  });
  refused(w, "flipped byte", "rank-00000.bin' fails its checksum", [&] { fresh().load(dir); });
  // truncated
  on0([&] { fs::copy(pristine, file, fs::copy_options::overwrite_existing), fs::resize_file(file, fs::file_size(file) - 8); });
  refused(w, "truncated", "rank-00000.bin' has", [&] { fresh().load(dir); });
  // missing
  on0([&] { fs::remove(file); });
  refused(w, "missing", "rank-00000.bin' cannot be opened", [&] { fresh().load(dir); });
  on0([&] { fs::copy(pristine, file); });
  CHECK_NOTHROW(fresh().load(dir));
  // another model, another optimizer, not a checkpoint
  {
    auto other = make<replicate<other_gpt>>(ctx, seed{1});
    trainer to(other, clipped(), clip_opts());
    refused(w, "other model", "holds another model", [&] { to.load(dir); });
  }
  {
    trainer ts(net, sgd{.lr = 0.1f, .momentum = 0.9f}, test::quiet());
    refused(w, "other optimizer", "holds the state of optimizer adamw", [&] { ts.load(dir); });
  }
  refused(w, "no checkpoint", "is neither a checkpoint step directory", [&] { fresh().load(dir + "/nothing-here"); });
  on0([&] {
    std::ofstream(step_dir + "/meta.txt") << "whale-checkpoint 1\nmodel x\nbogus 1\n";
  });
  refused(w, "bad metadata", "meta.txt', line 3: unknown entry 'bogus'", [&] { fresh().load(step_dir); });
  remove_dir(w, dir);
}

TEST_CASE("safetensors: the unsplit model exported under one plan imports under another and into one process") {
  const int n = world_size();
  auto ctx = test::on_mesh(spec_for("tp", n));
  auto& w = ctx.world();
  const auto dir = shared_dir(w, "safetensors");
  const auto file = dir + "/model.safetensors";
  auto net = make<tp>(ctx, seed{42});
  trainer t(net, clipped(), clip_opts());
  auto data = batches();
  t.run(data, steps{2});
  export_safetensors(file, net, t.next_step());
  const auto full = net.full_params();
  {
    auto c2 = test::on_mesh(spec_for("pp", n));
    auto p = make<pp>(c2, seed{3});
    import_safetensors(file, p);
    CHECK(bit_diffs(w, p.full_params().v(), full.v()) == 0);
  }
  network<small_gpt> single(seed{1});
  import_safetensors(file, single);
  CHECK(bit_diffs(w, single.params(), full.v()) == 0);
  // the header is what a reader expects: 8-byte length, JSON naming F32 tensors
  if (w.rank() == 0) {
    std::ifstream in(file, std::ios::binary);
    std::uint64_t len = 0;
    in.read(reinterpret_cast<char*>(&len), 8);
    std::string h(len, ' ');
    in.read(h.data(), static_cast<std::streamsize>(len));
    CHECK(h.find("\"000.embedding<64, 32>\":{\"dtype\":\"F32\",\"shape\":[2048],\"data_offsets\":[0,8192]}") != std::string::npos);
    CHECK(8 + len + 4 * static_cast<std::uint64_t>(full.numel()) == fs::file_size(file));
    fs::resize_file(file, fs::file_size(file) - 4);
  }
  barrier(w);
  refused(w, "truncated safetensors", "lies past the end of the file (truncated)", [&] { import_safetensors(file, net); });
  refused(w, "missing safetensors", "cannot be opened", [&] { import_safetensors(dir + "/none.safetensors", net); });
  {
    auto c3 = test::on_mesh("data=" + std::to_string(n));
    auto other = make<replicate<other_gpt>>(c3, seed{1});
    refused(w, "other model", "tensor 000.embedding<64, 48> is missing (another model?)", [&] { import_safetensors(file, other); });
  }
  refused(w, "unwritable export", "cannot create a file in", [&] { export_safetensors("/nonexistent-whale-dir/m.safetensors", net); });
  remove_dir(w, dir);
}

// Across jobs of different sizes (tests/CMakeLists.txt runs "save" at 4 ranks, then
// "load" at 2, with WHALE_CKPT_CROSS_DIR set): ZeRO-3 + data x 4 saves, then tensor
// parallelism over 2 ranks loads, equals the consolidated export bit for bit, and
// trains 3 more steps as one process loaded from the same checkpoint does.
TEST_CASE("across jobs: save (run at 4 ranks by the cross-job test)") {
  const char* dir = std::getenv("WHALE_CKPT_CROSS_DIR");
  if (!dir) return;  // only in the cross-job test
  auto ctx = test::on_mesh("data=" + std::to_string(world_size()));
  auto net = make<zero3>(ctx, seed{42});
  trainer t(net, clipped(), clip_opts());
  auto data = batches();
  t.run(data, steps{3});
  t.save(std::string(dir) + "/ck");
  export_safetensors(std::string(dir) + "/ck.safetensors", net, t.next_step());
  if (ctx.rank() == 0) MESSAGE("saved at " << world_size() << " ranks under " << net.placement().plan);
}
TEST_CASE("across jobs: load (run at 2 ranks by the cross-job test)") {
  const char* dir = std::getenv("WHALE_CKPT_CROSS_DIR");
  if (!dir) return;
  auto ctx = test::on_mesh("model=" + std::to_string(world_size()));
  auto net = make<tp>(ctx, seed{9});
  trainer t(net, clipped(), clip_opts());
  const auto info = t.load(std::string(dir) + "/ck");
  CHECK(info.step == 3);
  if (ctx.rank() == 0) MESSAGE("loaded at " << world_size() << " ranks what " << info.ranks << " ranks saved under " << info.plan);
  network<small_gpt> consolidated(seed{1});
  import_safetensors(std::string(dir) + "/ck.safetensors", consolidated);
  CHECK(bit_diffs(ctx.world(), net.full_params().v(), consolidated.params()) == 0);
  auto data = batches();
  t.run(data, steps{3});
  network<small_gpt> single(seed{1});
  trainer ts(single, clipped(), clip_opts());
  ts.load(std::string(dir) + "/ck");
  auto d2 = batches();
  ts.run(d2, steps{3});
  const auto d = test::over_ranks(ctx.world(), test::compare(net.full_params().v(), single.params(), tol_abs, tol_rel));
  if (ctx.rank() == 0) MESSAGE("3 steps after loading: max |tp - single| = " << d.max_abs);
  CHECK(d.bad == 0);
}
