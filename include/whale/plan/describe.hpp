// `describe<P>()`: the plan type P read into plain data, once, at compile
// time's end: the model's leaf layers in flat order (each one's sharded form,
// layouts, cost and parameters) and the strategies around them. The only
// template code of plan/; lowering (plan/lower.hpp) works on this data.
#pragma once

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "whale/nn/embedding.hpp"
#include "whale/nn/layer.hpp"
#include "whale/nn/recompute.hpp"
#include "whale/nn/tied_head.hpp"
#include "whale/plan/model_desc.hpp"
#include "whale/strategy/pipeline.hpp"
#include "whale/strategy/replicate.hpp"
#include "whale/strategy/schedule.hpp"
#include "whale/strategy/shard.hpp"
#include "whale/strategy/split.hpp"

namespace whale {

namespace detail {

template <class T> struct chain_axis;
template <axis A, layout_kind In, exit_kind E, layout_kind X, stream_kind M, class... L>
struct chain_axis<split_chain<A, In, E, X, M, L...>> {
  static constexpr int value = static_cast<int>(A);
};
template <class T> concept split_chain_like = requires { chain_axis<T>::value; };
template <class T> struct is_convert : std::false_type {};
template <axis A, layout_kind F, layout_kind T, layout_kind GF, layout_kind GT> struct is_convert<convert<A, F, T, GF, GT>> : std::true_type {};
template <class T> struct is_split_loss : std::false_type {};
template <axis A> struct is_split_loss<split_softmax_cross_entropy<A>> : std::true_type {};
template <class L> struct is_token_table : std::false_type {};
template <index_t V, index_t D> struct is_token_table<embedding<V, D>> : std::true_type {
  static constexpr index_t rows = V, cols = D;
};
template <class L> struct tied_dims {};
template <index_t V, index_t D> struct tied_dims<tied_head<V, D>> {
  static constexpr index_t rows = V, cols = D;
};
template <class L> struct unsplit_of { using type = L; };
template <class L> requires requires { typename L::unsplit_type; } struct unsplit_of<L> { using type = typename L::unsplit_type; };

/// describe<P>()'s default: no kernel probes (plan/probe.hpp sets them).
struct no_prober {
  template <class L> static constexpr kernel_probe of() { return nullptr; }
  template <class A, class B> static constexpr kernel_probe fused() { return nullptr; }
  static constexpr kernel_probe folded() { return nullptr; }
  template <class B> static constexpr kernel_probe block() { return nullptr; }
};

template <class Prober> struct describer {
  model_desc* d;
  int element = 0, depth = 0, block = -1, split_axis = -1, recompute_group = -1, recompute_groups = 0;
  layout_kind in = layout_kind::R;
  index_t width = any_features;

  template <class U> static std::vector<param_tensor> tensors_of() {
    const auto a = U::param_tensors();
    return {a.begin(), a.end()};
  }
  // Marks the last layer with parameters among the units from `first` as the branch's output.
  void add_container_bytes(std::size_t first, double per_row) {
    if (d->units.size() > first && per_row > 0) d->units.back().container_act_bytes += per_row;
  }
  void mark_residual_out(std::size_t first) {
    for (auto k = d->units.size(); k-- > first;)
      if (d->units[k].kind == unit_kind::layer && d->units[k].full_params > 0) {
        d->units[k].residual_out = true;
        return;
      }
  }

  template <class L> void leaf() {
    unit_desc u;
    u.name = layer_name<L>();
    u.unsplit = u.name;
    u.element = element;
    u.block = block;
    u.split_axis = split_axis;
    u.in = in;
    u.recompute_group = recompute_group;
    if constexpr (L::in_features != any_features) width = L::in_features;
    u.in_width = width;
    if constexpr (is_convert<L>::value) {
      u.kind = unit_kind::convert;
      u.fwd = L::fwd_coll;
      u.bwd = L::bwd_coll;
      u.from = L::from;
      u.to = L::to;
      u.grad_from = L::grad_from;
      u.grad_to = L::grad_to;
      u.split_axis = static_cast<int>(L::on_axis);
      u.in = L::from;
    } else {
      u.kind = Loss<L> && !Layer<L> ? unit_kind::loss : unit_kind::layer;
      if constexpr (Loss<L> && !Layer<L>) {
        constexpr index_t tw = loss_target_width<L>();
        u.labels_per_row = tw != any_features ? tw : (width != any_features ? width : 1);
      }
      u.cost = L::cost().scaled(width == any_features ? 0.0 : static_cast<double>(width));
      u.full_params = L::cost().params;
      if constexpr (requires { L::split_params; }) {
        u.sharded = true;
        u.split_params = L::split_params;
        u.replicated_params = L::replicated_params;
        if constexpr (requires { L::shard_cost(index_t{1}); }) u.shard_cost = &L::shard_cost;
        if constexpr (requires { typename L::unsplit_type; }) u.unsplit = layer_name<typename L::unsplit_type>();
        if constexpr (requires(std::vector<param_run>& v) { L::param_runs(0, 1, v); }) u.runs = &L::param_runs;
        if constexpr (requires { L::split_extent; }) u.split_extent = L::split_extent;
      }
      using unsplit = typename unsplit_of<L>::type;
      if constexpr (requires { unsplit::param_tensors(); }) u.tensors = &tensors_of<unsplit>;
      if constexpr (requires { unsplit::param_tensors(); })
        for (const auto& t : unsplit::param_tensors())
          if (t.role == param_role::weight) u.widest_weight = std::max(u.widest_weight, t.count);
      u.split_loss = is_split_loss<L>::value;
      u.token_table = is_token_table<unsplit>::value;
      if constexpr (is_token_table<unsplit>::value) u.table_rows = is_token_table<unsplit>::rows, u.table_cols = is_token_table<unsplit>::cols;
      if constexpr (ties_token_table<L>) {
        u.table_rows = tied_dims<unsplit>::rows, u.table_cols = tied_dims<unsplit>::cols;
        const std::string table = "embedding<" + std::to_string(u.table_rows) + ", " + std::to_string(u.table_cols) + ">";
        for (auto k = d->units.size(); k-- > 0;)
          if (d->units[k].token_table && d->units[k].table_rows == u.table_rows && d->units[k].table_cols == u.table_cols) {
            u.ties_to = static_cast<int>(k);
            break;
          }
        if (u.ties_to < 0)
          throw std::invalid_argument("whale: " + u.unsplit + " ties its weight to the token table, but no " + table +
                                      " comes before it in the model");
        for (const auto& other : d->units)
          if (other.ties_to == u.ties_to)
            throw std::invalid_argument("whale: " + u.unsplit + " ties its weight to the " + table + " that " + other.unsplit +
                                        " before it is tied to already; tie one head to a table");
      }
      u.defers = recompute_group < 0 && requires(L& l, const backend_ref& be) { l.weight_grads(be, 0, false); };
    }
    if constexpr (requires { L::out_features; })
      if constexpr (L::out_features != any_features) width = L::out_features;
    u.out_width = width;
    u.kernels = Prober::template of<L>();
    d->full_params += u.full_params;
    d->units.push_back(std::move(u));
  }

  template <class T> void walk() {
    if constexpr (is_replicate_v<T>) {
      d->replicated = true;
      walk<typename T::inner>();
    } else if constexpr (is_shard_v<T>) {
      d->zero_level = T::level;
      d->replicated = true;
      walk<strip_replicate_t<typename T::inner>>();
    } else if constexpr (requires { T::is_split; typename T::region; }) {
      const int saved = split_axis;
      const layout_kind saved_in = in;
      walk<typename T::region>();
      split_axis = saved, in = saved_in;
    } else if constexpr (split_chain_like<T>) {
      const int saved = split_axis;
      split_axis = chain_axis<T>::value;
      (static_cast<int>(axis::data) == split_axis ? d->splits_data : d->splits_model) = true;
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        ((in = T::in_layout[I], item<std::tuple_element_t<I, typename T::tuple_type>>()), ...);
      }(std::make_index_sequence<T::size>{});
      split_axis = saved;
    } else if constexpr (requires { typename T::chain_type; }) {  // split_residual
      const auto first = d->units.size();
      walk<typename T::chain_type>();
      mark_residual_out(first);
      add_container_bytes(first, T::in_features == any_features ? 8.0 * static_cast<double>(width) : 8.0 * static_cast<double>(T::in_features));
    } else if constexpr (requires { typename T::block_type; T::count; }) {  // repeat
      const int saved = block;
      const bool top = depth == 1;
      ++depth;
      for (std::size_t k = 0; k < T::count; ++k) {
        if (top) block = static_cast<int>(k);
        walk<typename T::block_type>();
      }
      --depth;
      block = saved;
    } else if constexpr (is_recompute_v<T>) {
      const int saved = recompute_group;
      recompute_group = recompute_groups++;
      walk<typename T::block_type>();
      recompute_group = saved;
    } else if constexpr (requires { typename T::inner_type; }) {  // residual
      const auto first = d->units.size();
      walk<typename T::inner_type>();
      mark_residual_out(first);
      add_container_bytes(first, T::in_features == any_features ? 8.0 * static_cast<double>(width) : 8.0 * static_cast<double>(T::in_features));
    } else if constexpr (requires { typename T::tuple_type; }) {  // sequential (and flat pipelines)
      const bool top = depth == 0;
      ++depth;
      [&]<std::size_t... I>(std::index_sequence<I...>) {
        ((top ? (element = static_cast<int>(I), 0) : 0, walk<std::tuple_element_t<I, typename T::tuple_type>>(),
          fused_gelu<typename T::tuple_type, I>()),
         ...);
      }(std::make_index_sequence<std::tuple_size_v<typename T::tuple_type>>{});
      --depth;
    } else {
      if (depth == 0) ++depth;  // a single leaf as the whole model
      leaf<T>();
    }
  }
  /// Element I of a sequential just walked: where it is a gelu after a layer that computes GELU in its
  /// GEMM (fuses_gelu; sequential::cost), the gelu keeps nothing and that layer keeps GELU's output.
  template <class Tuple, std::size_t I> void fused_gelu() {
    if constexpr (I > 0) {
      using A = std::tuple_element_t<I - 1, Tuple>;
      if constexpr (fuses_gelu<A>() && is_gelu<std::tuple_element_t<I, Tuple>>())
        if (d->units.size() >= 2) {
          d->units.back().fused_act_bytes = -d->units.back().cost.act_bytes;
          d->units[d->units.size() - 2].fused_act_bytes = 4.0 * static_cast<double>(A::out_features);
          // its kernels: the pair's, as the sequential runs it (GELU in the GEMM's epilogue); the gelu's: none
          d->units[d->units.size() - 2].kernels = Prober::template fused<A, std::tuple_element_t<I, Tuple>>();
          d->units.back().kernels = Prober::folded();
        }
    }
  }
  template <class T> void item() {
    if constexpr (split_chain_like<T> || requires { typename T::chain_type; } ||
                  requires { typename T::block_type; } || requires { typename T::tuple_type; })
      walk<T>();
    else
      leaf<T>();
  }
};

template <class Tuple, class Prober> void describe_elements(model_desc& d) {
  using E = tuple_types<Tuple>;
  d.elements = static_cast<int>(E::n);
  d.element_width.assign(E::in_width.begin(), E::in_width.end());
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (d.element_cost.push_back(std::tuple_element_t<I, Tuple>::cost()), ...);
  }(std::make_index_sequence<E::n>{});
  if constexpr (E::repeat_count == 1) {
    using R = std::tuple_element_t<E::repeat_index, Tuple>;
    d.repeat_element = static_cast<int>(E::repeat_index);
    d.repeat_count = static_cast<int>(R::count);
    d.block_cost = R::block_type::cost();
    d.block_kernels = Prober::template block<typename R::block_type>();
  }
}

template <class P, class Prober> void describe_into(model_desc& d) {
  if constexpr (is_shard_v<P>) {
    d.zero_level = P::level;
    d.replicated = true;
    describe_into<strip_replicate_t<typename P::inner>, Prober>(d);
  } else if constexpr (is_replicate_v<P>) {
    d.replicated = true;
    describe_into<typename P::inner, Prober>(d);
  } else if constexpr (is_pipeline_v<P>) {
    d.pipeline = true;
    d.explicit_stages = P::explicit_stages;
    d.fixed_stages = P::fixed_stages;
    d.schedule = P::schedule::name();
    d.split_backward = splits_backward_v<typename P::schedule>;
    d.chunks = chunks_v<typename P::schedule>;
    d.actions = &P::schedule::actions;
    describe_elements<typename P::flat::tuple_type, Prober>(d);
    describer<Prober> w{&d};
    w.template walk<typename P::flat>();
  } else {
    if constexpr (requires { typename strip_replicate_t<P>::tuple_type; })
      describe_elements<typename strip_replicate_t<P>::tuple_type, Prober>(d);
    describer<Prober> w{&d};
    w.template walk<P>();
  }
}

}  // namespace detail

/// The plan type P as data (no MPI, no allocation of model tensors).
/// Prober: what sets each leaf's kernel probe (describe_kernels, plan/probe.hpp).
template <class P, class Prober = detail::no_prober> model_desc describe() {
  model_desc d;
  d.name = layer_name<P>();
  d.tokens = std::is_same_v<typename P::input_type, std::int32_t>;
  detail::describe_into<P, Prober>(d);
  if (d.elements == 0) d.elements = 1;
  // a conversion at a region's entry learns its width from the layer after it
  for (std::size_t i = d.units.size(); i-- > 0;) {
    auto& u = d.units[i];
    if (u.kind == unit_kind::convert && u.in_width == any_features && i + 1 < d.units.size())
      u.in_width = u.out_width = d.units[i + 1].in_width;
  }
  return d;
}

}  // namespace whale
