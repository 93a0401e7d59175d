// Initialisation schemes applied after a network is made: `initialize(net,
// seed, gpt2_init{})` rewrites every parameter as a pure function of (seed,
// layer, index), so every plan and mesh gets the same unsplit values. Layers
// keep their own init (PyTorch's) when this is not called.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/plan/describe.hpp"
#include "whale/tensor/random.hpp"
#include "whale/train/checkpoint.hpp"

namespace whale {

/// GPT-2's initialisation, as nanoGPT and Megatron-LM use it: weights and
/// embedding tables N(0, std), biases 0, gains 1; and the last weight of each
/// residual branch (attention's output projection, the FFN's second linear)
/// N(0, std / sqrt(number of residual branches)), so the residual stream does
/// not grow with depth.
struct gpt2_init {
  double std = 0.02;
};

namespace detail {
/// Value of element `i` of tensor `t` of a unit under gpt2_init.
inline float gpt2_value(const counter_rng& r, const param_tensor& t, index_t i, double std) {
  switch (t.role) {
    case param_role::weight:
    case param_role::table: return static_cast<float>(std * r.normal(static_cast<std::uint64_t>(i)));
    case param_role::gain: return 1.f;
    case param_role::bias: return 0.f;
  }
  return 0.f;
}
}  // namespace detail

/// Rewrite every parameter of `net` (network<M>, or a plan made by make<P>)
/// by `rule`; no communication (each rank writes what it holds). Call it
/// before making the trainer. Throws std::invalid_argument if a layer with
/// parameters does not list them (param_tensors()).
template <Checkpointable Net> void initialize(Net& net, seed s, const gpt2_init& rule = {}) {
  if (!(rule.std > 0) || !std::isfinite(rule.std))
    throw std::invalid_argument("whale::initialize: gpt2_init::std must be finite and > 0 (got " + std::to_string(rule.std) + ")");
  const auto d = describe<typename Net::model_type>();
  // each unit's first full index, tensors and the std of its last weight
  struct unit_plan {
    index_t first = 0, count = 0;
    std::vector<param_tensor> tensors;
    std::size_t scaled = SIZE_MAX;  // the tensor drawn with the residual std
    counter_rng rng;                // keyed by its ordinal among the layers with parameters (plan-independent)
  };
  std::vector<unit_plan> units;
  int branches = 0;
  for (const auto& u : d.units) branches += u.residual_out ? 1 : 0;
  const double res_std = branches > 0 ? rule.std / std::sqrt(static_cast<double>(branches)) : rule.std;
  index_t at = 0;
  std::size_t ordinal = 0;
  for (const auto& u : d.units) {
    unit_plan p{at, u.full_params, {}, SIZE_MAX, counter_rng(s, 5).child(static_cast<std::uint64_t>(ordinal))};
    at += u.full_params;
    if (u.full_params > 0) {
      if (!u.tensors)
        throw std::invalid_argument("whale::initialize: " + u.unsplit + " has " + std::to_string(u.full_params) +
                                    " parameters but lists no param_tensors(); give the layer one to use gpt2_init");
      p.tensors = u.tensors();
      index_t sum = 0;
      for (std::size_t t = 0; t < p.tensors.size(); ++t) {
        sum += p.tensors[t].count;
        if (u.residual_out && p.tensors[t].role == param_role::weight) p.scaled = t;
      }
      if (sum != u.full_params)
        throw std::invalid_argument("whale::initialize: the param_tensors() of " + u.unsplit + " cover " + std::to_string(sum) +
                                    " of its " + std::to_string(u.full_params) + " parameters");
      if (u.ties_to >= 0) {  // a tied head: its table's values, drawn as the table draws them
        const auto& table = units[static_cast<std::size_t>(u.ties_to)];
        p.rng = table.rng, p.tensors = table.tensors, p.scaled = SIZE_MAX;
      }
      ++ordinal;
    }
    units.push_back(std::move(p));
  }
  const auto L = ckpt::layout_for(net);
  // A network on a device: written into a host copy, then copied back.
  std::vector<float> host;
  bool on_device = false;
  if constexpr (requires { net.backend(); }) on_device = !net.backend().on_cpu();
  if constexpr (requires { net.backend(); })
    if (on_device) {
      host.resize(static_cast<std::size_t>(net.params().numel()));
      net.backend().copy(host.data(), net.params().data(), host.size() * sizeof(float));
      net.backend().synchronize();
    }
  float* local = on_device ? host.data() : net.params().data();
  std::size_t k = 0;  // the unit of the current full index (pieces rise through it)
  for (const auto& pc : ckpt::clip(L.all, L.resident_first, L.resident_end)) {
    for (index_t j = 0; j < pc.count; ++j) {
      const index_t f = pc.full + j;
      if (k >= units.size() || f < units[k].first) k = 0;
      while (k < units.size() && f >= units[k].first + units[k].count) ++k;
      if (k >= units.size()) throw std::logic_error("whale::initialize: parameter " + std::to_string(f) + " lies past the model");
      const auto& u = units[k];
      index_t i = f - u.first, base = 0;
      std::size_t t = 0;
      while (i - base >= u.tensors[t].count) base += u.tensors[t++].count;
      local[pc.local - L.resident_first + j] =
          detail::gpt2_value(u.rng, u.tensors[t], i, t == u.scaled ? res_std : rule.std);
    }
  }
  if constexpr (requires { net.backend(); })
    if (on_device) {
      net.backend().copy(net.params().data(), host.data(), host.size() * sizeof(float));
      net.backend().synchronize();
    }
}

}  // namespace whale
