// Data sources and what the trainer does with them: the DataSource concept,
// tensor_data and token_file (order, splits, errors), ignore_index in the
// loss, evaluation during run(), the progress line of manual steps, and
// gpt2_init's values.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

#include "whale/models/gpt.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/network.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/train/init.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;

static_assert(DataSource<teacher_data> && DataSource<markov_data>);
static_assert(DataSource<tensor_data<float>> && DataSource<tensor_data<std::int32_t>> && DataSource<token_file>);
struct no_get {
  using input_type = float;
  index_t global_batch() const { return 1; }
  index_t seq() const { return 1; }
};
static_assert(!DataSource<no_get> && !DataSource<int>);

namespace {
trainer_options quiet() {
  trainer_options o;
  o.progress = false;
  return o;
}
std::string temp_path(const char* name) {
  return "/tmp/whale-test-" + std::to_string(::getpid()) + "-" + name;
}
template <class T> void write_file(const std::string& path, const std::vector<T>& v, const std::vector<std::int32_t>& header = {}) {
  std::ofstream f(path, std::ios::binary);
  if (!header.empty()) f.write(reinterpret_cast<const char*>(header.data()), static_cast<std::streamsize>(header.size() * 4));
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
}
std::string message_of(auto&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}
tensor<float> features(index_t n, index_t f) {
  tensor<float> x({n, f});
  const counter_rng r(seed{9});
  for (index_t i = 0; i < n * f; ++i) x[i] = static_cast<float>(r.normal(static_cast<std::uint64_t>(i)));
  return x;
}
tensor<std::int32_t> labels(index_t n, index_t classes) {
  tensor<std::int32_t> y({n});
  for (index_t i = 0; i < n; ++i) y[i] = static_cast<std::int32_t>((i * 7 + 3) % classes);
  return y;
}
using small = sequential<linear<6, 16>, relu, linear<16, 4>, softmax_cross_entropy>;
}  // namespace

TEST_CASE("tensor_data: every epoch visits each sample once, in an order that does not depend on the slicing") {
  const index_t n = 12, batch = 4;
  tensor_data<float> d(features(n, 6), labels(n, 4), batch, {.shuffle = true, .seed = seed{5}});
  CHECK(d.size() == n);
  CHECK(d.seq() == 1);
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<float> firsts;
    for (std::int64_t s = epoch * 3; s < epoch * 3 + 3; ++s) {
      const auto whole = d.get(s, 0, batch);
      std::vector<float> w(whole.inputs.data(), whole.inputs.data() + batch * 6);
      for (index_t r = 0; r < batch; ++r) firsts.push_back(w[static_cast<std::size_t>(r * 6)]);
      // rows 1..2 alone are the same rows as in the whole batch
      const auto part = d.get(s, 1, 2);
      for (index_t i = 0; i < 2 * 6; ++i) CHECK(part.inputs[i] == w[static_cast<std::size_t>(6 + i)]);
    }
    std::set<float> distinct(firsts.begin(), firsts.end());
    CHECK(distinct.size() == static_cast<std::size_t>(n));  // a permutation of the 12 samples
  }
  // no shuffle: in order
  tensor_data<float> seq(features(n, 6), labels(n, 4), batch, {.shuffle = false});
  const auto x = features(n, 6);
  const auto b = seq.get(2, 0, batch);  // samples 8..11
  for (index_t i = 0; i < batch * 6; ++i) CHECK(b.inputs[i] == x[8 * 6 + i]);
  CHECK(b.labels[0] == (8 * 7 + 3) % 4);
}

TEST_CASE("tensor_data: wrong shapes and labels are errors that say what is wrong") {
  CHECK(message_of([] { tensor_data<float>(features(4, 3), labels(5, 2), 2); }).find("5 labels for 4 samples of 3 features") != std::string::npos);
  CHECK(message_of([] { tensor_data<float>(features(4, 3), labels(4, 2), 0); }).find("global_batch must be >= 1") != std::string::npos);
  auto y = labels(4, 2);
  y[2] = -3;
  CHECK(message_of([&] { tensor_data<float>(features(4, 3), std::move(y), 2); }).find("label 2 is -3") != std::string::npos);
  tensor_data<float> d(features(4, 3), labels(4, 2), 2);
  CHECK(message_of([&] { d.get(0, 1, 2); }).find("rows [1, 3) outside the global batch of 2") != std::string::npos);
  // token sequences: one label per token
  tensor<std::int32_t> toks({3, 5}), next({3, 5});
  tensor_data<std::int32_t> lm(std::move(toks), std::move(next), 2);
  CHECK(lm.seq() == 5);
}

TEST_CASE("token_file: windows of seq + 1 tokens, the held-out tail, llm.c headers, u32 ids") {
  std::vector<std::uint16_t> toks(101);
  for (std::size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<std::uint16_t>(i * 3 % 1000);
  const auto raw = temp_path("tokens.bin");
  write_file(raw, toks);
  token_file train(raw, 8, 2, {.held_out = 0.2, .vocab = 1000, .shuffle = false});
  token_file held(raw, 8, 2, {.held_out = 0.2, .split = token_split::held_out, .vocab = 1000, .shuffle = false});
  CHECK(train.tokens() == 81);
  CHECK(held.tokens() == 20);
  CHECK(train.windows() == 10);
  CHECK(held.windows() == 2);
  const auto b = train.get(1, 0, 2);  // windows 2 and 3 of the training part
  for (index_t t = 0; t < 8; ++t) {
    CHECK(b.inputs[t] == toks[static_cast<std::size_t>(16 + t)]);
    CHECK(b.labels[t] == toks[static_cast<std::size_t>(17 + t)]);
    CHECK(b.inputs[8 + t] == toks[static_cast<std::size_t>(24 + t)]);
  }
  const auto h = held.get(0, 0, 1);  // the first held-out window starts at token 81
  CHECK(h.inputs[0] == toks[81]);
  // shuffled: each epoch of 10 windows is a permutation
  token_file mixed(raw, 8, 5, {.held_out = 0.2, .seed = seed{3}});
  std::set<std::int32_t> starts;
  for (std::int64_t s = 0; s < 2; ++s) {
    const auto m = mixed.get(s, 0, 5);
    for (index_t r = 0; r < 5; ++r) starts.insert(m.inputs[r * 8]);
  }
  CHECK(starts.size() == 10);
  // llm.c: 256 int32 header (magic, version, count), uint16 ids
  std::vector<std::int32_t> header(256, 0);
  header[0] = 20240520, header[1] = 1, header[2] = 101;
  const auto llmc = temp_path("llmc.bin");
  write_file(llmc, toks, header);
  token_file lc(llmc, 8, 2, {.shuffle = false});
  CHECK(lc.tokens() == 101);
  CHECK(lc.get(0, 1, 1).inputs[0] == toks[8]);
  header[2] = 200;  // says more than it holds
  write_file(llmc, toks, header);
  CHECK(message_of([&] { token_file(llmc, 8, 2); }).find("says 200 tokens but the file has 1226 bytes") != std::string::npos);
  // u32
  std::vector<std::uint32_t> wide(40);
  for (std::size_t i = 0; i < wide.size(); ++i) wide[i] = static_cast<std::uint32_t>(70000 + i);
  const auto w32 = temp_path("u32.bin");
  write_file(w32, wide);
  token_file u32(w32, 4, 1, {.width = token_width::u32, .shuffle = false});
  CHECK(u32.get(0, 0, 1).labels[0] == 70001);
  std::remove(raw.c_str());
  std::remove(llmc.c_str());
  std::remove(w32.c_str());
}

TEST_CASE("token_file: missing, odd-sized and too-short files, and out-of-vocabulary tokens, are named errors") {
  const auto missing = temp_path("missing.bin");
  CHECK(message_of([&] { token_file(missing, 8, 2); }).find(missing + "': cannot open it") != std::string::npos);
  const auto empty = temp_path("empty.bin");
  write_file(empty, std::vector<std::uint16_t>{});
  CHECK(message_of([&] { token_file(empty, 8, 2); }).find("the file is empty") != std::string::npos);
  std::remove(empty.c_str());
  const auto odd = temp_path("odd.bin");
  write_file(odd, std::vector<std::uint8_t>(33, 1));
  CHECK(message_of([&] { token_file(odd, 4, 2); }).find("33 bytes is not a whole number of 2-byte token ids") != std::string::npos);
  write_file(odd, std::vector<std::uint16_t>(20, 5));
  CHECK(message_of([&] { token_file(odd, 4, 2, {.split = token_split::held_out}); }).find("(set token_file_options::held_out)") != std::string::npos);
  CHECK(message_of([&] { token_file(odd, 4, 2, {.held_out = 1.0}); }).find("held_out must be in [0, 1)") != std::string::npos);
  token_file small_vocab(odd, 4, 2, {.vocab = 5});
  CHECK(message_of([&] { small_vocab.get(0, 0, 1); }).find("token 5 at position 0 is outside the vocabulary of 5") != std::string::npos);
  std::remove(odd.c_str());
}

TEST_CASE("ignore_index: ignored rows add no loss and no gradient, and the mean is over the others") {
  const index_t n = 8;
  auto x = features(n, 6);
  auto y = labels(n, 4);
  std::vector<index_t> kept;
  auto ym = labels(n, 4);
  for (index_t i = 0; i < n; ++i)
    if (i % 3 == 1) ym[i] = ignore_index;
    else kept.push_back(i);
  tensor<float> xk({static_cast<index_t>(kept.size()), 6});
  tensor<std::int32_t> yk({static_cast<index_t>(kept.size())});
  for (std::size_t k = 0; k < kept.size(); ++k) {
    for (index_t j = 0; j < 6; ++j) xk[static_cast<index_t>(k) * 6 + j] = x[kept[k] * 6 + j];
    yk[static_cast<index_t>(k)] = y[kept[k]];
  }
  tensor_data<float> masked(std::move(x), std::move(ym), n, {.shuffle = false});
  tensor_data<float> subset(std::move(xk), std::move(yk), static_cast<index_t>(kept.size()), {.shuffle = false});
  CHECK(masked.labelled(0) == static_cast<std::int64_t>(kept.size()));
  // two steps of SGD on each: the same parameters (the mean is over the kept rows only)
  network<small> a(seed{4}), b(seed{4});
  trainer ta(a, sgd{.lr = 0.1f}, quiet()), tb(b, sgd{.lr = 0.1f}, quiet());
  const double la = ta.step(masked, 0), lb = tb.step(subset, 0);
  CHECK(la == doctest::Approx(lb).epsilon(1e-6));
  ta.step(masked, 0);
  tb.step(subset, 0);
  double worst = 0;
  for (index_t i = 0; i < a.param_count(); ++i) worst = std::max(worst, static_cast<double>(std::fabs(a.params()[i] - b.params()[i])));
  CHECK(worst < 1e-6);
}

TEST_CASE("run() evaluates every eval_every steps; manual steps print a progress line of their own") {
  network<small> net(seed{1});
  tensor_data<float> train(features(32, 6), labels(32, 4), 8);
  tensor_data<float> held(features(16, 6), labels(16, 4), 8, {.shuffle = false});
  auto o = quiet();
  o.eval_every = 2;
  o.eval_steps = 2;
  const auto log = temp_path("eval.jsonl");
  o.log_path = log;
  o.eval_metric = accuracy;  // train/metrics.hpp
  std::vector<double> direct_metric;  // the same metric from net.forward by hand
  std::vector<eval_report> evals;
  std::vector<double> direct;  // evaluate() called at the same moment
  trainer<network<small>, sgd>* self = nullptr;
  o.on_eval = [&](const eval_report& r) {
    evals.push_back(r);
    direct.push_back(self->evaluate(held, steps{2}));
    metric_share all;
    for (std::int64_t s = 0; s < 2; ++s) {
      const auto b = held.get(s, 0, 8);
      step_ctx c;
      c.batch = 8;
      const auto logits = net.forward(c, b.inputs);
      for (index_t r = 0; r < 8; ++r) {  // top-1 by hand
        index_t best = 0;
        for (index_t j = 1; j < 4; ++j)
          if (logits[r * 4 + j] > logits[r * 4 + best]) best = j;
        all.sum += best == b.labels[r];
        all.count += 1;
      }
    }
    direct_metric.push_back(all.sum / all.count);
  };
  trainer t(net, sgd{.lr = 0.05f}, o);
  self = &t;
  t.run(train, steps{5}, held);
  REQUIRE(evals.size() == 2);
  CHECK(evals[0].step == 2);
  CHECK(evals[1].step == 4);
  CHECK(evals[1].loss == direct[1]);
  CHECK(evals[0].loss != evals[1].loss);
  CHECK(evals[0].metric == direct_metric[0]);
  CHECK(evals[1].metric == direct_metric[1]);
  std::ifstream f(log);
  std::string line;
  int evals_logged = 0, steps_logged = 0, metrics_logged = 0;
  while (std::getline(f, line)) {
    (line.find("\"eval_loss\"") != std::string::npos ? evals_logged : steps_logged)++;
    metrics_logged += line.find("\"eval_metric\":") != std::string::npos;
  }
  CHECK(metrics_logged == 2);
  CHECK(evals_logged == 2);
  CHECK(steps_logged == 5);
  std::remove(log.c_str());
  CHECK(message_of([&] { t.run(train, steps{1}); }).find("eval_every is set but run() was given no evaluation data") != std::string::npos);

  // manual stepping: the progress line counts the steps, with no total
  std::FILE* out = std::tmpfile();
  trainer_options m;
  m.out = out;
  m.plain_every = 1;
  network<small> net2(seed{1});
  trainer t2(net2, sgd{.lr = 0.05f}, m);
  for (std::int64_t s = 0; s < 3; ++s) t2.step(train, s);
  CHECK(t2.next_step() == 3);
  std::rewind(out);
  char buf[512] = {};
  const auto got = std::fread(buf, 1, sizeof buf - 1, out);
  std::fclose(out);
  const std::string text(buf, got);
  CHECK(text.find("step 1  loss") != std::string::npos);
  CHECK(text.find("step 3  loss") != std::string::npos);
  CHECK(text.find("ETA") == std::string::npos);
}

TEST_CASE("gpt2_init: weights N(0, 0.02), residual outputs N(0, 0.02/sqrt(branches)), biases 0, gains 1") {
  using tiny = models::gpt_model<64, 16, 32, 2, 64, 2>;  // 2 blocks: 4 residual branches
  network<tiny> net(seed{1});
  initialize(net, seed{8});
  const auto d = describe<tiny>();
  const auto p = net.params();
  index_t at = 0;
  int checked = 0;
  for (const auto& u : d.units) {
    if (u.full_params == 0) continue;
    REQUIRE(static_cast<bool>(u.tensors));
    index_t off = at;
    const auto ts = u.tensors();
    for (std::size_t t = 0; t < ts.size(); ++t) {
      double s = 0, s2 = 0;
      for (index_t i = 0; i < ts[t].count; ++i) {
        s += p[off + i];
        s2 += static_cast<double>(p[off + i]) * p[off + i];
      }
      const double mean = s / static_cast<double>(ts[t].count), sd = std::sqrt(s2 / static_cast<double>(ts[t].count) - mean * mean);
      const bool last_weight = u.residual_out && t + 2 == ts.size();  // attention's out.weight, a linear's weight
      switch (ts[t].role) {
        case param_role::bias: CHECK(s2 == 0); break;
        case param_role::gain: CHECK(s == doctest::Approx(static_cast<double>(ts[t].count))); CHECK(sd < 1e-9); break;
        default:
          CHECK(sd == doctest::Approx(last_weight ? 0.01 : 0.02).epsilon(0.1));
          ++checked;
      }
      off += ts[t].count;
    }
    at += u.full_params;
  }
  CHECK(checked == 2 + 2 * 4 + 1);  // two tables; per block qkv, out and the two FFN weights; the head
  // the same seed gives the same values; another seed other values
  network<tiny> again(seed{2});
  initialize(again, seed{8});
  CHECK(std::equal(p.data(), p.data() + p.numel(), again.params().data()));
  CHECK(message_of([&] { initialize(net, seed{1}, {.std = -1}); }).find("gpt2_init::std must be finite and > 0") != std::string::npos);
}
