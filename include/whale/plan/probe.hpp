// `describe_kernels<P>()`: the plan type P read into data as describe<P>()
// does, with each leaf able to say what a GPU would run for it. A unit's
// `kernels(batch, seq, in, out, bf16)` runs the leaf (a sharded form: the
// layer it is a form of, whole) forward and backward once on a count-only
// guarded backend and returns its ledger per pass: GEMM FLOPs and calls,
// attention's products, the bytes its other kernels move and its launches,
// exactly what the GPU step's ledger counts for the layer (bench/gpu_ledger).
// The simulator prices a profile's `kernels` mode from these (plan/simulate.hpp).
// Only programs that price GPU steps include this header: it instantiates
// every leaf's passes on the guarded backend.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/guarded.hpp"
#include "whale/nn/layer.hpp"
#include "whale/nn/recompute.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/plan/describe.hpp"
#include "whale/strategy/split.hpp"

namespace whale {

namespace detail {
inline pass_kernels pass_of(const device_ledger& l) {
  pass_kernels p;
  p.gemm_flops = l.gemm_flops;
  p.gemms = l.gemms;
  p.attention_flops = l.batched_gemm_flops + l.attention_flops;
  p.attention_calls = l.batched_gemms + l.attention_calls;
  p.bytes = l.kernel_effective_bytes + static_cast<double>(l.copy_bytes + l.fill_bytes);
  p.launches = l.launches();
  p.host_waits = l.host_syncs + l.device_to_host;
  return p;
}

/// The passes of leaf U (a layer or a loss) on `rows` = batch × seq rows of
/// `in` features (`out` out), counted on a count-only guarded backend that
/// models the CUDA backend: fused attention, bias and GELU in the GEMMs'
/// epilogues, bf16 products under bf16.
template <class U> unit_kernels run_probe(index_t batch, index_t seq, index_t in, index_t out, bool bf16) {
  const index_t rows = batch * seq;
  if (rows < 1 || in < 1 || out < 1) throw std::invalid_argument("whale::probe: " + layer_name<U>() + ": no rows or no width");
  // address space only (it touches no page): 16 TiB, less where the process may not map that much
  std::optional<guarded_backend> made;
  for (int shift = 44; !made; shift -= 4) try {
      made.emplace(std::size_t{1} << shift, guarded_backend::counting);
    } catch (const std::runtime_error&) {
      if (shift <= 36) throw;
    }
  guarded_backend& g = *made;
  // the probe's buffers are not the process's: its memory figures come back as they were
  const auto stats = detail::global_memory_stats();
  g.set_fused_attention(true);
  g.set_fused_bias_grads(true);
  unit_kernels k;
  {
    const backend_ref be(g);
    const place_scope on(be.memory());
    U l;
    tensor<float> params({std::max<index_t>(1, l.param_count())}, mem_kind::params);
    tensor<float> grads({std::max<index_t>(1, l.param_count())}, mem_kind::grads);
    param_binder b(params.data(), grads.data(), l.param_count());
    l.bind(b);
    step_ctx c;
    c.be = be;
    c.batch = batch, c.seq = seq, c.global_rows = rows, c.bf16 = bf16;
    be.bf16_products(bf16);
    using X = typename U::input_type;
    tensor<X> x({rows, in});
    tensor<float> dy({rows, out});
    // token ids and labels have host copies, as a step's uploaded batch has (step_ctx::mirrors): no read back
    std::vector<std::int32_t> host_ids, host_labels;
    if constexpr (std::is_same_v<X, std::int32_t>) {
      host_ids.assign(static_cast<std::size_t>(x.numel()), 0);
      c.mirrors[0] = {x.data(), host_ids.data(), static_cast<std::size_t>(x.numel()) * sizeof(std::int32_t)};
    }
    // each pass runs once before it is counted, so that its buffers exist (a step's are
    // allocated once, in the first step: the ledger counts steady steps)
    if constexpr (Loss<U> && !Layer<U>) {
      constexpr index_t per_row = loss_target_width<U>();
      tensor<std::int32_t> labels({per_row == any_features ? rows * in : rows * per_row});
      host_labels.assign(static_cast<std::size_t>(labels.numel()), 0);
      tensor<double> loss_sum({1});  // the step's loss kept on the device, as the trainer keeps it: no read back
      c.loss_sum = loss_sum.data();
      c.mirrors[1] = {labels.data(), host_labels.data(), static_cast<std::size_t>(labels.numel()) * sizeof(std::int32_t)};
      for (int pass = 0; pass < 2; ++pass) {
        g.ledger().clear();
        (void)run_forward_loss(l, c, cview<X>(x), detail::label_bits(cview<std::int32_t>(labels)), 0);
        k.forward = pass_of(g.ledger());
        g.ledger().clear();
        (void)run_backward_loss(l, c, 0);
        k.backward = k.backward_input = pass_of(g.ledger());
      }
    } else {
      c.need_input_grad = !std::is_same_v<X, std::int32_t>;
      for (int pass = 0; pass < 2; ++pass) {
        g.ledger().clear();
        (void)run_forward(l, c, cview<X>(x), 0);
        k.forward = pass_of(g.ledger());
        g.ledger().clear();
        (void)run_backward(l, c, cview<float>(dy), 0);
        k.backward = pass_of(g.ledger());
      }
      // split schedules: d(input) now, the weight gradients in a W pass
      std::vector<weight_task> tasks;
      c.deferred = &tasks;
      for (int pass = 0; pass < 2; ++pass) {
        tasks.clear();
        (void)run_forward(l, c, cview<X>(x), 0);
        g.ledger().clear();
        (void)run_backward(l, c, cview<float>(dy), 0);
        k.backward_input = pass_of(g.ledger());
        g.ledger().clear();
        for (const auto& t : tasks) t.run(t.owner, t.be, t.slot, false);
        k.weight = pass_of(g.ledger());
      }
    }
    be.bf16_products(false);
  }
  detail::global_memory_stats() = stats;
  return k;
}
}  // namespace detail

/// The kernels of leaf L's passes (see the top of this file), remembered by
/// shape: a search prices the same layer at the same rows many times.
template <class L> unit_kernels probe_kernels(index_t batch, index_t seq, index_t in, index_t out, bool bf16) {
  using U = std::conditional_t<detail::is_split_loss<L>::value, softmax_cross_entropy, typename detail::unsplit_of<L>::type>;
  static std::mutex m;
  static std::map<std::tuple<index_t, index_t, index_t, index_t, bool>, unit_kernels> seen;
  const std::lock_guard hold(m);
  const auto key = std::make_tuple(batch, seq, in, out, bf16);
  if (const auto it = seen.find(key); it != seen.end()) return it->second;
  return seen[key] = detail::run_probe<U>(batch, seq, in, out, bf16);
}

namespace detail {
inline unit_kernels no_kernels(index_t, index_t, index_t, index_t, bool) { return {}; }
/// A repeat's block without its plan: recompute<B> and split<B> are B's kernels (a
/// split block's forms are priced at their share of B's, plan/simulate.hpp).
template <class B> struct dense_block { using type = B; };
template <class B> struct dense_block<recompute<B>> : dense_block<B> {};
template <class M, axis A, index_t D> struct dense_block<split<M, A, D>> : dense_block<M> {};
/// Whether T holds a split region's resolved forms (conversions, sharded layers):
/// such a block cannot run alone (its conversions need the plan's communicators).
template <class T> constexpr bool holds_split() {
  if constexpr (split_chain_like<T> || is_convert<T>::value || requires { typename T::chain_type; } ||
                requires { T::split_params; })
    return true;
  else if constexpr (requires { typename T::block_type; }) return holds_split<typename T::block_type>();
  else if constexpr (requires { typename T::inner_type; }) return holds_split<typename T::inner_type>();
  else if constexpr (requires { typename T::tuple_type; })
    return []<std::size_t... I>(std::index_sequence<I...>) {
      return (holds_split<std::tuple_element_t<I, typename T::tuple_type>>() || ...);
    }(std::make_index_sequence<std::tuple_size_v<typename T::tuple_type>>{});
  else
    return false;
}
inline pass_kernels minus(pass_kernels a, const pass_kernels& b) {
  a.gemm_flops -= b.gemm_flops, a.gemms -= b.gemms, a.attention_flops -= b.attention_flops;
  a.attention_calls -= b.attention_calls, a.bytes -= b.bytes, a.launches -= b.launches, a.host_waits -= b.host_waits;
  return a;
}
/// One block of a repeat of B as the repeat runs it, between two others: two
/// blocks less one (a block hands its residual sum to the next block's first pass).
template <class B> unit_kernels block_in_repeat(index_t batch, index_t seq, index_t in, index_t out, bool bf16) {
  const auto two = probe_kernels<repeat<2, B>>(batch, seq, in, out, bf16), one = probe_kernels<repeat<1, B>>(batch, seq, in, out, bf16);
  return {minus(two.forward, one.forward), minus(two.backward, one.backward), minus(two.backward_input, one.backward_input),
          minus(two.weight, one.weight)};
}
struct kernel_prober {
  template <class L> static constexpr kernel_probe of() {
    if constexpr (is_convert<L>::value) return nullptr;
    else return &probe_kernels<L>;
  }
  /// A layer that computes the next one (GELU) in its GEMM: the two as the sequential runs them.
  template <class A, class B> static constexpr kernel_probe fused() { return &probe_kernels<sequential<A, B>>; }
  /// The layer folded into the one before it: no kernels of its own.
  static constexpr kernel_probe folded() { return &no_kernels; }
  /// The repeat's block as a whole, as the network runs it: a recompute<B> or
  /// split<B> block as B. None for a block that holds a split region's resolved
  /// forms inside it: its layers are priced one at a time.
  template <class B> static constexpr kernel_probe block() {
    using D = typename dense_block<B>::type;
    if constexpr (holds_split<D>()) return nullptr;
    else return &block_in_repeat<D>;
  }
};
}  // namespace detail

/// describe<P>() with each leaf's kernel probe (unit_desc::kernels) set.
template <class P> model_desc describe_kernels() { return describe<P, detail::kernel_prober>(); }

}  // namespace whale
