// The typed collectives: function objects over any Communicator that take
// views or tensors, check element counts and memory spaces, and call the
// communicator's type-erased core. Blocking: all_reduce, ...; non-blocking
// (returning the communicator's request): iall_reduce, .... No transport here.
#pragma once

#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "whale/comm/communicator.hpp"

namespace whale {

namespace detail {
template <class T, class S> view<T, S> as_view(const view<T, S>& v) noexcept { return v; }
template <class T, class S> view<T, S> as_view(const tensor<T, S>& t) noexcept { return t.v(); }
template <class X>
concept viewable = requires(const X& x) { detail::as_view(x); };
template <class X> using view_of = decltype(detail::as_view(std::declval<const std::remove_cvref_t<X>&>()));
template <class X> using elem_of = std::remove_const_t<typename view_of<X>::value_type>;
template <class C, class X>
inline constexpr bool same_space = std::is_same_v<typename C::space, typename view_of<X>::space>;
template <class X>
inline constexpr bool is_mutable = !std::is_const_v<typename view_of<X>::value_type>;

template <bool Async, class R> auto finish(R&& r) {
  if constexpr (Async) return std::forward<R>(r);
  else r.wait();
}

[[noreturn]] inline void count_error(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string("whale::") + op + ": " + what);
}
inline index_t total(std::span<const index_t> counts) {
  return std::accumulate(counts.begin(), counts.end(), index_t{0});
}
template <class C>
void check_counts(const char* op, const C& c, std::span<const index_t> counts) {
  if (static_cast<int>(counts.size()) != c.size())
    count_error(op, "counts has " + std::to_string(counts.size()) + " entries but communicator '" +
                        std::string(c.name()) + "' has " + std::to_string(c.size()) +
                        " ranks; give one count per rank");
  for (auto n : counts)
    if (n < 0) count_error(op, "negative count " + std::to_string(n));
}
}  // namespace detail

/// Counts that split `n` elements over `p` ranks as evenly as possible (the
/// first n % p ranks get one more), for all_gather_v / reduce_scatter_v.
inline std::vector<index_t> block_counts(index_t n, int p) {
  std::vector<index_t> c(static_cast<std::size_t>(p), p ? n / p : 0);
  for (index_t i = 0; i < (p ? n % p : 0); ++i) ++c[static_cast<std::size_t>(i)];
  return c;
}

#define WHALE_COMM_SPACE_MSG(op)                                                            \
  "whale::" op ": the tensor's memory space differs from the communicator's (mpi_comm and " \
  "local_comm work on host tensors, nccl_comm on cuda tensors); use the communicator of "   \
  "the tensor's space"

/// all_reduce(comm, buf, op = sum): every rank's `buf` becomes the reduction of
/// all ranks' `buf`, in place (MPI_IN_PLACE, no copy).
template <bool Async> struct all_reduce_fn {
  template <Communicator C, detail::viewable B>
  auto operator()(C& c, const B& buf, reduce_op op = reduce_op::sum) const {
    static_assert(detail::same_space<C, B>, WHALE_COMM_SPACE_MSG("all_reduce"));
    static_assert(detail::is_mutable<B>, "whale::all_reduce: reduces in place; pass a mutable view or tensor");
    auto v = detail::as_view(buf);
    constexpr dtype tp = dtype_of<detail::elem_of<B>>();
    if constexpr (!Async && requires { c.all_reduce(v.data(), v.numel(), tp, op); })
      c.all_reduce(v.data(), v.numel(), tp, op);
    else
      return detail::finish<Async>(c.iall_reduce(v.data(), v.numel(), tp, op));
  }
};

/// all_gather(comm, in, out): `out` (size() × in.numel()) receives every rank's
/// `in` in rank order. In place when `in` is the rank's own block of `out`.
template <bool Async> struct all_gather_fn {
  template <Communicator C, detail::viewable I, detail::viewable O>
  auto operator()(C& c, const I& in, const O& out) const {
    static_assert(detail::same_space<C, I> && detail::same_space<C, O>, WHALE_COMM_SPACE_MSG("all_gather"));
    static_assert(detail::is_mutable<O>, "whale::all_gather: the output must be mutable");
    static_assert(std::is_same_v<detail::elem_of<I>, detail::elem_of<O>>,
                  "whale::all_gather: input and output element types differ; gather into a tensor of the input's type");
    auto i = detail::as_view(in);
    auto o = detail::as_view(out);
    if (o.numel() != i.numel() * c.size())
      detail::count_error("all_gather", "the output holds " + std::to_string(o.numel()) +
                                            " elements but communicator '" + std::string(c.name()) +
                                            "' gathers " + std::to_string(c.size()) + " × " +
                                            std::to_string(i.numel()) +
                                            "; size the output to size() × input (or use all_gather_v)");
    constexpr dtype tp = dtype_of<detail::elem_of<I>>();
    if constexpr (!Async && requires { c.all_gather(i.data(), o.data(), i.numel(), tp); })
      c.all_gather(i.data(), o.data(), i.numel(), tp);
    else
      return detail::finish<Async>(c.iall_gather(i.data(), o.data(), i.numel(), tp));
  }
};

/// all_gather_v(comm, in, out, counts): rank r contributes counts[r] elements;
/// `out` holds their sum, in rank order.
template <bool Async> struct all_gather_v_fn {
  template <Communicator C, detail::viewable I, detail::viewable O>
  auto operator()(C& c, const I& in, const O& out, std::span<const index_t> counts) const {
    static_assert(detail::same_space<C, I> && detail::same_space<C, O>, WHALE_COMM_SPACE_MSG("all_gather_v"));
    static_assert(detail::is_mutable<O>, "whale::all_gather_v: the output must be mutable");
    static_assert(std::is_same_v<detail::elem_of<I>, detail::elem_of<O>>,
                  "whale::all_gather_v: input and output element types differ");
    auto i = detail::as_view(in);
    auto o = detail::as_view(out);
    detail::check_counts("all_gather_v", c, counts);
    if (i.numel() != counts[static_cast<std::size_t>(c.rank())] || o.numel() != detail::total(counts))
      detail::count_error("all_gather_v", "rank " + std::to_string(c.rank()) + " passes " +
                                              std::to_string(i.numel()) + " input / " +
                                              std::to_string(o.numel()) + " output elements but counts say " +
                                              std::to_string(counts[static_cast<std::size_t>(c.rank())]) + " / " +
                                              std::to_string(detail::total(counts)));
    constexpr dtype tp = dtype_of<detail::elem_of<I>>();
    if constexpr (!Async && requires { c.all_gather_v(i.data(), o.data(), counts, tp); })
      c.all_gather_v(i.data(), o.data(), counts, tp);
    else
      return detail::finish<Async>(c.iall_gather_v(i.data(), o.data(), counts, tp));
  }
};

/// reduce_scatter(comm, in, out, op = sum): `in` (size() × out.numel()) is
/// reduced over ranks and rank r keeps block r in `out`. In place when `out`
/// starts at `in` (the result then lands in the first block of `in`).
template <bool Async> struct reduce_scatter_fn {
  template <Communicator C, detail::viewable I, detail::viewable O>
  auto operator()(C& c, const I& in, const O& out, reduce_op op = reduce_op::sum) const {
    static_assert(detail::same_space<C, I> && detail::same_space<C, O>, WHALE_COMM_SPACE_MSG("reduce_scatter"));
    static_assert(detail::is_mutable<O>, "whale::reduce_scatter: the output must be mutable");
    static_assert(std::is_same_v<detail::elem_of<I>, detail::elem_of<O>>,
                  "whale::reduce_scatter: input and output element types differ");
    auto i = detail::as_view(in);
    auto o = detail::as_view(out);
    if (i.numel() != o.numel() * c.size())
      detail::count_error("reduce_scatter", "the input holds " + std::to_string(i.numel()) +
                                                " elements but communicator '" + std::string(c.name()) +
                                                "' scatters " + std::to_string(c.size()) + " × " +
                                                std::to_string(o.numel()) +
                                                "; size the input to size() × output (or use reduce_scatter_v)");
    constexpr dtype tp = dtype_of<detail::elem_of<I>>();
    if constexpr (!Async && requires { c.reduce_scatter(i.data(), o.data(), o.numel(), tp, op); })
      c.reduce_scatter(i.data(), o.data(), o.numel(), tp, op);
    else
      return detail::finish<Async>(c.ireduce_scatter(i.data(), o.data(), o.numel(), tp, op));
  }
};

/// reduce_scatter_v(comm, in, out, counts, op = sum): `in` holds sum(counts);
/// rank r keeps the reduced block r of counts[r] elements.
template <bool Async> struct reduce_scatter_v_fn {
  template <Communicator C, detail::viewable I, detail::viewable O>
  auto operator()(C& c, const I& in, const O& out, std::span<const index_t> counts,
                  reduce_op op = reduce_op::sum) const {
    static_assert(detail::same_space<C, I> && detail::same_space<C, O>, WHALE_COMM_SPACE_MSG("reduce_scatter_v"));
    static_assert(detail::is_mutable<O>, "whale::reduce_scatter_v: the output must be mutable");
    static_assert(std::is_same_v<detail::elem_of<I>, detail::elem_of<O>>,
                  "whale::reduce_scatter_v: input and output element types differ");
    auto i = detail::as_view(in);
    auto o = detail::as_view(out);
    detail::check_counts("reduce_scatter_v", c, counts);
    if (o.numel() != counts[static_cast<std::size_t>(c.rank())] || i.numel() != detail::total(counts))
      detail::count_error("reduce_scatter_v", "rank " + std::to_string(c.rank()) + " passes " +
                                                  std::to_string(i.numel()) + " input / " +
                                                  std::to_string(o.numel()) + " output elements but counts say " +
                                                  std::to_string(detail::total(counts)) + " / " +
                                                  std::to_string(counts[static_cast<std::size_t>(c.rank())]));
    constexpr dtype tp = dtype_of<detail::elem_of<I>>();
    if constexpr (!Async && requires { c.reduce_scatter_v(i.data(), o.data(), counts, tp, op); })
      c.reduce_scatter_v(i.data(), o.data(), counts, tp, op);
    else
      return detail::finish<Async>(c.ireduce_scatter_v(i.data(), o.data(), counts, tp, op));
  }
};

/// broadcast(comm, buf, root): every rank's `buf` becomes root's.
template <bool Async> struct broadcast_fn {
  template <Communicator C, detail::viewable B>
  auto operator()(C& c, const B& buf, int root) const {
    static_assert(detail::same_space<C, B>, WHALE_COMM_SPACE_MSG("broadcast"));
    static_assert(detail::is_mutable<B>, "whale::broadcast: the buffer must be mutable (it is overwritten on non-roots)");
    auto v = detail::as_view(buf);
    constexpr dtype tp = dtype_of<detail::elem_of<B>>();
    if constexpr (!Async && requires { c.broadcast(v.data(), v.numel(), tp, root); })
      c.broadcast(v.data(), v.numel(), tp, root);
    else
      return detail::finish<Async>(c.ibroadcast(v.data(), v.numel(), tp, root));
  }
};

/// send(comm, buf, dst, tag = 0) / recv(comm, buf, src, tag = 0): point to point.
template <bool Async> struct send_fn {
  template <Communicator C, detail::viewable B>
  auto operator()(C& c, const B& buf, int dst, int tag = 0) const {
    static_assert(detail::same_space<C, B>, WHALE_COMM_SPACE_MSG("send"));
    auto v = detail::as_view(buf);
    constexpr dtype tp = dtype_of<detail::elem_of<B>>();
    if constexpr (!Async && requires { c.send(v.data(), v.numel(), tp, dst, tag); })
      c.send(v.data(), v.numel(), tp, dst, tag);
    else
      return detail::finish<Async>(c.isend(v.data(), v.numel(), tp, dst, tag));
  }
};
template <bool Async> struct recv_fn {
  template <Communicator C, detail::viewable B>
  auto operator()(C& c, const B& buf, int src, int tag = 0) const {
    static_assert(detail::same_space<C, B>, WHALE_COMM_SPACE_MSG("recv"));
    static_assert(detail::is_mutable<B>, "whale::recv: the buffer must be mutable");
    auto v = detail::as_view(buf);
    constexpr dtype tp = dtype_of<detail::elem_of<B>>();
    if constexpr (!Async && requires { c.recv(v.data(), v.numel(), tp, src, tag); })
      c.recv(v.data(), v.numel(), tp, src, tag);
    else
      return detail::finish<Async>(c.irecv(v.data(), v.numel(), tp, src, tag));
  }
};

/// barrier(comm): returns once every rank of `comm` has entered it.
template <bool Async> struct barrier_fn {
  template <Communicator C> auto operator()(C& c) const { if constexpr (!Async && requires { c.barrier(); })
      c.barrier();
    else
      return detail::finish<Async>(c.ibarrier()); }
};

#undef WHALE_COMM_SPACE_MSG

inline constexpr all_reduce_fn<false> all_reduce{};
inline constexpr all_gather_fn<false> all_gather{};
inline constexpr all_gather_v_fn<false> all_gather_v{};
inline constexpr reduce_scatter_fn<false> reduce_scatter{};
inline constexpr reduce_scatter_v_fn<false> reduce_scatter_v{};
inline constexpr broadcast_fn<false> broadcast{};
inline constexpr send_fn<false> send{};
inline constexpr recv_fn<false> recv{};
inline constexpr barrier_fn<false> barrier{};

inline constexpr all_reduce_fn<true> iall_reduce{};
inline constexpr all_gather_fn<true> iall_gather{};
inline constexpr all_gather_v_fn<true> iall_gather_v{};
inline constexpr reduce_scatter_fn<true> ireduce_scatter{};
inline constexpr reduce_scatter_v_fn<true> ireduce_scatter_v{};
inline constexpr broadcast_fn<true> ibroadcast{};
inline constexpr send_fn<true> isend{};
inline constexpr recv_fn<true> irecv{};
inline constexpr barrier_fn<true> ibarrier{};

}  // namespace whale
