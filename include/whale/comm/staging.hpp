// Collectives over buffers in a device backend's memory, staged through the
// host: the communicators take host memory, so the input is copied down and
// the result copied up around a blocking collective. One helper for every
// blocking collective of the runtime and the split regions; a device's own
// communicator (NCCL) would take the buffers directly.
#pragma once

#include <cstddef>

#include "whale/backend/backend_ref.hpp"
#include "whale/tensor/tensor.hpp"

namespace whale::detail {

/// A blocking collective over `in` (n_in elements) and `out` (n_out) in the
/// memory of `be`: `run(in, out)` on them on the CPU; on a device on host
/// copies in `host` (a buffer reused from call to call), `in` copied down
/// before and `out` copied up after (in == out with n_in == n_out: one copy, in place). The
/// communicators take host memory; a device's own (NCCL) would take `in` and `out` directly.
template <class T, class F>
void through_host(const backend_ref& be, tensor<T>& host, const T* in, index_t n_in, T* out, index_t n_out, F&& run) {
  if (be.on_cpu()) return run(in, out);
  // in place: the same buffer, whole (an input that only starts where the output does is copied apart)
  const bool in_place = static_cast<const void*>(in) == static_cast<const void*>(out) && n_in == n_out;
  const index_t need = in_place ? n_in : n_in + n_out;
  if (host.capacity() < static_cast<std::size_t>(need)) {
    const place_scope on_host(nullptr);
    host = tensor<T>({need}, mem_kind::comm);
  }
  T* h_in = host.data();
  T* h_out = in_place ? h_in : h_in + n_in;
  be.copy(h_in, in, static_cast<std::size_t>(n_in) * sizeof(T));
  be.synchronize();
  run(static_cast<const T*>(h_in), h_out);
  be.copy(out, h_out, static_cast<std::size_t>(n_out) * sizeof(T));
  be.synchronize();
}

}  // namespace whale::detail
