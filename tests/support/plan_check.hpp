// Helpers shared by the tests that check a parallel plan against
// single-process training: quiet trainer options, a context on a given mesh,
// an elementwise comparison of parameters with a stated tolerance (reduced
// over every rank), a clipped AdamW run that records the gradient norms, a
// scratch directory every rank agrees on, and a schedule whose messages
// arrive out of reading order.
#pragma once

#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "whale/comm/context.hpp"
#include "whale/nn/network.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/strategy/schedule.hpp"
#include "whale/train/trainer.hpp"

namespace whale::test {

/// A fresh directory every rank agrees on (rank 0 names it, from its process id, and makes it).
inline std::string shared_dir(world_comm& w, const std::string& tag) {
  std::int64_t id = ::getpid();
  broadcast(w, view<std::int64_t>(&id, {1}), 0);
  const auto d = std::filesystem::temp_directory_path() / ("whale-" + tag + "-" + std::to_string(id));
  if (w.rank() == 0) std::filesystem::remove_all(d), std::filesystem::create_directories(d);
  barrier(w);
  return d.string();
}
/// `f` throws on every rank with a message containing `expect` (checked on every rank, agreed over `w`).
template <class F> void refused(world_comm& w, const char* what, const std::string& expect, F&& f) {
  std::string msg;
  try {
    f();
  } catch (const std::exception& e) {
    msg = e.what();
  }
  INFO(what << ": " << msg);
  int ok = msg.find(expect) != std::string::npos ? 1 : 0;
  all_reduce(w, view<int>(&ok, {1}), reduce_op::min);
  CHECK(ok == 1);
}
/// Removes a shared_dir once every rank is done with it.
inline void remove_dir(world_comm& w, const std::string& d) {
  barrier(w);
  if (w.rank() == 0) std::filesystem::remove_all(d);
}

/// A valid schedule whose activations reach stage 1 in another order than it
/// reads them: stage 0 runs micro-batches 0, 1, ...; the others run their
/// forwards, then their backwards, from the last micro-batch down.
struct swapped_schedule {
  static std::string name() { return "swapped"; }
  static std::vector<pipe_action> actions(int s, int, int m) {
    std::vector<pipe_action> a;
    for (int j = 0; j < m; ++j) a.push_back({pipe_action::forward, s == 0 ? j : m - 1 - j});
    for (int j = 0; j < m; ++j) a.push_back({pipe_action::backward, s == 0 ? j : m - 1 - j});
    return a;
  }
};

/// Trainer options without the progress line.
inline trainer_options quiet() {
  trainer_options o;
  o.progress = false;
  return o;
}

/// A context on mesh `spec` (e.g. "data=2,model=2"); every rank calls it.
inline context on_mesh(const std::string& spec) {
  ::setenv("WHALE_MESH", spec.c_str(), 1);
  auto ctx = context::init();
  ::unsetenv("WHALE_MESH");
  return ctx;
}

/// How two parameter vectors differ: the largest |a - b|, and how many
/// elements exceed atol + rtol * |b|.
struct diff {
  double max_abs = 0;
  index_t bad = 0;
};
inline diff compare(cview<float> a, cview<float> b, double atol, double rtol) {
  diff d;
  for (index_t i = 0; i < a.numel(); ++i) {
    const double e = std::abs(static_cast<double>(a[i]) - b[i]);
    d.max_abs = std::max(d.max_abs, e);
    if (e > atol + rtol * std::abs(static_cast<double>(b[i]))) ++d.bad;
  }
  return d;
}

/// `d` over every rank of `world`: the largest difference and the number of
/// elements out of tolerance on all of them (collective: every rank calls it).
inline diff over_ranks(world_comm& world, diff d) {
  all_reduce(world, view<double>(&d.max_abs, {1}), reduce_op::max);
  all_reduce(world, view<index_t>(&d.bad, {1}));
  return d;
}

/// A Trainable that passes everything to `net` and records the gradient norm
/// the trainer asks for before each optimizer step.
template <class Net>
class norm_recorder {
 public:
  using model_type = typename Net::model_type;
  using input_type = typename Net::input_type;
  explicit norm_recorder(Net& n) : net_(n) {}
  std::pair<index_t, index_t> local_batch(index_t g) const { return net_.local_batch(g); }
  double train_step(step_ctx& c, cview<input_type> x, cview<std::int32_t> y) { return net_.train_step(c, x, y); }
  double reduce_loss(double share) { return net_.reduce_loss(share); }
  double grad_norm() {
    norms.push_back(net_.grad_norm());
    return norms.back();
  }
  int rank() const { return net_.rank(); }
  int world_size() const { return net_.world_size(); }
  whale::precision precision() const { return net_.precision(); }  // the trainer trains in the plan's
  template <class O> typename O::state make_optimizer_state(const O& opt) const { return net_.make_optimizer_state(opt); }
  template <class O> void apply_optimizer(const O& opt, typename O::state& s, float scale) {
    net_.apply_optimizer(opt, s, scale);
  }
  std::vector<double> norms;

 private:
  Net& net_;
};

/// The clipped run every plan is checked with: AdamW with weight decay, and
/// eps 1e-5 (PyTorch's default is 1e-8). Some gradients are zero in exact
/// arithmetic (attention's key bias: softmax ignores a per-query constant), so
/// what they hold is rounding noise, which differs with the order of the sums;
/// with eps 1e-8 Adam turns that noise into steps of size lr.
inline adamw clip_adamw() { return adamw{.lr = 1e-2f, .eps = 1e-5f, .weight_decay = 0.1f}; }

/// A plan and single-process training after a clipped AdamW run, over every rank.
struct clip_result {
  diff params;              ///< this rank's parameters against the single-process ones, over every rank
  double single_norm0 = 0;  ///< the single-process gradient norm at step 0 (before clipping)
  double norm_rel = 0;      ///< the largest |plan norm / single norm - 1| over steps and ranks
  std::size_t norms = 0;    ///< how many norms the trainer asked the plan for (on this rank)
};

/// Train `net` (a plan built from seed 42) and network<Single>(seed 42) on the
/// batches of make_data() for `n` steps with clip_adamw(), clipping at
/// `max_norm`; then `mine(single)` compares this rank's parameters with the
/// single-process ones (it may be collective: every rank calls it).
template <class Single, class Net, class MakeData, class Mine>
clip_result run_clipped(world_comm& world, Net& net, MakeData make_data, double max_norm, int n, Mine mine) {
  trainer_options o = quiet();
  o.max_grad_norm = max_norm;
  norm_recorder<Net> plan(net);
  {
    auto data = make_data();
    trainer t(plan, clip_adamw(), o);
    t.run(data, steps{n});
  }
  network<Single> single(seed{42});
  norm_recorder<network<Single>> ref(single);
  {
    auto data = make_data();
    trainer t(ref, clip_adamw(), o);
    t.run(data, steps{n});
  }
  clip_result r;
  r.params = over_ranks(world, mine(single));
  r.single_norm0 = ref.norms.empty() ? 0.0 : ref.norms[0];
  r.norms = plan.norms.size();
  for (std::size_t i = 0; i < std::min(plan.norms.size(), ref.norms.size()); ++i)
    r.norm_rel = std::max(r.norm_rel, std::abs(plan.norms[i] / ref.norms[i] - 1.0));
  if (plan.norms.size() != ref.norms.size()) r.norm_rel = 1.0;
  all_reduce(world, view<double>(&r.norm_rel, {1}), reduce_op::max);
  return r;
}

}  // namespace whale::test
