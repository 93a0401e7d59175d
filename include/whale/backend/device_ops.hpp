// How backend_ref reaches a device backend without knowing its type: a table
// of functions per backend type G (`device_ops_of<G>`), each null where G
// does not offer the call (a fused attention, a GEMM epilogue, bf16 products,
// kernel timing; a host-executed backend's window and launch ledger). And the
// CPU's scratch memory for one call's workspace (`scratch_stack`).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>

#include "whale/backend/backend.hpp"

namespace whale::detail {

/// The CPU's scratch memory: one block used as a stack by the scratches of
/// a call (freed in reverse order), grown to the most they asked for at once
/// when the last is freed; until then what does not fit comes from the
/// heap. So steps after the first allocate nothing. One per thread.
class scratch_stack {
 public:
  static scratch_stack& local() {
    static thread_local scratch_stack s;
    return s;
  }
  float* take(index_t floats, bool& heap) {
    const index_t n = rounded(floats);
    demand_ += n;
    high_ = demand_ > high_ ? demand_ : high_;
    heap = top_ + n > cap_;
    if (heap) return static_cast<float*>(detail::allocate_raw(static_cast<std::size_t>(n) * sizeof(float), mem_kind::workspace));
    float* p = base_ + top_;
    top_ += n;
    return p;
  }
  void give(float* p, index_t floats, bool heap) noexcept {
    const index_t n = rounded(floats);
    demand_ -= n;
    if (heap) detail::free_raw(p, static_cast<std::size_t>(n) * sizeof(float), mem_kind::workspace);
    else top_ -= n;
    if (demand_ == 0 && high_ > cap_) {  // nothing taken: the block may move
      release();
      base_ = static_cast<float*>(detail::allocate_raw(static_cast<std::size_t>(high_) * sizeof(float), mem_kind::workspace));
      cap_ = high_;
    }
  }
  ~scratch_stack() { release(); }

 private:
  static index_t rounded(index_t floats) noexcept { return (floats + 15) / 16 * 16; }  // 64-byte aligned pieces
  void release() noexcept {
    if (base_) detail::free_raw(base_, static_cast<std::size_t>(cap_) * sizeof(float), mem_kind::workspace);
    base_ = nullptr, cap_ = 0;
  }
  float* base_ = nullptr;
  index_t cap_ = 0, top_ = 0, demand_ = 0, high_ = 0;
};

/// One device backend's calls, as functions of its address.
struct device_ops {
  void (*gemm)(void*, trans, trans, index_t, index_t, index_t, float, const float*, index_t, const float*, index_t,
               float, float*, index_t);
  void (*batched)(void*, trans, trans, index_t, index_t, index_t, float, const float*, index_t, index_t,
                  const float*, index_t, index_t, float, float*, index_t, index_t, index_t);
  void (*copy)(void*, void*, const void*, std::size_t);
  void (*fill_zero)(void*, void*, std::size_t);
  void (*synchronize)(void*);
  const memory_place* (*memory)(void*);
  std::int64_t (*memory_free)(void*);
  const char* name;
  void (*enter)(void*);  // host-executed backends only; null otherwise
  void (*leave)(void*);
  bool (*note)(void*, const launch_note&);  // the launch for its ledger; false: do not run it
  // a fused attention call (forward, or backward when the flag is set); false: not taken, run the steps
  bool (*attention)(void*, const attention_args&, bool);
  // a layer's weight and bias gradients in one call; false: not taken, run the GEMM and the reduction
  bool (*weight_grads)(void*, const weight_grad_args&);
  // a GEMM with its bias added in the call; false: not taken, fill the bias and add the product
  bool (*bias_gemm)(void*, const gemm_bias_args&);
  // a GEMM with GELU or its gradient in the call; false: not taken, the GEMM and then the kernel
  bool (*gelu_gemm)(void*, const gemm_gelu_args&);
  bool (*attention_fused)(void*);  // whether bf16 attention calls are fused; null: never
  void (*products)(void*, bool);  // bf16 products on or off; null: nothing to set
  int (*time_begin)(void*, const char*);  // a timed launch's start (-1: not timing); null: no timing
  void (*time_end)(void*, int) noexcept;
};
template <class G> inline constexpr bool host_executed_v = requires { requires G::host_executed; };
template <class G> void enter_of(void* g) {
  if constexpr (host_executed_v<G>) static_cast<G*>(g)->enter();
}
template <class G> void leave_of(void* g) {
  if constexpr (host_executed_v<G>) static_cast<G*>(g)->leave();
}
template <class G> bool note_to(void* g, const launch_note& n) {
  if constexpr (host_executed_v<G>) return static_cast<G*>(g)->note(n);
  else return (void)g, (void)n, true;
}
template <class G>
inline constexpr bool fuses_attention_v = requires(G& g, const attention_args& a) {
  { g.fused_attention(a, true) } -> std::same_as<bool>;
};
template <class G> bool attention_fused_of(void* g) {
  if constexpr (requires(G& b) { { b.fuses_attention() } -> std::same_as<bool>; })
    return static_cast<G*>(g)->fuses_attention();
  else return (void)g, false;
}
template <class G> bool attention_of(void* g, const attention_args& a, bool backward) {
  if constexpr (fuses_attention_v<G>) return static_cast<G*>(g)->fused_attention(a, backward);
  else return (void)g, (void)a, (void)backward, false;
}
template <class G>
inline constexpr bool fuses_weight_grads_v = requires(G& g, const weight_grad_args& a) {
  { g.linear_weight_grads(a) } -> std::same_as<bool>;
};
template <class G> bool weight_grads_of(void* g, const weight_grad_args& a) {
  if constexpr (fuses_weight_grads_v<G>) return static_cast<G*>(g)->linear_weight_grads(a);
  else return (void)g, (void)a, false;
}
template <class G>
inline constexpr bool fuses_bias_v = requires(G& g, const gemm_bias_args& a) {
  { g.gemm_bias(a) } -> std::same_as<bool>;
};
template <class G> bool bias_gemm_of(void* g, const gemm_bias_args& a) {
  if constexpr (fuses_bias_v<G>) return static_cast<G*>(g)->gemm_bias(a);
  else return (void)g, (void)a, false;
}
template <class G>
inline constexpr bool fuses_gelu_v = requires(G& g, const gemm_gelu_args& a) {
  { g.gemm_gelu(a) } -> std::same_as<bool>;
};
template <class G> bool gelu_gemm_of(void* g, const gemm_gelu_args& a) {
  if constexpr (fuses_gelu_v<G>) return static_cast<G*>(g)->gemm_gelu(a);
  else return (void)g, (void)a, false;
}
template <class G> inline constexpr bool sets_products_v = requires(G& g) { g.set_bf16_products(true); };
template <class G> void products_of(void* g, bool on) {
  if constexpr (sets_products_v<G>) static_cast<G*>(g)->set_bf16_products(on);
  else (void)g, (void)on;
}
template <class G> inline constexpr bool times_v = requires(G& g) { g.time_end(g.time_begin("")); };
template <class G> int time_begin_of(void* g, const char* what) {
  if constexpr (times_v<G>) return static_cast<G*>(g)->time_begin(what);
  else return (void)g, (void)what, -1;
}
template <class G> void time_end_of(void* g, int i) noexcept {
  if constexpr (times_v<G>) {
    try {
      static_cast<G*>(g)->time_end(i);
    } catch (...) {  // a failed event record loses one timing; the launch's own errors surface elsewhere
    }
  } else {
    (void)g, (void)i;
  }
}
template <class G>
inline constexpr device_ops device_ops_of{
    [](void* g, trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A, index_t lda,
       const float* B, index_t ldb, float beta, float* C, index_t ldc) {
      static_cast<G*>(g)->gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    },
    [](void* g, trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A, index_t lda,
       index_t sA, const float* B, index_t ldb, index_t sB, float beta, float* C, index_t ldc, index_t sC,
       index_t count) {
      static_cast<G*>(g)->gemm_strided_batched(ta, tb, M, N, K, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC,
                                               count);
    },
    [](void* g, void* dst, const void* src, std::size_t bytes) { static_cast<G*>(g)->copy(dst, src, bytes); },
    [](void* g, void* p, std::size_t bytes) { static_cast<G*>(g)->fill_zero(p, bytes); },
    [](void* g) { static_cast<G*>(g)->synchronize(); },
    [](void* g) -> const memory_place* { return static_cast<G*>(g)->memory(); },
    [](void* g) -> std::int64_t {
      if constexpr (requires(G& b) { b.memory_free(); })
        return static_cast<std::int64_t>(static_cast<G*>(g)->memory_free());
      else
        return (void)g, std::int64_t{-1};
    },
    G::name(),
    host_executed_v<G> ? &enter_of<G> : nullptr,
    host_executed_v<G> ? &leave_of<G> : nullptr,
    host_executed_v<G> ? &note_to<G> : nullptr,
    fuses_attention_v<G> ? &attention_of<G> : nullptr,
    fuses_weight_grads_v<G> ? &weight_grads_of<G> : nullptr,
    fuses_bias_v<G> ? &bias_gemm_of<G> : nullptr,
    fuses_gelu_v<G> ? &gelu_gemm_of<G> : nullptr,
    fuses_attention_v<G> ? &attention_fused_of<G> : nullptr,
    sets_products_v<G> ? &products_of<G> : nullptr,
    times_v<G> ? &time_begin_of<G> : nullptr,
    times_v<G> ? &time_end_of<G> : nullptr,
};

}  // namespace whale::detail
