// `replicate<M>`: data parallelism. The wrapped part keeps its parameters on
// every rank of the `data` axis; the batch is split over that axis and the
// parameter gradients are summed (all-reduced in buckets during backward).
// The runtime that does this is strategy/data_parallel.hpp; this is the type.
#pragma once

#include <string>
#include <type_traits>

#include "whale/nn/layer.hpp"

namespace whale {

/// Data-parallel wrapper. Behaves exactly as M (same parameters, same
/// initialisation); the plan built by `make` splits the batch and sums gradients.
///
/// Law: replicate<replicate<M>> is replicate<M> — nesting multiplies the data
/// degree, and with one `data` mesh axis the product is that axis' size, so
/// the nested form trains exactly as the flat one (tested).
template <class M>
struct replicate : M {
  static_assert(Layer<M> || Loss<M>,
                "whale::replicate: the wrapped type must be a Layer or a Loss (e.g. a sequential)");
  using inner = M;
  static std::string name() { return "replicate<" + layer_name<M>() + ">"; }
};

template <class T> struct is_replicate : std::false_type {};
template <class M> struct is_replicate<replicate<M>> : std::true_type {};
template <class T> inline constexpr bool is_replicate_v = is_replicate<T>::value;

namespace detail {
template <class T> struct strip_replicate { using type = T; };
template <class M> struct strip_replicate<replicate<M>> : strip_replicate<M> {};
}  // namespace detail
/// M with every outer `replicate` removed.
template <class T> using strip_replicate_t = typename detail::strip_replicate<T>::type;

}  // namespace whale
