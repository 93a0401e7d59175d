// `gradcheck<L>(in, out)`: a layer's backward against central finite
// differences, on the CPU, with the error normalised per tensor (its input
// and each of its parameter tensors), as whale checks its own layers. For a
// layer you write (docs/layers.md, "Writing a layer").
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "whale/nn/layer.hpp"
#include "whale/tensor/random.hpp"
#include "whale/tensor/tensor.hpp"

namespace whale {

/// Values ~ N(0, scale²) from stream `stream` of seed 1234, element i at index i.
inline void fill_normal(view<float> v, std::uint64_t stream, float scale = 1.f) {
  counter_rng r(seed{1234}, stream);
  for (index_t i = 0; i < v.numel(); ++i) v[i] = static_cast<float>(scale * r.normal(static_cast<std::uint64_t>(i)));
}

/// A layer bound to its own parameter and gradient buffers in host memory,
/// initialised by its init() from seed `s`.
template <class L> struct bound_layer {
  L layer;
  tensor<float> params, grads;
  explicit bound_layer(std::uint64_t s = 5) {
    const index_t n = std::max<index_t>(layer.param_count(), 1);
    params = tensor<float>({n}, mem_kind::params);
    grads = tensor<float>({n}, mem_kind::grads);
    param_binder b(params.data(), grads.data(), n);
    layer.bind(b);
    layer.init(counter_rng(seed{s}));
  }
  index_t count() const { return layer.param_count(); }
};

/// The gradients of sum(w ⊙ layer(x)), w ~ N(0, 1), by the layer's backward
/// (an_) and by central differences of step `step` (fd_): of the input x
/// (float inputs; token inputs have none) and of every `stride`-th parameter,
/// each perturbed in place.
struct layer_gradients {
  std::vector<double> an_x, fd_x, an_p, fd_p;
};
template <class L, class In>
layer_gradients finite_differences(bound_layer<L>& m, step_ctx c, view<In> x, index_t out_width, double step = 1e-2,
                                   index_t stride = 1) {
  const index_t rows = c.rows();
  tensor<float> w({rows, out_width});
  fill_normal(w.v(), 99);
  auto loss = [&] {
    auto y = m.layer.forward(c, cview<In>(x));
    if (y.numel() != w.numel())
      throw std::invalid_argument("whale::gradcheck: " + layer_name<L>() + " gave " + std::to_string(y.numel()) +
                                  " outputs, not rows x out_width = " + std::to_string(w.numel()));
    double s = 0;
    for (index_t i = 0; i < y.numel(); ++i) s += static_cast<double>(w[i]) * y[i];
    return s;
  };
  layer_gradients r;
  loss();
  c.accumulate = false;
  c.need_input_grad = std::is_same_v<In, float>;
  auto dx = m.layer.backward(c, cview<float>(w.v()));
  if constexpr (std::is_same_v<In, float>) {
    if (dx.numel() != x.numel())
      throw std::invalid_argument("whale::gradcheck: " + layer_name<L>() + "'s backward gave " + std::to_string(dx.numel()) +
                                  " input gradients for " + std::to_string(x.numel()) + " inputs");
    for (index_t i = 0; i < dx.numel(); ++i) r.an_x.push_back(dx[i]);
  } else if (!dx.empty()) {
    throw std::invalid_argument("whale::gradcheck: " + layer_name<L>() +
                                " takes token ids but its backward returned an input gradient (step_ctx::need_input_grad was false)");
  }
  for (index_t i = 0; i < m.count(); i += stride) r.an_p.push_back(m.grads[i]);
  auto central = [&](float& v) {
    const float saved = v;
    v = static_cast<float>(saved + step);
    const double lp = loss();
    v = static_cast<float>(saved - step);
    const double lm = loss();
    v = saved;
    return (lp - lm) / (2 * step);
  };
  if constexpr (std::is_same_v<In, float>)
    for (index_t i = 0; i < x.numel(); ++i) r.fd_x.push_back(central(x[i]));
  for (index_t i = 0; i < m.count(); i += stride) r.fd_p.push_back(central(m.params[i]));
  return r;
}

/// Worst |fd - an| over the largest |an| (at least `floor`, so that a
/// gradient of near zeros is not divided by near zero).
inline double normalised_error(const std::vector<double>& an, const std::vector<double>& fd, double floor = 1e-3) {
  double amax = 0, emax = 0;
  for (std::size_t i = 0; i < an.size() && i < fd.size(); ++i) {
    amax = std::max(amax, std::abs(an[i]));
    emax = std::max(emax, std::abs(an[i] - fd[i]));
  }
  return emax / std::max(amax, floor);
}

struct gradcheck_options {
  index_t batch = 2, seq = 4;  ///< rows = batch x seq (step_ctx::batch and seq, for sequence layers)
  double step = 1e-2;          ///< the central difference's step (fp32: smaller steps drown in rounding)
  double tolerance = 1e-2;     ///< the largest normalised error a tensor may have
  double min_largest = 1e-3;   ///< a tensor whose largest gradient is below this checks nothing: it fails
  index_t stride = 1;          ///< check every stride-th parameter (large layers)
  std::uint64_t seed = 5;      ///< the layer's init seed
};

/// The outcome of gradcheck, one entry a tensor: "input", then each parameter
/// tensor (named by the layer's param_tensors(), or "parameters" as one).
struct gradcheck_report {
  struct entry {
    std::string tensor;
    double error = 0, largest = 0;
    bool ok = false;
  };
  std::string layer;
  std::vector<entry> tensors;
  bool ok() const {
    return !tensors.empty() && std::all_of(tensors.begin(), tensors.end(), [](const entry& e) { return e.ok; });
  }
  std::string str() const {
    std::ostringstream os;
    os << layer << ": " << (ok() ? "backward matches finite differences" : "backward DIFFERS from finite differences");
    for (const auto& e : tensors)
      os << "\n  " << e.tensor << ": error " << e.error << " of the largest gradient " << e.largest << (e.ok ? "" : "  <- FAILS");
    return os.str();
  }
};

/// Check L's backward against central differences on inputs (batch x seq,
/// in_width) ~ N(0, 1) and outputs of out_width: the error of its input
/// gradient and of each parameter tensor, each normalised by its own largest
/// entry. Float-input layers; see finite_differences for token inputs.
template <class L> gradcheck_report gradcheck(index_t in_width, index_t out_width, gradcheck_options o = {}) {
  if (o.stride < 1 || o.batch < 1 || o.seq < 1 || !(o.step > 0))
    throw std::invalid_argument("whale::gradcheck: stride, batch and seq must be at least 1 and step positive");
  bound_layer<L> m(o.seed);
  step_ctx c;
  c.batch = o.batch, c.seq = o.seq, c.global_rows = o.batch * o.seq;
  tensor<float> x({c.rows(), in_width});
  fill_normal(x.v(), 7);
  const auto g = finite_differences(m, c, x.v(), out_width, o.step, o.stride);
  gradcheck_report rep;
  rep.layer = layer_name<L>();
  auto add = [&](std::string name, const std::vector<double>& an, const std::vector<double>& fd) {
    gradcheck_report::entry e;
    e.tensor = std::move(name);
    for (const double v : an) e.largest = std::max(e.largest, std::abs(v));
    e.error = normalised_error(an, fd);
    e.ok = e.error < o.tolerance && e.largest > o.min_largest;
    rep.tensors.push_back(e);
  };
  add("input", g.an_x, g.fd_x);
  if (m.count() == 0) return rep;
  if constexpr (requires { L::param_tensors(); }) {
    index_t at = 0;
    for (const auto& t : L::param_tensors()) {
      std::vector<double> an, fd;
      for (std::size_t k = 0; k < g.an_p.size(); ++k) {
        const index_t i = static_cast<index_t>(k) * o.stride;
        if (i >= at && i < at + t.count) an.push_back(g.an_p[k]), fd.push_back(g.fd_p[k]);
      }
      if (!an.empty()) add(t.name, an, fd);
      else rep.tensors.push_back({std::string(t.name) + " (no element sampled: lower the stride)", 0, 0, false});
      at += t.count;
    }
  } else {
    add("parameters", g.an_p, g.fd_p);
  }
  return rep;
}

}  // namespace whale
