// Checkpoints: exact resume on every plan (k steps, save, a fresh model loads,
// N-k more steps: bit-identical to N straight steps, on every rank, with AdamW
// + clipping and with SGD + momentum); resharding across plans (dp <-> tp,
// pipeline <-> ZeRO-3, one process <-> the world): the loaded parameters are
// bit-identical to the saved ones and the next steps equal single-process
// training from the same checkpoint; the trainer's save_every / keep_last /
// resume; and corrupt, truncated, missing and foreign checkpoints refused on
// every rank with the file or tensor named; the safetensors export's tensors,
// their shapes and fused layouts ([Q|K|V], gate then up), its round trip
// across plans, the files of earlier versions, and its refusals. Adapts to the
// world size (1, 2, 4).
#include <doctest/doctest.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "whale/comm/context.hpp"
#include "whale/models/gpt.hpp"
#include "whale/nn/gradcheck.hpp"
#include "whale/nn/rms_norm.hpp"
#include "whale/nn/rotary_attention.hpp"
#include "whale/nn/swiglu_mlp.hpp"
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

namespace {
/// The header of safetensors file `path`: its length and its text.
std::string st_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::uint64_t len = 0;
  in.read(reinterpret_cast<char*>(&len), 8);
  std::string h(len, ' ');
  in.read(h.data(), static_cast<std::streamsize>(len));
  return h;
}
/// A copy of file `from` at `to` with `was` replaced by `now` (of the same length) in its header (on rank 0).
void edited(world_comm& w, const std::string& from, const std::string& to, const std::string& was, const std::string& now) {
  if (w.rank() == 0) {
    std::ifstream in(from, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto at = bytes.find(was);
    CHECK(at != std::string::npos);
    CHECK(was.size() == now.size());
    if (at != std::string::npos) bytes.replace(at, was.size(), now);
    std::ofstream(to, std::ios::binary) << bytes;
  }
  barrier(w);
}
/// A copy of safetensors file `from` at `to` with its tensors' data in reverse order (on rank 0), as
/// another writer may place them (Python's safetensors sorts them by name).
void reversed(world_comm& w, const std::string& from, const std::string& to) {
  if (w.rank() == 0) {
    const ckpt::st_reader r(from, "test");
    std::vector<std::pair<std::int64_t, std::string>> order;
    for (const auto& [name, e] : r.entries()) order.emplace_back(-e.offsets[0], name);
    std::sort(order.begin(), order.end());
    std::ostringstream hs;
    std::string data;
    hs << "{";
    for (const auto& [minus_at, name] : order) {
      const auto& e = r.entries().at(name);
      std::string bytes(static_cast<std::size_t>(e.offsets[1] - e.offsets[0]), '\0');
      r.read(name, 0, bytes.data(), bytes.size());
      hs << (data.empty() ? "" : ",") << ckpt::json_string(name) << ":{\"dtype\":\"F32\",\"shape\":[";
      for (std::size_t i = 0; i < e.shape.size(); ++i) hs << (i ? "," : "") << e.shape[i];
      hs << "],\"data_offsets\":[" << data.size() << "," << data.size() + bytes.size() << "]}";
      data += bytes;
    }
    hs << "}";
    const std::string h = hs.str();
    const std::uint64_t len = h.size();
    std::ofstream out(to, std::ios::binary);
    out.write(reinterpret_cast<const char*>(&len), 8);
    out << h << data;
  }
  barrier(w);
}
/// The file an earlier whale exported: one flat F32 tensor a layer, "<k>.<layer>", shape [n] (on rank 0).
template <class M> void write_flat_file(world_comm& w, const std::string& path, cview<float> full) {
  if (w.rank() == 0) {
    const auto units = ckpt::units_of<M>();
    std::ostringstream hs;
    hs << "{\"__metadata__\":{\"format\":\"whale\",\"model\":" << ckpt::json_string(layer_name<M>()) << ",\"step\":\"2\"}";
    for (std::size_t k = 0; k < units.size(); ++k)
      hs << "," << ckpt::json_string(ckpt::tensor_name(k, units[k].name)) << ":{\"dtype\":\"F32\",\"shape\":[" << units[k].count
         << "],\"data_offsets\":[" << 4 * units[k].offset << "," << 4 * (units[k].offset + units[k].count) << "]}";
    hs << "}";
    std::string h = hs.str();
    h.append((8 - h.size() % 8) % 8, ' ');
    const std::uint64_t len = h.size();
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(&len), 8);
    out << h;
    out.write(reinterpret_cast<const char*>(full.data()), static_cast<std::streamsize>(full.numel()) * 4);
  }
  barrier(w);
}
}  // namespace

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
  // the header is what a reader expects: 8-byte length, JSON naming F32 tensors with their shapes, in flat order
  if (w.rank() == 0) {
    const auto h = st_header(file);
    CHECK(h.find("\"000.embedding<64, 32>.table\":{\"dtype\":\"F32\",\"shape\":[64,32],\"data_offsets\":[0,8192]}") != std::string::npos);
    CHECK(h.find("\"005.linear<32, 64>.weight\":{\"dtype\":\"F32\",\"shape\":[64,32],") != std::string::npos);
    CHECK(8 + h.size() + 4 * static_cast<std::uint64_t>(full.numel()) == fs::file_size(file));
    const ckpt::st_reader r(file, "test");
    CHECK(r.entries().size() == 54);  // 2 tables, 4 blocks of 2 norms' 2, attention's 4 and 2 linears' 2; a norm's 2 and the head's 2
  }
  // a file of an earlier version (one flat tensor a layer) still imports, under a plan and into one process
  write_flat_file<small_gpt>(w, dir + "/flat.safetensors", full.v());
  {
    auto c2 = test::on_mesh(spec_for("pp", n));
    auto p = make<pp>(c2, seed{3});
    import_safetensors(dir + "/flat.safetensors", p);
    CHECK(bit_diffs(w, p.full_params().v(), full.v()) == 0);
    network<small_gpt> one(seed{1});
    import_safetensors(dir + "/flat.safetensors", one);
    CHECK(bit_diffs(w, one.params(), full.v()) == 0);
  }
  // refused, naming the tensor: another shape of the same size, a missing tensor, another dtype
  const auto bad = dir + "/bad.safetensors";
  edited(w, file, bad, "\"005.linear<32, 64>.weight\":{\"dtype\":\"F32\",\"shape\":[64,32]", "\"005.linear<32, 64>.weight\":{\"dtype\":\"F32\",\"shape\":[32,64]");
  refused(w, "another shape", "tensor 005.linear<32, 64>.weight has shape [32, 64]; this model's is [64, 32]", [&] { import_safetensors(bad, net); });
  edited(w, file, bad, "\"003.causal_self_attention<32, 4>.qkv.bias\"", "\"003.causal_self_attention<32, 4>.qkv.bixs\"");
  refused(w, "a missing tensor", "tensor 003.causal_self_attention<32, 4>.qkv.bias is missing", [&] { import_safetensors(bad, net); });
  edited(w, file, bad, "\"dtype\":\"F32\"", "\"dtype\":\"F16\"");
  refused(w, "another dtype", "tensor 000.embedding<64, 32>.table is F16; whale reads F32", [&] { import_safetensors(bad, net); });
  if (w.rank() == 0) fs::resize_file(file, fs::file_size(file) - 4);
  barrier(w);
  refused(w, "truncated safetensors", "lies past the end of the file (truncated)", [&] { import_safetensors(file, net); });
  refused(w, "missing safetensors", "cannot be opened", [&] { import_safetensors(dir + "/none.safetensors", net); });
  {
    auto c3 = test::on_mesh("data=" + std::to_string(n));
    auto other = make<replicate<other_gpt>>(c3, seed{1});
    refused(w, "other model", "tensor 000.embedding<64, 48>.table is missing (another model? the file has 000.embedding<64, 32>.table)",
            [&] { import_safetensors(file, other); });
  }
  refused(w, "unwritable export", "cannot create a file in", [&] { export_safetensors("/nonexistent-whale-dir/m.safetensors", net); });
  remove_dir(w, dir);
}

namespace {
// every layer kind with parameters, each tensor's shape distinct from the others'
using kinds = sequential<embedding<64, 32>, position_embedding<16, 32>, layer_norm<32>, causal_self_attention<32, 4>, rms_norm<32>,
                         rotary_attention<32, 4, 2>, swiglu_mlp<32, 48>, linear<32, 40, no_bias>, linear<40, 64>, softmax_cross_entropy>;
static_assert(param_shapes_stated<embedding<64, 32>>() && param_shapes_stated<position_embedding<16, 32>>() &&
              param_shapes_stated<layer_norm<32>>() && param_shapes_stated<rms_norm<32>>() &&
              param_shapes_stated<causal_self_attention<32, 4>>() && param_shapes_stated<rotary_attention<32, 4, 2>>() &&
              param_shapes_stated<swiglu_mlp<32, 48>>() && param_shapes_stated<linear<32, 40, no_bias>>() &&
              param_shapes_stated<linear<40, 64>>() && !param_shapes_stated<relu>());
/// A layer whose param_tensors() state no shapes: the export refuses it.
struct unshaped_norm : layer_norm<32> {
  static std::string name() { return "unshaped_norm"; }
  static constexpr std::array<param_tensor, 2> param_tensors() {
    return {{{"gain", param_role::gain, 32, 32}, {"bias", param_role::bias, 32, 32}}};
  }
};
/// y = x A^T for x (R, In) and A (Out, In) row-major.
std::vector<double> times_t(const std::vector<double>& x, const std::vector<float>& a, index_t R, index_t In, index_t Out) {
  std::vector<double> y(static_cast<std::size_t>(R * Out), 0.0);
  for (index_t r = 0; r < R; ++r)
    for (index_t o = 0; o < Out; ++o)
      for (index_t i = 0; i < In; ++i) y[r * Out + o] += x[r * In + i] * a[o * In + i];
  return y;
}
/// Layer L bound to the file's tensors of `unit` (in its flat order), run forward on rows x (B = 1 sequence of R tokens).
template <class L> std::vector<double> forward_from(const ckpt::st_reader& r, const std::string& unit, std::vector<double> x, index_t R) {
  bound_layer<L> m;
  index_t at = 0;
  for (const auto& t : L::param_tensors()) {
    const auto v = r.floats(unit + "." + t.name);
    std::copy(v.begin(), v.end(), m.params.data() + at);
    at += t.count;
  }
  tensor<float> xin({R, L::in_features});
  for (index_t i = 0; i < xin.numel(); ++i) xin.data()[i] = static_cast<float>(x[static_cast<std::size_t>(i)]);
  step_ctx c;
  c.batch = 1, c.seq = R;
  const auto y = m.layer.forward(c, cview<float>(xin.v()));
  return {y.data(), y.data() + y.numel()};
}
double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double d = a.size() == b.size() ? 0.0 : 1e9;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}
}  // namespace

TEST_CASE("safetensors: every layer kind's tensors with their shapes and fused layouts; round trips across plans; unshaped layers refused") {
  const int n = world_size();
  auto ctx = test::on_mesh("data=" + std::to_string(n));
  auto& w = ctx.world();
  const auto dir = shared_dir(w, "st-kinds");
  const auto file = dir + "/kinds.safetensors";
  network<kinds> one(seed{5});
  if (w.rank() == 0) export_safetensors(file, one, 7);  // one process: a network's export is not collective
  barrier(w);
  if (w.rank() == 0) {
    const ckpt::st_reader r(file, "test");
    // every tensor, in flat order: its name, its shape, and where its data lies
    const std::vector<std::pair<std::string, std::vector<std::int64_t>>> want = {
        {"000.embedding<64, 32>.table", {64, 32}},
        {"001.position_embedding<16, 32>.table", {16, 32}},
        {"002.layer_norm<32>.gain", {32}},
        {"002.layer_norm<32>.bias", {32}},
        {"003.causal_self_attention<32, 4>.qkv.weight", {96, 32}},
        {"003.causal_self_attention<32, 4>.qkv.bias", {96}},
        {"003.causal_self_attention<32, 4>.out.weight", {32, 32}},
        {"003.causal_self_attention<32, 4>.out.bias", {32}},
        {"004.rms_norm<32>.gain", {32}},
        {"005.rotary_attention<32, 4, 2>.q.weight", {32, 32}},
        {"005.rotary_attention<32, 4, 2>.k.weight", {16, 32}},
        {"005.rotary_attention<32, 4, 2>.v.weight", {16, 32}},
        {"005.rotary_attention<32, 4, 2>.o.weight", {32, 32}},
        {"006.swiglu_mlp<32, 48>.gate.weight", {48, 32}},
        {"006.swiglu_mlp<32, 48>.up.weight", {48, 32}},
        {"006.swiglu_mlp<32, 48>.down.weight", {32, 48}},
        {"007.linear<32, 40, no_bias>.weight", {40, 32}},
        {"008.linear<40, 64>.weight", {64, 40}},
        {"008.linear<40, 64>.bias", {64}}};
    CHECK(r.entries().size() == want.size());
    std::int64_t at = 0;
    for (const auto& [name, shape] : want) {
      INFO(name);
      REQUIRE(r.entries().count(name) == 1);
      const auto& e = r.entries().at(name);
      CHECK(e.dtype == "F32");
      CHECK(e.shape == shape);
      std::int64_t elems = 1;
      for (const auto d : shape) elems *= d;
      CHECK(e.offsets == std::vector<std::int64_t>{at, at + 4 * elems});
      at += 4 * elems;
    }
    CHECK(at == 4 * one.params().numel());
    CHECK(r.metadata().at("step") == "7");
    CHECK(r.metadata().at("model") == layer_name<kinds>());
    // the layouts as docs/checkpoints.md gives them, read from the file alone
    constexpr index_t R = 3, D = 32;  // 3 tokens of one sequence
    std::vector<double> x(static_cast<std::size_t>(R * 40));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37 * static_cast<double>(i) + 0.1);
    {  // linear<40, 64>: y = x W^T + b, W (Out, In)
      auto y = times_t(x, r.floats("008.linear<40, 64>.weight"), R, 40, 64);
      const auto b = r.floats("008.linear<40, 64>.bias");
      for (index_t i = 0; i < R * 64; ++i) y[i] += b[i % 64];
      CHECK(max_diff(forward_from<linear<40, 64>>(r, "008.linear<40, 64>", x, R), y) < 1e-5);
    }
    x.resize(static_cast<std::size_t>(R * D));
    {  // causal_self_attention: the rows of qkv.weight give [Q | K | V], head h in columns [h hd, (h+1) hd) of each
      const std::string u = "003.causal_self_attention<32, 4>";
      auto qkv = times_t(x, r.floats(u + ".qkv.weight"), R, D, 3 * D);
      const auto bq = r.floats(u + ".qkv.bias");
      for (index_t i = 0; i < R * 3 * D; ++i) qkv[i] += bq[i % (3 * D)];
      constexpr index_t H = 4, hd = D / H;
      std::vector<double> att(static_cast<std::size_t>(R * D), 0.0);
      for (index_t h = 0; h < H; ++h)
        for (index_t i = 0; i < R; ++i) {
          std::vector<double> p(static_cast<std::size_t>(i + 1));
          double mx = -1e300, sum = 0;
          for (index_t j = 0; j <= i; ++j) {
            double s = 0;
            for (index_t e = 0; e < hd; ++e) s += qkv[i * 3 * D + h * hd + e] * qkv[j * 3 * D + D + h * hd + e];
            p[j] = s / std::sqrt(static_cast<double>(hd));
            mx = std::max(mx, p[j]);
          }
          for (auto& v : p) sum += (v = std::exp(v - mx));
          for (index_t j = 0; j <= i; ++j)
            for (index_t e = 0; e < hd; ++e) att[i * D + h * hd + e] += p[j] / sum * qkv[j * 3 * D + 2 * D + h * hd + e];
        }
      auto y = times_t(att, r.floats(u + ".out.weight"), R, D, D);
      const auto bo = r.floats(u + ".out.bias");
      for (index_t i = 0; i < R * D; ++i) y[i] += bo[i % D];
      CHECK(max_diff(forward_from<causal_self_attention<32, 4>>(r, u, x, R), y) < 1e-5);
    }
    {  // swiglu_mlp: y = down(silu(gate x) * up x)
      const std::string u = "006.swiglu_mlp<32, 48>";
      const auto g = times_t(x, r.floats(u + ".gate.weight"), R, D, 48), up = times_t(x, r.floats(u + ".up.weight"), R, D, 48);
      std::vector<double> hid(g.size());
      for (std::size_t i = 0; i < g.size(); ++i) hid[i] = g[i] / (1 + std::exp(-g[i])) * up[i];
      CHECK(max_diff(forward_from<swiglu_mlp<32, 48>>(r, u, x, R), times_t(hid, r.floats(u + ".down.weight"), R, 48, D)) < 1e-5);
    }
  }
  // the file imports under ZeRO-3 (ranges that cut tensors anywhere) and under tensor parallelism, bit for bit;
  // so does a file that places the same tensors in another order
  reversed(w, file, dir + "/reversed.safetensors");
  for (const auto& f : {file, dir + "/reversed.safetensors"}) {
    auto z = make<shard<kinds, 3>>(ctx, seed{1});
    import_safetensors(f, z);
    CHECK(bit_diffs(w, z.full_params().v(), one.params()) == 0);
  }
  {
    auto c2 = test::on_mesh(n <= 2 ? "model=" + std::to_string(n) : "data=" + std::to_string(n / 2) + ",model=2");
    auto s = make<split<kinds>>(c2, seed{1});
    import_safetensors(file, s);
    CHECK(bit_diffs(w, s.full_params().v(), one.params()) == 0);
    // and its export holds the same tensors (names, shapes, places) and the same bytes (the model's name differs: the plan's)
    export_safetensors(dir + "/again.safetensors", s, 7);
    if (w.rank() == 0) {
      const ckpt::st_reader a(file, "test"), b(dir + "/again.safetensors", "test");
      CHECK(a.entries().size() == b.entries().size());
      for (const auto& [name, e] : a.entries()) {
        INFO(name);
        REQUIRE(b.entries().count(name) == 1);
        CHECK(b.entries().at(name).shape == e.shape);
        CHECK(b.entries().at(name).offsets == e.offsets);
        CHECK(b.floats(name) == a.floats(name));
      }
      CHECK(b.metadata().at("model") == layer_name<split<kinds>>());
    }
  }
  // a layer with parameters that states no shapes: refused before anything is written, naming it
  {
    auto u = make<replicate<sequential<embedding<64, 32>, unshaped_norm, linear<32, 64>, softmax_cross_entropy>>>(ctx, seed{1});
    refused(w, "unshaped export", "tensor 'gain' of layer 1 ('unshaped_norm') states no shape", [&] { export_safetensors(dir + "/u.safetensors", u); });
    refused(w, "unshaped import", "tensor 'gain' of layer 1 ('unshaped_norm') states no shape", [&] { import_safetensors(file, u); });
    CHECK(!fs::exists(dir + "/u.safetensors"));
  }
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
