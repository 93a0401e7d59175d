// What the trainer reads batches from: the `DataSource` concept (checked with
// messages that name the missing piece), and two adapters: `tensor_data`
// (arrays in memory) and `token_file` (a memory-mapped flat file of token ids,
// as llm.c and nanoGPT write them, with a held-out split). The synthetic data
// of the reference workloads is in train/data.hpp.
#pragma once

#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "whale/detail/io.hpp"
#include "whale/nn/layer.hpp"
#include "whale/tensor/random.hpp"
#include "whale/tensor/tensor.hpp"
#include "whale/train/data.hpp"

namespace whale {

/// What data source D's batches hold for the loss: `D::target_type` where it
/// says (float: regression targets), else std::int32_t class labels.
template <class D> struct data_target { using type = std::int32_t; };
template <class D>
  requires requires { typename D::target_type; }
struct data_target<D> { using type = typename D::target_type; };
template <class D> using data_target_t = typename data_target<D>::type;

/// A source of global batches: step s's global batch has global_batch()
/// samples (or sequences of seq() tokens), and get(s, begin, count) returns
/// samples [begin, begin + count) of it. Each sample must be a pure function
/// of (s, index), so every plan (whatever rows each rank asks for) trains on
/// the same batch. Optional: `labelled(s)`, the labels of step s's global
/// batch other than ignore_index (the loss is their mean; without it, every
/// label is counted); `using target_type = float;` for float regression
/// targets (get() then returns batch_view<input_type, float>).
template <class D>
concept DataSource = requires(D& d, const D& cd, std::int64_t step, index_t i) {
  typename D::input_type;
  { cd.global_batch() } -> std::convertible_to<index_t>;
  { cd.seq() } -> std::convertible_to<index_t>;
  { d.get(step, i, i) } -> std::same_as<batch_view<typename D::input_type, data_target_t<D>>>;
};

namespace detail {
/// Whether `D` is a data source a model with input element `In` and loss
/// targets `Target` can train on; a static_assert names the first thing missing.
template <class D, class In, class Target = std::int32_t> constexpr bool data_source_for() {
  if constexpr (!requires { typename D::input_type; }) {
    static_assert(requires { typename D::input_type; },
                  "whale: a data source names its input element type: `using input_type = float;` (features) or "
                  "`using input_type = std::int32_t;` (tokens). See docs/data.md, 'Writing a data source'");
    return false;
  } else if constexpr (!requires(const D& d) { { d.global_batch() } -> std::convertible_to<index_t>; }) {
    static_assert(requires(const D& d) { { d.global_batch() } -> std::convertible_to<index_t>; },
                  "whale: a data source needs `index_t global_batch() const`: the samples (or sequences) of each step");
    return false;
  } else if constexpr (!requires(const D& d) { { d.seq() } -> std::convertible_to<index_t>; }) {
    static_assert(requires(const D& d) { { d.seq() } -> std::convertible_to<index_t>; },
                  "whale: a data source needs `index_t seq() const`: tokens per sequence (1 for non-sequence data)");
    return false;
  } else if constexpr (!requires(D& d, std::int64_t s, index_t i) {
                         { d.get(s, i, i) } -> std::same_as<batch_view<typename D::input_type, data_target_t<D>>>;
                       }) {
    static_assert(requires(D& d, std::int64_t s, index_t i) {
                    { d.get(s, i, i) } -> std::same_as<batch_view<typename D::input_type, data_target_t<D>>>;
                  },
                  "whale: a data source needs `batch_view<input_type> get(std::int64_t step, index_t begin, index_t "
                  "count)`: samples [begin, begin + count) of that step's global batch (batch_view<input_type, "
                  "float> where it declares `using target_type = float;`)");
    return false;
  } else if constexpr (!std::is_same_v<data_target_t<D>, Target>) {
    static_assert(std::is_same_v<data_target_t<D>, Target> || !std::is_same_v<Target, float>,
                  "whale: the model's loss (mse_loss, l1_loss, huber_loss) takes float targets, but the data source "
                  "gives std::int32_t class labels; give float targets (tensor_data(x, tensor<float> y, batch), or "
                  "`using target_type = float;` in your data source), or end the model in softmax_cross_entropy");
    static_assert(std::is_same_v<data_target_t<D>, Target> || !std::is_same_v<Target, std::int32_t>,
                  "whale: the model's loss (softmax_cross_entropy) takes std::int32_t class labels, but the data "
                  "source gives float targets; end the model in a regression loss (mse_loss, l1_loss, huber_loss) "
                  "or give class labels");
    static_assert(std::is_same_v<data_target_t<D>, Target> || std::is_same_v<Target, float> ||
                      std::is_same_v<Target, std::int32_t>,
                  "whale: the data source's target_type is not the target type of the model's loss");
    return false;
  } else if constexpr (!std::is_same_v<typename D::input_type, In>) {
    static_assert(std::is_same_v<typename D::input_type, In> || !std::is_same_v<In, std::int32_t>,
                  "whale: the model's first layer takes token ids (std::int32_t), but the data source's input_type "
                  "is not std::int32_t");
    static_assert(std::is_same_v<typename D::input_type, In> || !std::is_same_v<In, float>,
                  "whale: the model's first layer takes features (float), but the data source's input_type is not float");
    static_assert(std::is_same_v<typename D::input_type, In> || std::is_same_v<In, float> || std::is_same_v<In, std::int32_t>,
                  "whale: the data source's input_type is not the input element type of the model's first layer");
    return false;
  } else {
    return true;
  }
}

/// A bijection of [0, n) keyed by `key` (a 4-round Feistel network on the
/// next power of four, walked until it lands inside): a shuffled order with no
/// table, the same on every rank.
inline std::uint64_t permute(std::uint64_t i, std::uint64_t n, std::uint64_t key) {
  if (n <= 1) return 0;
  int half = 1;
  while ((std::uint64_t{1} << (2 * half)) < n) ++half;
  const std::uint64_t mask = (std::uint64_t{1} << half) - 1;
  do {
    std::uint64_t l = i >> half, r = i & mask;
    for (std::uint64_t round = 0; round < 4; ++round) {
      const std::uint64_t f = mix64(key ^ mix64(r + (round << 56))) & mask;
      const std::uint64_t next = l ^ f;
      l = r;
      r = next;
    }
    i = (l << half) | r;
  } while (i >= n);
  return i;
}

/// The shuffled (or sequential) position of global sample `g` in a data set of `n`: epochs of n, each in its own order.
inline std::uint64_t epoch_order(std::uint64_t g, std::uint64_t n, bool shuffle, std::uint64_t key) {
  const std::uint64_t epoch = g / n, pos = g % n;
  return shuffle ? permute(pos, n, mix64(key ^ mix64(epoch + 0x5eed))) : pos;
}

/// Why a batch of `sequences` sequences of `batch_seq` tokens, with `labels`
/// labels (or float targets) and `inputs` inputs, returned for rows (or
/// sequences) [begin, begin + count) of a global batch of `global` in
/// sequences of `seq`, is not those rows; "" if it is. `width`: inputs per row
/// (0: any whole number), `per_row`: labels per row (0: any whole number). A
/// short batch (a reader at the end of its data) would train on a wrong loss:
/// the loss is divided by the whole global batch.
inline std::string batch_problem_of(index_t sequences, index_t batch_seq, index_t labels, index_t inputs, bool targets,
                                    index_t width, index_t per_row, index_t begin, index_t count, index_t global, index_t seq) {
  const index_t rows = count * seq;
  const char* noun = targets ? " float targets" : " labels";
  std::string why;
  if (sequences != count) why = std::to_string(sequences) + (seq > 1 ? " sequences" : " rows");
  else if (batch_seq != seq) why = "sequences of " + std::to_string(batch_seq) + " tokens (its seq() says " + std::to_string(seq) + ")";
  else if (per_row > 0 ? labels != rows * per_row : (rows > 0 && labels % rows != 0))
    why = std::to_string(labels) + noun + " (for " + std::to_string(rows) + " rows" +
          (per_row > 1 || (targets && per_row > 0)
               ? "; the model's loss takes " + std::to_string(per_row) + " a row, one per output of the layer before it"
               : std::string()) + ")";
  else if (width > 0 ? inputs != rows * width : (rows > 0 && inputs % rows != 0))
    why = std::to_string(inputs) + " inputs (for " + std::to_string(rows) + " rows" +
          (width > 0 ? " of " + std::to_string(width) : std::string()) + ")";
  if (why.empty()) return why;
  return "the data source gave " + why + " for " + (seq > 1 ? "sequences [" : "rows [") + std::to_string(begin) + ", " +
         std::to_string(begin + count) + ") of the global batch of " + std::to_string(global) +
         " it asked for; a short batch would train on a wrong loss (it is divided by the whole batch). A data source "
         "returns every row asked for: at the end of its data, wrap around, or stop before that step";
}
/// The label buffer of batch `b` (layer.hpp): class labels as they are, float
/// targets as their bits, shaped (rows, targets per row) so that plans slice it by rows.
template <class In, class T> label_buffer labels_of(const batch_view<In, T>& b) {
  const auto l = label_bits(b.labels);
  const index_t rows = b.sequences * b.seq;
  if (rows > 0 && l.numel() != rows && l.numel() % rows == 0 && !(l.shape().rank() == 2 && l.shape()[0] == rows))
    return l.reshape({rows, l.numel() / rows});
  return l;
}
/// batch_problem_of for batch `b` and model `M`: the inputs per row where the
/// model's first layer says, the labels (or targets) per row where its loss says.
template <class M, class In, class Target>
std::string batch_problem(const batch_view<In, Target>& b, index_t begin, index_t count, index_t global, index_t seq) {
  index_t width = 0;
  if constexpr (std::is_same_v<In, std::int32_t>) width = 1;
  else if constexpr (requires { M::in_features; })
    if (M::in_features != any_features) width = M::in_features;
  index_t per_row = 1;
  if constexpr (requires { M::target_width; }) per_row = M::target_width == any_features ? 0 : M::target_width;
  return batch_problem_of(b.sequences, b.seq, b.labels.numel(), b.inputs.numel(), std::is_same_v<Target, float>, width, per_row,
                          begin, count, global, seq);
}

/// The bytes data source `d` holds for a batch of `count` rows (or sequences):
/// its own `memory_bytes(count)` where it says, else its inputs and labels
/// (rows × seq × the model's input width, and a label, or the loss's targets, per row).
template <class M, class D> std::int64_t data_source_bytes(const D& d, index_t count) {
  if constexpr (requires { { d.memory_bytes(count) } -> std::convertible_to<std::int64_t>; }) {
    return d.memory_bytes(count);
  } else {
    using In = typename D::input_type;
    index_t width = 1;
    if constexpr (!std::is_same_v<In, std::int32_t> && requires { M::in_features; })
      if (M::in_features != any_features) width = M::in_features;
    index_t labels = 1;  // per row: the loss's target width, where it says
    if constexpr (requires { M::target_width; })
      if (M::target_width > 1) labels = M::target_width;
    const std::int64_t rows = static_cast<std::int64_t>(count) * d.seq();
    return rows * width * static_cast<std::int64_t>(sizeof(In)) + rows * labels * static_cast<std::int64_t>(sizeof(std::int32_t));
  }
}

inline void check_rows(const char* who, index_t begin, index_t count, index_t total) {
  if (begin < 0 || count < 0 || begin + count > total)
    throw std::out_of_range(std::string("whale::") + who + ": rows [" + std::to_string(begin) + ", " +
                            std::to_string(begin + count) + ") outside the global batch of " + std::to_string(total));
}
}  // namespace detail

struct tensor_data_options {
  bool shuffle = true;     ///< each epoch in its own order (from `seed`); false: in order
  whale::seed seed{0};
};

/// Arrays in memory as a DataSource. x: N samples (N, features) of float, or
/// N sequences (N, T) of token ids; y: N class labels, or (N, T) next-token
/// labels, or (Target = float) float targets of N samples (N, Out) or (N) for
/// float features: what a regression loss (mse_loss, l1_loss, huber_loss)
/// compares with, any finite value. Class labels may be ignore_index (no
/// loss, no gradient). Step s's batch holds global samples [s B, s B + B),
/// each sample k of epoch k / N at the epoch's k % N-th position (shuffled
/// per epoch, the same on every rank). `tensor_data(x, y, batch)` deduces
/// In and Target from the tensors.
template <class In, class Target = std::int32_t>
class tensor_data {
  static_assert(std::is_same_v<In, float> || std::is_same_v<In, std::int32_t>,
                "whale::tensor_data: inputs are float features or std::int32_t token ids");
  static_assert(std::is_same_v<Target, std::int32_t> || std::is_same_v<Target, float>,
                "whale::tensor_data: y holds std::int32_t class labels or float regression targets");
  static_assert(std::is_same_v<Target, std::int32_t> || std::is_same_v<In, float>,
                "whale::tensor_data: float targets go with float features (x of shape (N, features)); token "
                "sequences take class labels");
  static constexpr bool targets = std::is_same_v<Target, float>;

 public:
  using input_type = In;
  using target_type = Target;
  tensor_data(tensor<In> x, tensor<Target> y, index_t global_batch, tensor_data_options o = {})
      : x_(std::move(x)), y_(std::move(y)), batch_(global_batch), o_(o) {
    if (x_.shape().rank() < 1 || x_.shape()[0] < 1)
      throw std::invalid_argument("whale::tensor_data: x needs at least one sample (shape (N, ...))");
    n_ = x_.shape()[0];
    width_ = x_.numel() / n_;
    if (global_batch < 1)
      throw std::invalid_argument("whale::tensor_data: global_batch must be >= 1 (got " + std::to_string(global_batch) + ")");
    if constexpr (targets) {
      if (y_.shape().rank() < 1 || y_.shape()[0] != n_ || y_.numel() % n_ != 0 || y_.numel() == 0)
        throw std::invalid_argument("whale::tensor_data: y has " + std::to_string(y_.numel()) + " float targets in " +
                                    std::to_string(y_.shape().rank() ? y_.shape()[0] : 0) + " rows for " +
                                    std::to_string(n_) + " samples; give (N, outputs) or (N): the same number for every sample");
      ywidth_ = y_.numel() / n_;
      for (index_t i = 0; i < y_.numel(); ++i)
        if (!std::isfinite(y_[i]))
          throw std::invalid_argument("whale::tensor_data: float target " + std::to_string(i) + " (sample " +
                                      std::to_string(i / ywidth_) + ") is " + std::to_string(y_[i]) +
                                      "; targets must be finite");
    } else {
      if (y_.numel() == n_) seq_ = 1;
      else if (std::is_same_v<In, std::int32_t> && y_.numel() == x_.numel()) seq_ = width_;
      else
        throw std::invalid_argument("whale::tensor_data: y has " + std::to_string(y_.numel()) + " labels for " +
                                    std::to_string(n_) + " samples of " + std::to_string(width_) +
                                    (std::is_same_v<In, float> ? " features; give one label per sample (or float "
                                                                 "targets, tensor<float>, for a regression loss)"
                                                               : " tokens; give one label per sample or one per token"));
      for (index_t i = 0; i < y_.numel(); ++i) {
        if (y_[i] == ignore_index) ignored_ = true;
        else if (y_[i] < 0)
          throw std::invalid_argument("whale::tensor_data: label " + std::to_string(i) + " is " + std::to_string(y_[i]) +
                                      "; labels are class ids >= 0, or ignore_index (" + std::to_string(ignore_index) +
                                      "); for real-valued targets give y as tensor<float> and end the model in a "
                                      "regression loss (mse_loss, l1_loss, huber_loss)");
      }
    }
  }
  /// `tensor_data<In>(x, y, ...)` with y of another element type than Target.
  template <class Y>
    requires(!std::is_same_v<Y, Target>)
  tensor_data(tensor<In>, tensor<Y>, index_t, tensor_data_options = {}) {
    static_assert(std::is_same_v<Y, Target>,
                  "whale::tensor_data<In>: y's element type is not the data's Target (std::int32_t unless given); "
                  "for float targets write tensor_data<float, float>(x, y, batch), or tensor_data(x, y, batch) to "
                  "deduce both");
  }
  index_t global_batch() const noexcept { return batch_; }
  index_t seq() const noexcept { return seq_; }
  index_t size() const noexcept { return n_; }  ///< samples in the data set

  /// Samples [begin, begin + count) of step `step`'s global batch.
  batch_view<In, Target> get(std::int64_t step, index_t begin, index_t count) {
    detail::check_rows("tensor_data", begin, count, batch_);
    const index_t per = targets ? ywidth_ : seq_;  // labels (or targets) per sample
    bx_.resize({count, width_});
    if constexpr (targets) by_.resize({count, ywidth_});
    else by_.resize({count * seq_});
    for (index_t r = 0; r < count; ++r) {
      const auto k = static_cast<index_t>(sample(step, begin + r));
      std::memcpy(bx_.data() + r * width_, x_.data() + k * width_, static_cast<std::size_t>(width_) * sizeof(In));
      std::memcpy(by_.data() + r * per, y_.data() + k * per, static_cast<std::size_t>(per) * sizeof(Target));
    }
    return {bx_.v(), by_.v(), count, seq_};
  }
  /// Labels of step `step`'s global batch that count (not ignore_index); class labels only.
  std::int64_t labelled(std::int64_t step) const
    requires(!targets)
  {
    const std::int64_t all = static_cast<std::int64_t>(batch_) * seq_;
    if (!ignored_) return all;
    std::int64_t n = 0;
    for (index_t r = 0; r < batch_; ++r) {
      const auto k = static_cast<index_t>(sample(step, r));
      for (index_t t = 0; t < seq_; ++t) n += y_[k * seq_ + t] != ignore_index;
    }
    return n;
  }

 private:
  std::uint64_t sample(std::int64_t step, index_t i) const {
    if (step < 0) throw std::out_of_range("whale::tensor_data: step " + std::to_string(step) + " is negative");
    const auto g = static_cast<std::uint64_t>(step) * static_cast<std::uint64_t>(batch_) + static_cast<std::uint64_t>(i);
    return detail::epoch_order(g, static_cast<std::uint64_t>(n_), o_.shuffle, o_.seed.value);
  }
  tensor<In> x_;
  tensor<Target> y_;
  index_t batch_ = 0, n_ = 0, width_ = 0, seq_ = 1, ywidth_ = 1;
  tensor_data_options o_;
  bool ignored_ = false;
  tensor<In> bx_;
  tensor<Target> by_;
};
template <class In, class Target>
tensor_data(tensor<In>, tensor<Target>, index_t, tensor_data_options = {}) -> tensor_data<In, Target>;

}  // namespace whale

#include "whale/train/token_file.hpp"
