// `executor<P>`: the one runtime of every parallel plan. It lowers the plan for
// this rank (plan/lower.hpp), checks that what it binds is what the program
// says the rank holds, and runs each step as the program orders it: this
// rank's stage (the whole model, or its pipeline stage) over the schedule's
// micro-batches, messages between stages, gradients summed over the data axis
// in buckets (or reduce-scattered, ZeRO 2–3), the loss reduced, the global
// gradient norm for clipping, the optimizer over the owned range, the trace.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "whale/backend/cpu.hpp"
#include "whale/comm/device_comm.hpp"
#include "whale/comm/trace.hpp"
#include "whale/plan/lower.hpp"
#include "whale/plan/memory.hpp"
#include "whale/runtime/executor_core.hpp"
#include "whale/runtime/stage.hpp"

namespace whale {

namespace detail {
template <class P> struct shard_level : std::integral_constant<int, 0> {
  using inner = P;
};
template <class M, int L> struct shard_level<shard<M, L>> : std::integral_constant<int, L> {
  using inner = M;
};
template <class X, bool Staged> struct stage_of {
  using type = whole_stage<X>;
  using schedule = one_f_one_b;
};
template <class X> struct stage_of<X, true> {
  using type = pipe_stage<X>;
  using schedule = typename X::schedule;
};
}  // namespace detail

/// The runtime of plan P on this rank; built by make<P>(ctx, seed, options).
template <class P> class executor final : public detail::executor_core {
  static constexpr int level = detail::shard_level<P>::value;
  using unsharded = typename detail::shard_level<P>::inner;
  static constexpr bool replicated = is_replicate_v<unsharded> || level > 0;
  using X = strip_replicate_t<unsharded>;
  static constexpr bool staged = is_pipeline_v<X>;
  using stage_type = typename detail::stage_of<X, staged>::type;
  using sched = typename detail::stage_of<X, staged>::schedule;
  static constexpr bool has_split = stage_type::has_split;
  static_assert(!staged || !stage_type::splits_data,
                "whale::pipeline: split regions over axis::data are not supported inside pipeline stages (the "
                "batch is cut into micro-batches there); split over axis::model inside stages, and replicate the "
                "pipeline for data parallelism");
  static constexpr bool split_backward = staged && splits_backward_v<sched>;
  /// Model chunks (virtual stages) per pipe rank: interleaved schedules hold several.
  static constexpr int chunks_per_rank = staged ? chunks_v<sched> : 1;
  static_assert(chunks_per_rank == 1 || level < 2,
                "whale::shard<pipeline<interleaved_1f1b<V>, ...>, 2|3>: ZeRO 2-3 map each layer's gradients into one "
                "contiguous stage range, but an interleaved pipe rank holds V separate chunks; use ZeRO-1 or 1f1b");
  static_assert(chunks_per_rank == 1 || !split_backward, "whale::pipeline: a schedule cannot both interleave chunks and split the backward");
  static_assert(!split_backward || level < 2,
                "whale::shard<pipeline<zb_h1, ...>, 2|3>: a schedule that splits the backward computes the weight "
                "gradients in later W passes, but ZeRO 2-3 reduce-scatter each layer's gradients right after its "
                "backward; use ZeRO-1 (shard<..., 1>) or the 1f1b schedule");

 public:
  using model_type = P;
  using input_type = typename stage_type::input_type;

  /// (runtime/setup.hpp) Checks the launch, lowers this rank's program, binds the parameters.
  executor(const context& ctx, seed s, plan_options o = plan_options::from_env());
  /// ZeRO level of the plan (shard<M, L>; 0 without).
  static constexpr int zero_level = level;
  /// One step: every micro-batch forward and backward under the schedule; this
  /// rank's gradients are final (summed over the data axis, or reduce-scattered
  /// into its range) when it returns. Returns this rank's share of the loss.
  double train_step(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) { return pass(c, x, labels, detail::training_pass); }
  /// train_step without the data-axis gradient sum (benchmarks' compute limit,
  /// wsp_trainer's local steps; split regions, pipeline messages, ZeRO 2-3's
  /// per-leaf collectives and a tied head's sum with its table still communicate).
  double compute_only_step(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) {
    return pass(c, x, labels, detail::local_training_pass);
  }
  /// HetPipe's minibatches in flight (wsp_trainer with wsp_options::in_flight):
  /// `x` holds `n` minibatches of this replica's rows one after another (c.batch
  /// = n x rows of one); they run as the n micro-batches of one pass under the
  /// plan's schedule, with no flush between them and no data-axis sum. Each
  /// minibatch keeps its own gradients: when its backward is done on this rank,
  /// `done(k)` finds them in grads(), and the next minibatch's backward
  /// overwrites them. c.global_rows is one minibatch's rows (each its own mean
  /// loss). Returns each minibatch's loss share (the last stage's; 0 elsewhere);
  /// with c.loss_sum set (n doubles in the backend's memory) minibatch k's
  /// share is added to c.loss_sum[k] instead, and nothing is read back.
  const std::vector<double>& in_flight_step(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels, int n,
                                            std::function<void(int)> done) {
    static_assert(level == 0, "whale::executor::in_flight_step: minibatches in flight keep whole per-minibatch "
                              "gradients on every rank; ZeRO (shard<..., L>) is not supported, drop shard<>");
    static_assert(chunks_per_rank == 1 && !split_backward,
                  "whale::executor::in_flight_step: minibatches in flight hand over each one's gradients when its "
                  "backward ends; interleaved and split-backward schedules spread that over several passes; use "
                  "gpipe or one_f_one_b");
    if (n < 1 || n > max_micro || c.batch % n != 0 || c.batch < n)
      throw std::invalid_argument("whale::executor::in_flight_step: " + std::to_string(n) +
                                  " minibatches do not divide the pass's " + std::to_string(c.batch) + " sequences");
    struct reset {
      executor* e;
      ~reset() { e->in_flight_ = 0, e->micro_done_ = nullptr; }
    } r{this};
    if (tied_model_)
      throw std::invalid_argument("whale::executor::in_flight_step: the model has a tied head (tied_head), whose "
                                  "gradients are summed with its table's once a step's backward is done; minibatches in "
                                  "flight hand over each one's gradients before that; untie the head (linear<D, V, no_bias>)");
    in_flight_ = n;
    micro_done_ = std::move(done);
    micro_shares_.assign(static_cast<std::size_t>(n), 0.0);
    pass(c, x, labels, detail::local_training_pass);
    return micro_shares_;
  }
  /// Forward only (a forward-only schedule); this rank's share of the loss.
  double evaluate(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) { return pass(c, x, labels, detail::evaluation_pass); }
  /// The logits of this replica's rows `x` (c.batch sequences): the model's
  /// output before its loss, unsplit, (rows, classes), on every rank of the
  /// replica. A forward-only pass (pipelines: every micro-batch forward in
  /// order, the last stage's output broadcast over the pipe axis); collective
  /// over the replica's ranks. The model must end in a plain loss layer.
  tensor<float> forward(step_ctx& c, cview<input_type> x);
  /// Whether forward() compiles: the model ends in a plain loss layer (a whole model split as one region included).
  static constexpr bool gives_logits() {
    using flat = std::remove_cvref_t<decltype(std::declval<executor&>().parts_[0].model())>;
    if constexpr (requires { typename flat::tuple_type; }) {
      using tuple = typename flat::tuple_type;
      return !is_container<std::tuple_element_t<std::tuple_size_v<tuple> - 1, tuple>>;
    } else {
      return false;
    }
  }
  /// *out = grad_squares(true) with `out` in the backend's memory and nothing
  /// read back (ZeRO 0-1): this rank's part of its data replica's squared
  /// norm, the same bits; sum it over the replica's pipe and model ranks.
  void replica_grad_squares_into(double* out) const {
    static_assert(level < 2, "whale::executor::replica_grad_squares_into: ZeRO 2-3 spread a replica's gradients over the data axis");
    if (be_.on_cpu()) *out = grad_squares(true);
    else squares_into(detail::owned_ranges(prog_, true), grads_.data(), out);
  }
  // make_optimizer_state and apply_optimizer (one definition for every plan: runtime/executor_update.hpp)
  using detail::executor_core::apply_optimizer;
  /// The same as apply_optimizer(opt, st, gate), with ZeRO 0 (this rank updates all
  /// it holds), also writing what the step changed, weighed, into `delta`
  /// (kernels::update_delta: as many floats as params()), in the update's own pass.
  template <class O>
  void apply_optimizer(const O& opt, typename O::state& st, kernels::update_gate gate, kernels::update_delta delta)
    requires(level == 0)
  {
    apply_optimizer_with_delta(opt, st, gate, delta);
  }

  // ---- what this rank holds (more in executor_core) ----
  /// The stage's range of the flat parameters (one chunk: interleaved ranks hold V, see chunk_ranges()).
  index_t param_begin() const { return one_chunk("param_begin"), parts_[0].begin(); }
  index_t param_end() const { return one_chunk("param_end"), parts_[0].end(); }
  index_t total_params() const { return parts_[0].total(); }
  /// Each chunk's range of the model's flat parameters (one range without interleaving).
  std::vector<std::pair<index_t, index_t>> chunk_ranges() const {
    std::vector<std::pair<index_t, index_t>> r;
    for (const auto& part : parts_) r.push_back({part.begin(), part.end()});
    return r;
  }
  /// This stage's range of the unsplit model's flat parameters.
  index_t full_param_begin() const { return one_chunk("full_param_begin"), parts_[0].full_begin(); }
  index_t full_param_end() const { return one_chunk("full_param_end"), parts_[0].full_end(); }
  /// This stage's unsplit parameters [full_param_begin(), full_param_end()), gathered
  /// from the shards (collective over the model and, for ZeRO 3, the data axis);
  /// interleaved: the rank's chunks one after another. (runtime/gather.hpp)
  tensor<float> stage_params();
  /// The whole unsplit model's parameters on every rank, as network<unsplit model>
  /// holds them (collective over the world).
  tensor<float> full_params();
  std::vector<int> stage_blocks() const { return parts_[0].blocks(); }
  auto& model() noexcept { return parts_[0].model(); }
  /// The plan, its stages, data axis, schedule and what this rank holds (executor_core::print).
  friend std::ostream& operator<<(std::ostream& os, const executor& e) { return e.print(os), os; }

 private:
  static detail::plan_facts facts();
  void bind(seed s, index_t n);
  index_t chunk_size(int ch) const { return parts_[static_cast<std::size_t>(ch)].end() - parts_[static_cast<std::size_t>(ch)].begin(); }
  void one_chunk(const char* what) const {
    if (chunks_per_rank > 1)
      throw std::logic_error(std::string("whale::executor::") + what + ": an interleaved pipe rank holds " + std::to_string(chunks_per_rank) +
                             " chunks, not one range; use chunk_ranges() or full_params()");
  }

  /// (runtime/step.hpp) One pass of the schedule over this rank's rows `x`; with `logits`, they are kept there.
  double pass(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels, detail::pass_mode mode,
              tensor<float>* logits = nullptr);
  // (runtime/step.hpp) what executor_core's pass asks of this rank's chunk `ch`
  index_t chunk_in_width(int ch) const override { return parts_[static_cast<std::size_t>(ch)].in_width(); }
  index_t chunk_out_width(int ch) const override { return parts_[static_cast<std::size_t>(ch)].out_width(); }
  index_t chunk_begin(int ch) const override { return parts_[static_cast<std::size_t>(ch)].begin(); }
  view<float> chunk_forward(int ch, step_ctx& c, int micro, index_t mb, cview<float> in) override;
  double chunk_forward_loss(int ch, step_ctx& c, int micro, index_t mb, cview<float> in, cview<std::int32_t> labels) override;
  view<float> chunk_logits(int ch, step_ctx& c, int micro, index_t mb, cview<float> in) override;
  view<float> chunk_backward(int ch, step_ctx& c, cview<float> dy) override;
  std::string stage_description(int vstage) const override { return parts_[0].describe(vstage); }
  /// The pass's rows of micro-batch `micro` (mb sequences) for chunk `ch`: on the first virtual stage only.
  cview<input_type> first_rows(int ch, int micro, index_t mb) const {
    return ch * stages_ + stage_ == 0 ? x_.rows(micro * mb, mb) : cview<input_type>{};
  }
  std::array<stage_type, chunks_per_rank> parts_;  // this rank's chunks (one without interleaving)
  tensor<input_type> in_;            // a device: this pass's rows, copied up
  cview<input_type> x_;              // this pass's rows (in_'s on a device)
  tensor<std::int32_t> labels_;      // and its labels
};

}  // namespace whale

#include "whale/runtime/gather.hpp"
#include "whale/runtime/setup.hpp"
#include "whale/runtime/step.hpp"
