// Typed tensors: `shape` (runtime, rank <= 4), non-owning `view<T, Space>` and
// owning `tensor<T, Space>` (row-major, contiguous). No arithmetic lives here:
// kernels are in backend/, layers in nn/.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "whale/tensor/memory.hpp"

namespace whale {

using index_t = std::int64_t;

/// Memory spaces: where a tensor's storage lives.
struct host {
  static constexpr const char* name = "host";
};
struct cuda {
  static constexpr const char* name = "cuda";
};

/// The bits of a bfloat16 (the high half of a float), as stored and sent
/// (named bf16, not bfloat16: OpenBLAS declares a global bfloat16 typedef):
/// gradient buckets summed in bf16 (plan_options::bf16_reduce) travel as these.
struct bf16 {
  std::uint16_t bits;
};

/// Element types whale knows, for the type-erased cores (MPI, NCCL, BLAS).
enum class dtype : int { f32, f64, i32, i64, u8, bf16 };
template <class T> constexpr dtype dtype_of() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>) return dtype::f32;
  else if constexpr (std::is_same_v<U, double>) return dtype::f64;
  else if constexpr (std::is_same_v<U, std::int32_t>) return dtype::i32;
  else if constexpr (std::is_same_v<U, std::int64_t>) return dtype::i64;
  else if constexpr (std::is_same_v<U, bf16>) return dtype::bf16;
  else if constexpr (std::is_same_v<U, std::uint8_t> || std::is_same_v<U, char> ||
                     std::is_same_v<U, std::byte>)
    return dtype::u8;
  else static_assert(sizeof(T) == 0, "whale::dtype_of: unsupported element type; use float, double, int32, int64, uint8 or bf16");
}
inline constexpr std::size_t size_of(dtype d) {
  switch (d) {
    case dtype::f32: case dtype::i32: return 4;
    case dtype::f64: case dtype::i64: return 8;
    case dtype::u8: return 1;
    case dtype::bf16: return 2;
  }
  return 0;
}

/// A runtime shape of rank 0..4. Construction checks rank and non-negative extents.
class shape {
 public:
  static constexpr int max_rank = 4;
  constexpr shape() = default;
  constexpr shape(std::initializer_list<index_t> dims) {
    if (dims.size() > max_rank)
      throw std::invalid_argument("whale::shape: rank " + std::to_string(dims.size()) +
                                  " exceeds the maximum rank 4");
    for (index_t d : dims) {
      if (d < 0)
        throw std::invalid_argument("whale::shape: negative extent " + std::to_string(d));
      dims_[rank_++] = d;
    }
  }
  constexpr int rank() const noexcept { return rank_; }
  constexpr index_t operator[](int i) const {
    if (i < 0 || i >= rank_)
      throw std::out_of_range("whale::shape: dimension " + std::to_string(i) +
                              " out of range for rank " + std::to_string(rank_));
    return dims_[i];
  }
  constexpr index_t numel() const noexcept {
    index_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= dims_[i];
    return n;
  }
  /// Product of all extents but the first (elements per row).
  constexpr index_t row_size() const noexcept {
    index_t n = 1;
    for (int i = 1; i < rank_; ++i) n *= dims_[i];
    return n;
  }
  /// The same shape with the first extent replaced.
  shape with_rows(index_t rows) const {
    shape s = *this;
    if (s.rank_ == 0) throw std::invalid_argument("whale::shape: a scalar has no rows");
    s.dims_[0] = rows;
    return s;
  }
  friend constexpr bool operator==(const shape& a, const shape& b) noexcept {
    if (a.rank_ != b.rank_) return false;
    for (int i = 0; i < a.rank_; ++i)
      if (a.dims_[i] != b.dims_[i]) return false;
    return true;
  }
  friend std::ostream& operator<<(std::ostream& os, const shape& s) {
    os << '(';
    for (int i = 0; i < s.rank_; ++i) os << (i ? ", " : "") << s.dims_[i];
    return os << ')';
  }

 private:
  std::array<index_t, max_rank> dims_{};
  int rank_ = 0;
};

/// A non-owning, contiguous, row-major window on memory of `Space`.
template <class T, class Space = host>
class view {
 public:
  using value_type = T;
  using space = Space;
  constexpr view() = default;
  view(T* data, shape s) : data_(data), s_(s) {}
  /// A view of mutable elements converts to a view of const ones.
  template <class U>
    requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>)
  view(const view<U, Space>& v) : data_(v.data()), s_(v.shape()) {}

  T* data() const noexcept { return data_; }
  const whale::shape& shape() const noexcept { return s_; }
  index_t numel() const noexcept { return s_.numel(); }
  index_t size(int dim) const { return s_[dim]; }
  bool empty() const noexcept { return data_ == nullptr || numel() == 0; }
  std::size_t bytes() const noexcept { return static_cast<std::size_t>(numel()) * sizeof(T); }
  T* begin() const noexcept { return data_; }
  T* end() const noexcept { return data_ + numel(); }

  T& operator[](index_t i) const noexcept { return data_[i]; }
  /// Element access with bounds checks, for tests and debugging.
  T& at(index_t i) const {
    if (i < 0 || i >= numel())
      throw std::out_of_range("whale::view::at: index " + std::to_string(i) + " out of " +
                              std::to_string(numel()));
    return data_[i];
  }
  /// Rows [begin, begin + count) of the first dimension.
  view rows(index_t begin, index_t count) const {
    if (s_.rank() == 0 || begin < 0 || count < 0 || begin + count > s_[0])
      throw std::out_of_range("whale::view::rows: rows [" + std::to_string(begin) + ", " +
                              std::to_string(begin + count) + ") out of a tensor of shape " +
                              to_text(s_));
    return view(data_ + begin * s_.row_size(), s_.with_rows(count));
  }
  /// The same elements under another shape with the same element count.
  view reshape(whale::shape s) const {
    if (s.numel() != numel())
      throw std::invalid_argument("whale::view::reshape: cannot view " + to_text(s_) + " as " +
                                  to_text(s));
    return view(data_, s);
  }
  view<const T, Space> as_const() const noexcept { return view<const T, Space>(data_, s_); }

 private:
  static std::string to_text(const whale::shape& s) {
    std::string r = "(";
    for (int i = 0; i < s.rank(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + ")";
  }
  T* data_ = nullptr;
  whale::shape s_{};
};

template <class T, class Space = host> using cview = view<const T, Space>;

/// An owning, 64-byte aligned (2 MiB for big buffers), move-only tensor.
/// `resize` reuses storage when it fits, so buffers sized once do not allocate again.
/// Storage is host memory unless it was allocated inside a `place_scope`
/// (tensor/memory.hpp): then it is that backend's memory (a GPU's), which only
/// the backend's calls may touch; `on_host()` says which.
template <class T, class Space = host>
class tensor {
  static_assert(std::is_same_v<Space, host>,
                "whale::tensor: a tensor's memory is chosen at run time, not in its type: allocate a tensor<T> "
                "inside a place_scope on a backend's memory() (whale/tensor/memory.hpp) to put it in device memory");
  static_assert(std::is_trivially_copyable_v<T>,
                "whale::tensor: elements must be trivially copyable (float, int32, ...)");

 public:
  using value_type = T;
  using space = Space;
  tensor() = default;
  explicit tensor(whale::shape s, mem_kind kind = mem_kind::workspace) : kind_(kind) { resize(s); }
  tensor(const tensor&) = delete;
  tensor& operator=(const tensor&) = delete;
  tensor(tensor&& o) noexcept { swap(o); }
  tensor& operator=(tensor&& o) noexcept {
    if (this != &o) {
      release();
      swap(o);
    }
    return *this;
  }
  ~tensor() { release(); }

  /// Give the tensor shape `s`. Storage is reused when it is large enough;
  /// contents are zeroed only when storage is new.
  void resize(whale::shape s) {
    const auto n = static_cast<std::size_t>(s.numel());
    if (n > cap_) {
      release();
      place_ = detail::current_place();
      data_ = static_cast<T*>(detail::allocate_in(place_, n * sizeof(T), kind_));
      cap_ = n;
      detail::zero_in(place_, data_, n * sizeof(T));
    }
    s_ = s;
  }
  void set_kind(mem_kind k) {
    if (data_) throw std::logic_error("whale::tensor::set_kind: storage already allocated");
    kind_ = k;
  }
  void zero() { detail::zero_in(place_, data_, static_cast<std::size_t>(numel()) * sizeof(T)); }
  /// Whether the storage is host memory (true when there is none yet).
  bool on_host() const noexcept { return place_ == nullptr; }
  /// Where the storage is: null for host memory.
  const memory_place* place() const noexcept { return place_; }

  T* data() const noexcept { return data_; }
  const whale::shape& shape() const noexcept { return s_; }
  index_t numel() const noexcept { return s_.numel(); }
  std::size_t capacity() const noexcept { return cap_; }
  T& operator[](index_t i) const noexcept { return data_[i]; }
  view<T, Space> v() const noexcept { return view<T, Space>(data_, s_); }
  operator view<T, Space>() const noexcept { return v(); }
  operator view<const T, Space>() const noexcept { return view<const T, Space>(data_, s_); }
  T* begin() const noexcept { return data_; }
  T* end() const noexcept { return data_ + numel(); }

 private:
  void release() noexcept {
    detail::free_in(place_, data_, cap_ * sizeof(T), kind_);
    data_ = nullptr;
    cap_ = 0;
    place_ = nullptr;
  }
  void swap(tensor& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(s_, o.s_);
    std::swap(cap_, o.cap_);
    std::swap(kind_, o.kind_);
    std::swap(place_, o.place_);
  }
  T* data_ = nullptr;
  whale::shape s_{};
  std::size_t cap_ = 0;
  mem_kind kind_ = mem_kind::workspace;
  const memory_place* place_ = nullptr;  // null: host memory
};

/// Copy elements between two views of equal element count.
template <class T>
inline void copy(cview<T> src, view<T> dst) {
  if (src.numel() != dst.numel())
    throw std::invalid_argument("whale::copy: element counts differ (" +
                                std::to_string(src.numel()) + " vs " + std::to_string(dst.numel()) +
                                ")");
  if (src.numel()) std::memcpy(dst.data(), src.data(), src.bytes());
}

}  // namespace whale
