// Blocking collectives over buffers in a backend's memory, run by the
// communicator that takes them: the host communicator on the CPU, the
// device's own (device_comm: NCCL on a GPU) where the plan has one, and
// otherwise the host communicator on host copies (the input copied down, the
// result copied up). One helper for every blocking collective of the runtime
// and the split regions.
#pragma once

#include <cstddef>

#include "whale/backend/backend_ref.hpp"
#include "whale/comm/device_comm.hpp"
#include "whale/tensor/tensor.hpp"

namespace whale::detail {

/// A blocking collective over `in` (n_in elements) and `out` (n_out) in the
/// memory of `be`: `run(in, out)` on them on the CPU; on a device on host
/// copies in `host` (a buffer reused from call to call), `in` copied down
/// before and `out` copied up after (in == out with n_in == n_out: one copy, in place).
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

/// A blocking collective over `in` and `out` in the memory of `be`:
/// `run(comm, in, out)` with `hc` (a host communicator) on the CPU, with `dc`
/// on a device where there is one (the buffers themselves), else with `hc` on
/// host copies (through_host). `run` takes either communicator (a generic lambda).
template <class HostComm, class T, class F>
void collective_in(const backend_ref& be, HostComm& hc, device_comm* dc, tensor<T>& host, const T* in, index_t n_in,
                   T* out, index_t n_out, F&& run) {
  if (be.on_cpu()) return run(hc, in, out);
  if (dc) return run(*dc, in, out);
  through_host(be, host, in, n_in, out, n_out, [&](const T* i, T* o) { run(hc, i, o); });
}

}  // namespace whale::detail
