// Built-in synthetic data of the reference workloads (shared/workloads.md):
// teacher classification (`teacher_data`) and Markov-chain tokens
// (`markov_data`). Every sample is a pure function of (seed, global sample
// index), so any rank can make any rows of any step's global batch.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/backend/cpu.hpp"
#include "whale/tensor/random.hpp"
#include "whale/tensor/tensor.hpp"

namespace whale {

/// Rows [begin, begin + count) of one step's global batch. Target: what the
/// loss compares with, std::int32_t class labels or float regression targets.
template <class In, class Target = std::int32_t>
struct batch_view {
  cview<In> inputs;               // (rows, features) or (sequences, seq) tokens
  cview<Target> labels;           // class labels (rows) or (sequences * seq); float targets (rows, width)
  index_t sequences = 0;          // samples or sequences in this slice
  index_t seq = 1;                // tokens per sequence (1 for non-sequence data)
};

/// x ~ N(0, 1) of width In; y = argmax(x T) for a fixed random teacher T (In, Classes).
class teacher_data {
 public:
  using input_type = float;
  teacher_data(seed s, index_t in, index_t classes, index_t global_batch)
      : rng_(s, 1), in_(in), classes_(classes), global_batch_(global_batch),
        teacher_({in, classes}, mem_kind::workspace) {
    if (in <= 0 || classes <= 0 || global_batch <= 0)
      throw std::invalid_argument("whale::teacher_data: sizes must be positive");
    const auto t = rng_.child(0);
    for (index_t i = 0; i < in * classes; ++i) teacher_[i] = static_cast<float>(t.normal(static_cast<std::uint64_t>(i)));
  }
  index_t global_batch() const noexcept { return global_batch_; }
  index_t seq() const noexcept { return 1; }
  index_t features() const noexcept { return in_; }
  index_t classes() const noexcept { return classes_; }
  /// The bytes get() holds for `count` samples: inputs, labels and the teacher's scores.
  std::int64_t memory_bytes(index_t count) const noexcept {
    return static_cast<std::int64_t>(count) * ((in_ + classes_) * 4 + 4);
  }

  /// Samples [begin, begin + count) of step `step`'s global batch.
  batch_view<float> get(std::int64_t step, index_t begin, index_t count) {
    check_range("teacher_data", begin, count, global_batch_);
    auto x = detail_ensure(x_, {count, in_});
    auto y = detail_ensure(y_, {count});
    auto logits = detail_ensure(scores_, {count, classes_});
    const auto xs = rng_.child(1);
    for (index_t r = 0; r < count; ++r) {
      const auto g = static_cast<std::uint64_t>(step * global_batch_ + begin + r);
      for (index_t j = 0; j < in_; ++j)
        x[r * in_ + j] = static_cast<float>(xs.normal(g * static_cast<std::uint64_t>(in_) + j));
    }
    cpu::gemm(cpu::trans::no, cpu::trans::no, count, classes_, in_, 1.f, x.data(), teacher_.data(),
              0.f, logits.data());
    for (index_t r = 0; r < count; ++r) {
      const float* z = logits.data() + r * classes_;
      index_t best = 0;
      for (index_t j = 1; j < classes_; ++j)
        if (z[j] > z[best]) best = j;
      y[r] = static_cast<std::int32_t>(best);
    }
    return {x, y, count, 1};
  }

 private:
  template <class T> static view<T> detail_ensure(tensor<T>& t, shape s) {
    t.resize(s);
    return t.v();
  }
  static void check_range(const char* who, index_t begin, index_t count, index_t total) {
    if (begin < 0 || count < 0 || begin + count > total)
      throw std::out_of_range(std::string("whale::") + who + ": rows [" + std::to_string(begin) +
                              ", " + std::to_string(begin + count) + ") outside the global batch of " +
                              std::to_string(total));
  }
  counter_rng rng_;
  index_t in_, classes_, global_batch_;
  tensor<float> teacher_;
  tensor<float> x_, scores_;
  tensor<std::int32_t> y_;
};

/// Token streams from a fixed random first-order Markov chain: each token has
/// `fanout` successors drawn with a seeded RNG, uniform among them. The best
/// possible next-token loss is ln(fanout).
class markov_data {
 public:
  using input_type = std::int32_t;
  markov_data(seed s, index_t vocab, index_t seq, index_t global_batch, index_t fanout = 8)
      : markov_data(s, vocab, seq, global_batch, fanout, 1) {}
  /// Sequences of the same chain that training never sees (another sample
  /// stream), `global_batch` per step: for evaluation.
  markov_data held_out(index_t global_batch) const {
    return markov_data(seed_, vocab_, seq_, global_batch, fanout_, stream_ + 1);
  }
  index_t global_batch() const noexcept { return global_batch_; }
  index_t seq() const noexcept { return seq_; }
  index_t vocab() const noexcept { return vocab_; }

  /// Sequences [begin, begin + count) of step `step`: inputs (count, seq), labels the next tokens.
  batch_view<std::int32_t> get(std::int64_t step, index_t begin, index_t count) {
    if (begin < 0 || count < 0 || begin + count > global_batch_)
      throw std::out_of_range("whale::markov_data: sequences [" + std::to_string(begin) + ", " +
                              std::to_string(begin + count) + ") outside the global batch of " +
                              std::to_string(global_batch_));
    tokens_.resize({count, seq_});
    labels_.resize({count * seq_});
    const auto xs = rng_.child(stream_);
    for (index_t r = 0; r < count; ++r) {
      const auto g = static_cast<std::uint64_t>(step * global_batch_ + begin + r);
      const auto base = g * static_cast<std::uint64_t>(seq_ + 1);
      std::int32_t tok = static_cast<std::int32_t>(xs.below(base, static_cast<std::uint64_t>(vocab_)));
      for (index_t t = 0; t < seq_; ++t) {
        tokens_[r * seq_ + t] = tok;
        const auto pick = xs.below(base + 1 + static_cast<std::uint64_t>(t), static_cast<std::uint64_t>(fanout_));
        tok = succ_[static_cast<std::size_t>(tok * fanout_ + static_cast<index_t>(pick))];
        labels_[r * seq_ + t] = tok;
      }
    }
    return {tokens_.v(), labels_.v(), count, seq_};
  }

 private:
  markov_data(seed s, index_t vocab, index_t seq, index_t global_batch, index_t fanout, std::uint64_t stream)
      : seed_(s), stream_(stream), rng_(s, 2), vocab_(vocab), seq_(seq), global_batch_(global_batch), fanout_(fanout),
        succ_(static_cast<std::size_t>(vocab > 0 && fanout > 0 ? vocab * fanout : 0)) {
    if (vocab <= 1 || seq <= 0 || global_batch <= 0 || fanout <= 0)
      throw std::invalid_argument("whale::markov_data: sizes must be positive (vocab > 1)");
    const auto t = rng_.child(0);
    for (index_t i = 0; i < vocab * fanout; ++i)
      succ_[static_cast<std::size_t>(i)] =
          static_cast<std::int32_t>(t.below(static_cast<std::uint64_t>(i), static_cast<std::uint64_t>(vocab)));
  }
  seed seed_;
  std::uint64_t stream_ = 1;  // the sample stream (the chain is the seed's)
  counter_rng rng_;
  index_t vocab_, seq_, global_batch_, fanout_;
  std::vector<std::int32_t> succ_;
  tensor<std::int32_t> tokens_, labels_;
};

}  // namespace whale
