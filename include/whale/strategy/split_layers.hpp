// The sharded forms of whale's layers, each holding its slice of the unsplit
// layer's parameters along one mesh axis (same initial values, element by
// element): column- and row-parallel linear (split_linear.hpp), class-split
// softmax cross-entropy, vocabulary-split embedding, the hidden-split SwiGLU
// MLP; head-split attention and rotary attention split by key/value groups
// (split_attention.hpp).
// Which one a layer becomes is decided by the split region (split.hpp) from
// the layout it receives.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/nn/embedding.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/nn/swiglu_mlp.hpp"
#include "whale/strategy/layout.hpp"
#include "whale/strategy/split_attention.hpp"
#include "whale/strategy/split_linear.hpp"
#include "whale/strategy/split_loss.hpp"

namespace whale {

/// softmax_cross_entropy on class-split logits (split<1>): the row max and the
/// row sum of exponentials are all-reduced over the axis, the target logit is
/// taken by the rank that holds its class; the logits are never gathered.
/// When the rows are the whole global batch on every data rank, each rank
/// returns 1/p of the loss so that summing shares over the data axis is right.
template <axis A>
class split_softmax_cross_entropy : public stateless_params {
 public:
  using input_type = float;
  static constexpr index_t in_features = any_features;
  static constexpr index_t out_features = 1;
  static std::string name() { return std::string("split_softmax_cross_entropy/") + axis_name(A); }
  static constexpr cost_info cost() { return softmax_cross_entropy::cost(); }
  /// Parameters divided among the ranks of the axis, and those every rank holds whole.
  static constexpr index_t split_params = 0, replicated_params = 0;
  /// What one of `degree` ranks holds and computes per row.
  static constexpr cost_info shard_cost(index_t degree) {
    return detail::shard_of(cost(), degree, split_params, replicated_params);
  }

  void configure(const split_env& e) {
    comm_ = &e.comm(A);
    dev_ = e.device(A);
    parts_ = comm_->size();
    part_ = comm_->rank();
  }

  // logits: (R, C/p) this rank's classes; labels: (R) global class ids
  double forward_loss(step_ctx& c, cview<float> logits, cview<std::int32_t> labels) {
    const index_t R = labels.numel();
    if (R == 0) return 0.0;
    const index_t n = logits.numel() / R;  // local classes
    const index_t c0 = part_ * n;
    auto& s = st_(c.slot);
    const auto ys = host_values(c, labels, s.host_labels);  // the labels on the host, when they are on a device
    for (index_t r = 0; r < R; ++r) {
      const index_t y = ys[r];
      if (y != ignore_index && (y < 0 || y >= n * parts_))
        throw std::out_of_range("whale::split_softmax_cross_entropy: label " + std::to_string(y) +
                                " out of range for " + std::to_string(n * parts_) + " classes");
    }
    // its collectives, in order: detail::split_loss_collectives (lowering records the same list)
    constexpr const auto& maxima = detail::split_loss_maxima;
    constexpr const auto& sums = detail::split_loss_sums;
    static_assert(maxima.op == reduce_op::max && maxima.floats_per_row == 1 && sums.op == reduce_op::sum &&
                      sums.floats_per_row == 2,
                  "the class-split loss's kernels take one row maximum, then each row's sum and target logit");
    static_assert(detail::split_loss_collectives.size() == 2 && detail::split_loss_collectives[0].op == maxima.op &&
                      detail::split_loss_collectives[1].op == sums.op,
                  "split_loss_collectives lists what this forward issues, in its order: the maxima, then the sums");
    auto g = detail::ensure(s.grad, {R, n});
    auto st = detail::ensure(s.stats, {maxima.floats_per_row * R});  // row maxima
    float* mx = st.data();
    c.be.launch(R, kernels::row_max{logits.data(), mx, n});
    detail::collective_in(c.be, *comm_, dev_, s.host, mx, R, mx, R, [&](auto& cm, const float*, float* h) {
      all_reduce(cm, view<float>(h, {maxima.floats_per_row * R}), maxima.op);
    });
    auto tg = detail::ensure(s.target, {sums.floats_per_row * R});
    c.be.launch(R, kernels::exp_rows{logits.data(), mx, g.data(), tg.data(), n});
    c.be.launch(R, kernels::target_logits{logits.data(), labels.data(), tg.data() + R, n, c0, ignore_index});
    // row sums, and the target logits (one rank each)
    detail::collective_in(c.be, *comm_, dev_, s.host, tg.data(), sums.floats_per_row * R, tg.data(), sums.floats_per_row * R,
                          [&](auto& cm, const float*, float* h) { all_reduce(cm, view<float>(h, {sums.floats_per_row * R}), sums.op); });
    const double count = c.loss_count();
    const double inv = count > 0 ? 1.0 / count : 0.0;
    auto rl = detail::ensure(s.row_loss, {R});
    c.be.launch(R, kernels::split_loss_rows{tg.data(), mx, labels.data(), rl.data(), R, ignore_index});
    c.be.launch(R, kernels::softmax_grad_rows{g.data(), tg.data(), labels.data(), n, c0, static_cast<float>(inv),
                                              ignore_index});
    // added where the rows' losses lie (into step_ctx::loss_sum where it is set: nothing read back); every
    // rank of a data-axis split computes the loss of all rows: share 1/p each
    return detail::loss_share(c, R, rl.data(), A == axis::data ? inv / parts_ : inv, s.total);
  }
  view<float> backward_loss(step_ctx& c) { return st_(c.slot).grad.v(); }

 private:
  struct state {
    tensor<float> grad, stats, target;
    tensor<double> row_loss, total;  // the rows' losses; their share, when it is read back
    tensor<float> host;  // on a device without its own communicator: the all-reduces' host copies
    std::vector<std::int32_t> host_labels;
  };
  world_comm* comm_ = nullptr;
  device_comm* dev_ = nullptr;  // on a device: the communicator that takes its buffers (null: host copies)
  int parts_ = 1, part_ = 0;
  slots<state> st_;
};

/// embedding<Vocab, D> split by vocabulary: rank r holds rows [v0, v0 + V/p)
/// of the table and writes the rows of its tokens; others' rows are zero, so
/// the output is partial (summed by the all-reduce that follows).
template <index_t Vocab, index_t D, axis A>
class vocab_embedding {
 public:
  static constexpr index_t split_extent = Vocab;
  using input_type = std::int32_t;
  static constexpr index_t in_features = any_features;
  static constexpr index_t out_features = D;
  static std::string name() {
    return "vocab_embedding<" + std::to_string(Vocab) + ", " + std::to_string(D) + ">/" + axis_name(A);
  }
  static constexpr cost_info cost() { return embedding<Vocab, D>::cost(); }
  using unsplit_type = embedding<Vocab, D>;  ///< the layer it is a shard of
  /// Parameters divided among the ranks of the axis, and those every rank holds whole.
  static constexpr index_t split_params = Vocab * D, replicated_params = 0;
  /// What one of `degree` ranks holds and computes per row.
  static constexpr cost_info shard_cost(index_t degree) {
    auto c = detail::shard_of(cost(), degree, split_params, replicated_params);
    c.act_bytes = cost().act_bytes;  // every rank writes whole rows (zeros outside its vocabulary)
    return c;
  }

  void configure(const split_env& e) {
    comm_ = &e.comm(A);
    parts_ = comm_->size();
    part_ = comm_->rank();
    detail::check_divides(embedding<Vocab, D>::name(), "the vocabulary", Vocab, parts_, A);
    n_ = Vocab / parts_;
  }
  /// Rank r of p holds rows [r n, r n + n) of the table (Vocab, D).
  static void param_runs(int r, int p, std::vector<param_run>& out) {
    const index_t n = Vocab / p;
    out.push_back({0, r * n * D, n * D});
  }
  void gather_full(const float* local, float* full) {
    all_gather(*comm_, cview<float>(local, {n_ * D}), view<float>(full, {Vocab * D}));
  }
  index_t param_count() const { return n_ * D; }
  void bind(param_binder& b) {
    auto t = b.take({n_, D});
    w_ = t.value, dw_ = t.grad;
  }
  void init(const counter_rng& r) {
    // the same values as embedding<Vocab, D>: N(0, 0.02) at flat index v*D + j
    const index_t base = part_ * n_ * D;
    for (index_t i = 0; i < n_ * D; ++i)
      w_[i] = static_cast<float>(0.02 * r.normal(static_cast<std::uint64_t>(base + i)));
  }
  // tokens: (B, T) -> y: (B*T, D) partial
  view<float> forward(step_ctx& c, cview<std::int32_t> tokens) {
    auto& s = st_(c.slot);
    const index_t R = tokens.numel();
    s.tokens = tokens;
    auto y = detail::ensure(s.y, {R, D});
    const auto ts = host_values(c, tokens, s.host_tokens);  // the tokens on the host, when they are on a device
    for (index_t i = 0; i < R; ++i) {
      const index_t t = ts[i];
      if (t < 0 || t >= Vocab)
        throw std::out_of_range("whale::vocab_embedding: token " + std::to_string(t) +
                                " is outside the vocabulary of " + std::to_string(Vocab));
    }
    // rows of this rank's slice of the vocabulary; zeros for other tokens
    c.be.launch(R, kernels::gather_rows{w_.data(), tokens.data(), y.data(), D, part_ * n_, n_});
    return y;
  }
  view<float> backward(step_ctx& c, cview<float> dy) {
    auto& s = st_(c.slot);
    if (!c.accumulate) c.be.fill_zero(dw_.data(), dw_.bytes());
    c.be.scatter_add(kernels::scatter_add_rows{dy.data(), s.tokens.data(), dw_.data(), s.tokens.numel(), D, 0, part_ * n_, n_});
    return {};
  }

 private:
  struct state {
    cview<std::int32_t> tokens;
    tensor<float> y;
    std::vector<std::int32_t> host_tokens;
  };
  world_comm* comm_ = nullptr;
  int parts_ = 1, part_ = 0;
  index_t n_ = Vocab;
  view<float> w_, dw_;
  slots<state> st_;
};

/// swiglu_mlp<D, Hidden> split by hidden features, Megatron's way: rank r
/// holds hidden features [r n, r n + n), n = Hidden / p: those rows of gate
/// and of up (column-parallel, together, so that each rank's SiLU(g) * u is
/// local) and those columns of down (row-parallel). Replicated in, partial out.
template <index_t D, index_t Hidden, axis A>
class hidden_swiglu_mlp : detail::swiglu_body<D> {
 public:
  static constexpr index_t split_extent = Hidden;
  using input_type = float;
  static constexpr index_t in_features = D;
  static constexpr index_t out_features = D;
  using unsplit_type = swiglu_mlp<D, Hidden>;  ///< the layer it is a shard of
  static std::string name() {
    return "hidden_swiglu_mlp<" + std::to_string(D) + ", " + std::to_string(Hidden) + ">/" + axis_name(A);
  }
  static constexpr cost_info cost() { return unsplit_type::cost(); }
  /// Parameters divided among the ranks of the axis, and those every rank holds whole.
  static constexpr index_t split_params = 3 * D * Hidden, replicated_params = 0;
  /// What one of `degree` ranks holds and computes per row.
  static constexpr cost_info shard_cost(index_t degree) {
    auto c = detail::shard_of(cost(), degree, split_params, replicated_params);
    c.act_bytes = 4.0 * static_cast<double>(6 * Hidden / (degree < 1 ? 1 : degree) + 2 * D);  // y and d(input) whole
    return c;
  }

  hidden_swiglu_mlp() : detail::swiglu_body<D>(Hidden) {}
  void configure(const split_env& e) {
    comm_ = &e.comm(A);
    parts_ = comm_->size();
    part_ = comm_->rank();
    detail::check_divides(unsplit_type::name(), "Hidden", Hidden, parts_, A);
    this->n_ = Hidden / parts_;
  }
  index_t param_count() const { return this->param_count_(); }
  void bind(param_binder& b) { this->bind_(b); }
  /// Rank r of p holds rows [r n, r n + n) of gate (Hidden, D) and of up
  /// (Hidden, D), and those columns of each row of down (D, Hidden).
  static void param_runs(int r, int p, std::vector<param_run>& out) {
    const index_t n = Hidden / p;
    out.push_back({0, r * n * D, n * D});
    out.push_back({n * D, Hidden * D + r * n * D, n * D});
    for (index_t o = 0; o < D; ++o) out.push_back({2 * n * D + o * n, 2 * Hidden * D + o * Hidden + r * n, n});
  }
  // The unsplit layer's values at the same flat indices (swiglu_mlp::init); gate, up and down lie one after another.
  void init(const counter_rng& rng) {
    const double kin = 1.0 / std::sqrt(static_cast<double>(D)), kh = 1.0 / std::sqrt(static_cast<double>(Hidden));
    detail::init_runs<hidden_swiglu_mlp>(this->wgu_.data(), part_, parts_, rng, [&](index_t f) { return f < 2 * Hidden * D ? kin : kh; });
  }
  /// gate, up (row blocks of every rank) and down (column blocks), unsplit.
  void gather_full(const float* local, float* full) {
    const index_t n = this->n_;
    all_gather(*comm_, cview<float>(local, {n * D}), view<float>(full, {Hidden * D}));
    all_gather(*comm_, cview<float>(local + n * D, {n * D}), view<float>(full + Hidden * D, {Hidden * D}));
    detail::gather_column_blocks(*comm_, local + 2 * n * D, D, n, full + 2 * Hidden * D);
  }

  // x: (R, D) replicated -> y: (R, D) partial
  view<float> forward(step_ctx& c, cview<float> x) { return this->forward_(c, x, false); }
  // dy: (R, D) replicated -> dx: (R, D) partial; weight gradients now or in the W pass
  view<float> backward(step_ctx& c, cview<float> dy) { return this->backward_(c, dy, this); }
  /// This rank's rows of d(gate), d(up) and columns of d(down) from slot `slot`.
  void weight_grads(const backend_ref& be, int slot, bool accumulate) { this->weight_grads_(be, slot, accumulate); }

 private:
  world_comm* comm_ = nullptr;
  int parts_ = 1, part_ = 0;
};

}  // namespace whale
