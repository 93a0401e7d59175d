// The command-line flags every example shares (--steps N --save DIR
// --save-every K --resume DIR --log FILE --overwrite-log --log-every K
// --stop-on-divergence), what they do to a trainer, and the
// parameters' checksum the examples end with, so that exact resume can be
// checked from the shell:
//   example --steps 6                      -> params checksum: X
//   example --steps 3 --save ck            (saves ck/step-00000003)
//   example --steps 6 --resume ck          -> params checksum: X
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/detail/parse.hpp"
#include "whale/train/checkpoint_format.hpp"
#include "whale/train/trainer.hpp"

namespace whale {

struct run_flags {
  std::int64_t steps = 1;       ///< --steps N: train until data step N (counting steps done before a resume)
  std::string save;             ///< --save DIR: checkpoint directory (saved at the end, and every --save-every)
  std::int64_t save_every = 0;  ///< --save-every K
  std::string resume;           ///< --resume DIR: load the newest checkpoint there (or this step directory) first
  std::string log;              ///< --log FILE: the metrics log, one JSON object per step
  std::int64_t log_every = 0;   ///< --log-every K: trainer_options::log_every (0: the program's own)
  bool overwrite_log = false;   ///< --overwrite-log: replace an existing --log FILE (without --resume it is an error)
  bool stop_on_divergence = false;  ///< --stop-on-divergence: end a diverging run (trainer_options::stop_on_divergence)
  static constexpr const char* names =
      "--steps N, --save DIR, --save-every K, --resume DIR, --log FILE, --overwrite-log, --log-every K, --stop-on-divergence";

  explicit run_flags(std::int64_t default_steps) : steps(default_steps) {}

  /// Consume argv[i] (and its value, advancing i) if it is one of these flags.
  bool take(int& i, int argc, char** argv) {
    const std::string a = argv[i];
    if (a == "--overwrite-log") return overwrite_log = true;
    if (a == "--stop-on-divergence") return stop_on_divergence = true;
    if (a != "--steps" && a != "--save" && a != "--save-every" && a != "--resume" && a != "--log" && a != "--log-every")
      return false;
    if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
    const std::string v = argv[++i];
    if (a == "--steps") steps = detail::parse_int(v, "--steps", 1, 100000000);
    else if (a == "--save-every") save_every = detail::parse_int(v, "--save-every", 1, 100000000);
    else if (a == "--log-every") log_every = detail::parse_int(v, "--log-every", 1, 100000);
    else if (v.empty()) throw std::invalid_argument(a + ": an empty path");
    else if (a == "--save") save = v;
    else if (a == "--resume") resume = v;
    else log = v;
    return true;
  }
  /// The trainer options these flags stand for.
  trainer_options& apply(trainer_options& o) const {
    if (save_every > 0 && save.empty()) throw std::invalid_argument("--save-every needs --save DIR");
    o.checkpoint_dir = save;
    o.save_every = save_every;
    o.log_path = log;
    o.continue_log = !resume.empty();  // run() loads --resume first: the log continues from its step
    o.overwrite_log = overwrite_log;
    if (stop_on_divergence) o.stop_on_divergence = true;
    if (log_every > 0) o.log_every = log_every;
    return o;
  }
  trainer_options options(trainer_options o = {}) const { return apply(o); }

  /// Load --resume, train until data step `steps`, and save at the end if --save.
  template <class T, class Data> train_result run(T& t, Data& data) const {
    if (!resume.empty()) t.load(resume);
    const auto r = t.run(data, whale::steps{remaining(t)});
    finish(t);
    return r;
  }
  /// The same, evaluating on `eval` every trainer_options::eval_every steps.
  template <class T, class Data, class Eval> train_result run(T& t, Data& data, Eval& eval) const {
    if (!resume.empty()) t.load(resume);
    const auto r = t.run(data, whale::steps{remaining(t)}, eval);
    finish(t);
    return r;
  }
  /// Steps left until data step `steps`.
  template <class T> std::int64_t remaining(const T& t) const { return std::max<std::int64_t>(0, steps - t.next_step()); }
  /// The final save of --save (unless --save-every just saved this step).
  template <class T> void finish(T& t) const {
    if (!save.empty() && (save_every == 0 || t.next_step() % save_every != 0)) t.save(save);
  }
};

/// A checksum of the whole unsplit model's parameters, the same under every
/// plan that holds the same values (collective for a plan: it gathers them).
template <class Net> std::uint64_t params_checksum(Net& net) {
  ckpt::hasher h;
  if constexpr (requires { net.full_params(); }) {
    const auto full = net.full_params();
    h.add(full.data(), static_cast<std::size_t>(full.numel()) * sizeof(float));
  } else {
    std::vector<float> host;  // a network on a device: its parameters copied to the host
    const auto p = ckpt::backend_of(net).host_readable(cview<float>(net.params()), host);
    h.add(p.data(), static_cast<std::size_t>(p.numel()) * sizeof(float));
  }
  return h.value();
}
/// Print "params checksum: <16 hex digits>" on rank 0 (collective for a plan).
template <class Net> void print_params_checksum(Net& net) {
  const auto c = params_checksum(net);
  if (net.rank() == 0) std::printf("params checksum: %s\n", ckpt::hex64(c).c_str());
}

}  // namespace whale
