// Helpers shared by the tests that check a parallel plan against
// single-process training: quiet trainer options, a context on a given mesh,
// and an elementwise comparison of parameters with a stated tolerance.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "whale/comm/context.hpp"
#include "whale/train/trainer.hpp"

namespace whale::test {

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

}  // namespace whale::test
