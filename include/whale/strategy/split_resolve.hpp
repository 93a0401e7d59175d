// The compile-time layout resolution of a split region (strategy/split.hpp): how each
// element becomes its sharded form for the layout it receives (`xform`), and the chain
// with its converters (`build`). Not split_chain, split_residual, split or the tags.
#pragma once

#include <cstddef>
#include <type_traits>

#include "whale/nn/causal_self_attention.hpp"
#include "whale/nn/embedding.hpp"
#include "whale/nn/gelu.hpp"
#include "whale/nn/layer.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/recompute.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/residual.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/rotary_attention.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/nn/swiglu_mlp.hpp"
#include "whale/nn/tied_head.hpp"
#include "whale/strategy/layout.hpp"
#include "whale/strategy/split_layers.hpp"

namespace whale {

/// The canonical layout of activations between strategies along an axis.
constexpr layout_kind canonical(axis a) { return a == axis::data ? layout_kind::S0 : layout_kind::R; }
/// The layout of the gradient of an activation of layout l: a partial sum's
/// gradient is the whole gradient, on every rank.
constexpr layout_kind grad_of(layout_kind l) { return l == layout_kind::P ? layout_kind::R : l; }

template <class L> struct column_tag;
template <class L> struct row_tag;

namespace detail {

template <class... T> struct tlist {};
template <class... L> tlist<L...> elements_probe(const sequential<L...>*);
template <class M>
concept sequential_like = requires { detail::elements_probe(static_cast<const M*>(nullptr)); };
template <class M> using elements_of = decltype(detail::elements_probe(static_cast<const M*>(nullptr)));

template <class M> struct is_residual : std::false_type {};
template <class... I> struct is_residual<residual<I...>> : std::true_type {};
template <class M> struct is_repeat : std::false_type {};
template <std::size_t N, class B> struct is_repeat<repeat<N, B>> : std::true_type {};
template <class M> struct is_linear : std::false_type {};
template <index_t I, index_t O, bias_mode B> struct is_linear<linear<I, O, B>> : std::true_type {};
template <class M> struct is_embedding : std::false_type {};
template <index_t V, index_t D> struct is_embedding<embedding<V, D>> : std::true_type {};

enum class exit_kind { natural, forced };
enum class stream_kind { flatten, single };

}  // namespace detail

template <axis A, layout_kind In, detail::exit_kind Exit, layout_kind ExitLay, detail::stream_kind Mode, class... E>
class split_chain;
template <axis A, layout_kind X, class... Inner> class split_residual;

namespace detail {

/// How element E becomes sharded along axis A when it receives layout X:
/// `need` (the layout it takes; a converter is inserted if X differs), `out`,
/// `gin` (layout of the input gradient it emits), `gout` (layout of the output
/// gradient it expects), `type` (its sharded form).
template <axis A, layout_kind X, class E, class = void>
struct xform {  // a row-wise layer: works on replicated features, any batch layout
  static constexpr layout_kind need = (X == layout_kind::S0) ? layout_kind::S0 : layout_kind::R;
  static constexpr layout_kind out = need, gin = need, gout = need;
  using type = E;
};
template <class> inline constexpr bool recompute_in_split = false;
template <axis A, layout_kind X, class B>
struct xform<A, X, recompute<B>> {  // refused: it would run unsplit, and mean another plan
  static_assert(recompute_in_split<B>,
                "whale::split: recompute<...> inside a split region is not supported: its layers would run "
                "unsplit (and, over the data axis, their whole gradients would be summed again); recompute the "
                "whole region instead: recompute<split<Block>> (e.g. repeat<N, recompute<split<Block>>>)");
  static constexpr layout_kind need = X, out = X, gin = X, gout = X;
  using type = recompute<B>;
};
template <axis A, layout_kind X, class E>
  requires(std::is_same_v<E, relu> || std::is_same_v<E, gelu>)
struct xform<A, X, E> {  // elementwise: keeps any layout but partial
  static constexpr layout_kind need = X == layout_kind::P ? layout_kind::R : X;
  static constexpr layout_kind out = need, gin = need, gout = need;
  using type = E;
};
template <axis A, layout_kind X, index_t I, index_t O, bias_mode B>
struct xform<A, X, linear<I, O, B>> {
  static constexpr bool row = X == layout_kind::S1;
  static constexpr layout_kind need = row ? layout_kind::S1 : layout_kind::R;
  static constexpr layout_kind out = row ? layout_kind::P : layout_kind::S1;
  static constexpr layout_kind gin = row ? layout_kind::S1 : layout_kind::P;
  static constexpr layout_kind gout = row ? layout_kind::R : layout_kind::S1;
  using type = std::conditional_t<row, row_linear<I, O, A, B>, column_linear<I, O, A, B>>;
};
template <axis A, layout_kind X, index_t V, index_t D>
struct xform<A, X, tied_head<V, D>> {  // by vocabulary, as the table it is tied to (replicated in)
  static constexpr layout_kind need = layout_kind::R, out = layout_kind::S1, gin = layout_kind::P, gout = layout_kind::S1;
  using type = tied_column_head<V, D, A>;
};
template <axis A, layout_kind X, index_t I, index_t O, bias_mode B>
struct xform<A, X, column_tag<linear<I, O, B>>> {  // forced column-parallel: replicated in
  static constexpr layout_kind need = layout_kind::R, out = layout_kind::S1, gin = layout_kind::P, gout = layout_kind::S1;
  using type = column_linear<I, O, A, B>;
};
template <axis A, layout_kind X, index_t I, index_t O, bias_mode B>
struct xform<A, X, row_tag<linear<I, O, B>>> {  // forced row-parallel: features split in
  static constexpr layout_kind need = layout_kind::S1, out = layout_kind::P, gin = layout_kind::S1, gout = layout_kind::R;
  using type = row_linear<I, O, A, B>;
};
template <axis A, layout_kind X>
struct xform<A, X, softmax_cross_entropy> {
  static constexpr bool split = X == layout_kind::S1;
  static constexpr layout_kind need = split ? layout_kind::S1 : (X == layout_kind::S0 ? layout_kind::S0 : layout_kind::R);
  static constexpr layout_kind out = need, gin = need, gout = need;
  using type = std::conditional_t<split, split_softmax_cross_entropy<A>, softmax_cross_entropy>;
};
template <axis A, layout_kind X, index_t V, index_t D>
  requires(A == axis::model)
struct xform<A, X, embedding<V, D>> {  // tokens are replicated over the model axis
  static constexpr layout_kind need = layout_kind::R, out = layout_kind::P, gin = layout_kind::R, gout = layout_kind::R;
  using type = vocab_embedding<V, D, A>;
};
template <axis A, layout_kind X, index_t D, index_t H>
  requires(A == axis::model)
struct xform<A, X, causal_self_attention<D, H>> {  // split by heads (Megatron)
  static constexpr layout_kind need = layout_kind::R, out = layout_kind::P, gin = layout_kind::P, gout = layout_kind::R;
  using type = head_attention<D, H, A>;
};
template <axis A, layout_kind X, index_t D, index_t H, index_t KV, float Th>
  requires(A == axis::model)
struct xform<A, X, rotary_attention<D, H, KV, Th>> {  // split by key/value groups (each rank: its KV heads and their queries)
  static constexpr layout_kind need = layout_kind::R, out = layout_kind::P, gin = layout_kind::P, gout = layout_kind::R;
  using type = head_rotary_attention<D, H, KV, Th, A>;
};
template <axis A, layout_kind X, index_t D, index_t H>
  requires(A == axis::model)
struct xform<A, X, swiglu_mlp<D, H>> {  // split by hidden features (Megatron: gate and up by columns, down by rows)
  static constexpr layout_kind need = layout_kind::R, out = layout_kind::P, gin = layout_kind::P, gout = layout_kind::R;
  using type = hidden_swiglu_mlp<D, H, A>;
};
template <axis A, layout_kind X, class... I>
struct xform<A, X, residual<I...>> {
  static constexpr layout_kind need = (X == layout_kind::S0) ? layout_kind::S0 : layout_kind::R;
  static constexpr layout_kind out = need, gin = need, gout = need;
  using type = split_residual<A, need, I...>;
};
template <class Chain> struct repeat_of;
template <axis A, layout_kind X, std::size_t N, class B>
struct xform<A, X, repeat<N, B>> {
  static constexpr layout_kind need = (X == layout_kind::S0) ? layout_kind::S0 : layout_kind::R;
  static constexpr layout_kind out = need, gin = need, gout = need;
  template <class... L> static auto chain_of(tlist<L...>) -> split_chain<A, need, exit_kind::forced, need, stream_kind::flatten, L...>;
  template <class Blk> static auto block_of() {
    if constexpr (sequential_like<Blk>) return decltype(chain_of(elements_of<Blk>{})){};
    else return split_chain<A, need, exit_kind::forced, need, stream_kind::single, Blk>{};
  }
  using type = repeat<N, decltype(block_of<B>())>;
};
template <axis A, layout_kind X, class E>
  requires(sequential_like<E> && !is_residual<E>::value)
struct xform<A, X, E> {  // a nested sequential (e.g. transformer_block): its own chain
  template <class... L> static auto chain_of(tlist<L...>) -> split_chain<A, X, exit_kind::natural, X, stream_kind::flatten, L...>;
  using type = decltype(chain_of(elements_of<E>{}));
  static constexpr layout_kind need = X;
  static constexpr layout_kind out = type::out_layout, gin = grad_of(X), gout = type::gout_layout;
};

// ---- building the chain: elements interleaved with converters ----
/// An item of a chain: its type, the index of the original element it comes
/// from (-1 for an inserted converter) and the layout it receives.
template <class T, std::size_t J, layout_kind InLay> struct indexed {
  using type = T;
  static constexpr std::size_t index = J;
  static constexpr layout_kind in = InLay;
};
inline constexpr std::size_t inserted = std::size_t(-1);

template <class Done, axis A, layout_kind Cur, layout_kind GCur, class Prev, std::size_t I, class... Rest> struct build;
template <class... Done, axis A, layout_kind Cur, layout_kind GCur, class Prev, std::size_t I>
struct build<tlist<Done...>, A, Cur, GCur, Prev, I> {
  using items = tlist<Done...>;
  static constexpr layout_kind out = Cur, gout = GCur;
};
template <class... Done, axis A, layout_kind Cur, layout_kind GCur, class Prev, std::size_t I, class E, class... Rest>
struct build<tlist<Done...>, A, Cur, GCur, Prev, I, E, Rest...> {
  using X = xform<A, Cur, E>;
  static_assert(show_conflicting_layouts<Prev, E, A, Cur, X::need>::value);
  static_assert(conversion(X::gin, GCur) != conv_op::impossible,
                "whale::split: the gradient layout a layer emits cannot be converted into the one the layer "
                "before it expects");
  using conv = std::conditional_t<(X::need == Cur && X::gin == GCur), tlist<>,
                                  tlist<indexed<convert<A, Cur, X::need, X::gin, GCur>, inserted, Cur>>>;
  template <class... C> static auto join(tlist<C...>) -> tlist<Done..., C..., indexed<typename X::type, I, X::need>>;
  using next = build<decltype(join(conv{})), A, X::out, X::gout, E, I + 1, Rest...>;
  using items = typename next::items;
  static constexpr layout_kind out = next::out, gout = next::gout;
};

}  // namespace detail

}  // namespace whale
