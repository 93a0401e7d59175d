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
#include "whale/runtime/agree.hpp"
#include "whale/runtime/grad_norm.hpp"
#include "whale/runtime/grad_sync.hpp"
#include "whale/runtime/messenger.hpp"
#include "whale/runtime/options.hpp"
#include "whale/runtime/slowdown.hpp"
#include "whale/runtime/stage.hpp"
#include "whale/runtime/tie.hpp"
#include "whale/runtime/zero.hpp"

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
template <class P> class executor {
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
  static constexpr int max_micro = 16000;  // tags 2j, 2j+1 stay under MPI's guaranteed 32767
  static constexpr bool split_backward = staged && splits_backward_v<sched>;
  /// Model chunks (virtual stages) per pipe rank: interleaved schedules hold several.
  static constexpr int V = staged ? chunks_v<sched> : 1;
  static_assert(V == 1 || level < 2,
                "whale::shard<pipeline<interleaved_1f1b<V>, ...>, 2|3>: ZeRO 2-3 map each layer's gradients into one "
                "contiguous stage range, but an interleaved pipe rank holds V separate chunks; use ZeRO-1 or 1f1b");
  static_assert(V == 1 || !split_backward, "whale::pipeline: a schedule cannot both interleave chunks and split the backward");
  static_assert(!split_backward || level < 2,
                "whale::shard<pipeline<zb_h1, ...>, 2|3>: a schedule that splits the backward computes the weight "
                "gradients in later W passes, but ZeRO 2-3 reduce-scatter each layer's gradients right after its "
                "backward; use ZeRO-1 (shard<..., 1>) or the 1f1b schedule");

 public:
  /// The memory check before the first training step's activations and
  /// communication buffers, with `data_bytes` of this rank's data-source
  /// buffers (counted on the CPU, where they share the memory), run once:
  /// the trainer runs it before it fetches the first batch (collective).
  void check_step_memory(const step_ctx& c, std::int64_t data_bytes = 0);
  using model_type = P;
  using input_type = typename stage_type::input_type;

  /// (runtime/setup.hpp) Checks the launch, lowers this rank's program, binds the parameters.
  executor(const context& ctx, seed s, plan_options o = plan_options::from_env());
  executor(const executor&) = delete;
  executor& operator=(const executor&) = delete;
  /// Writes the trace if a path was given and finish_trace() was not called (collective).
  ~executor() {
    if (!o_.trace_path.empty() && !trace_written_ && std::uncaught_exceptions() == 0) {
      try {
        finish_trace();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "whale: rank %d: %s\n", ctx_->rank(), e.what());
      }
    }
  }

  // ---- Trainable ----
  /// Every stage of a replica feeds the same rows: the replica's slice of the
  /// global batch (even, or by speed with plan_options::balance).
  std::pair<index_t, index_t> local_batch(index_t global_batch) const {
    if (global_batch < d_)
      throw std::invalid_argument("whale::" + layer_name<P>() + ": the global batch (" + std::to_string(global_batch) +
                                  ") is smaller than the data-parallel degree (" + std::to_string(d_) +
                                  "); every rank needs at least one sample");
    // the same checks on every rank; ZeRO 2-3 issue collectives per micro-batch over the data
    // axis, so every replica must run as many
    const int m0 = micro_count(slice(global_batch, 0).second);
    for (int r = 1; r < d_; ++r) {
      const int mr = micro_count(slice(global_batch, r).second);
      if (mr != m0 && level >= 2)
        throw std::invalid_argument("whale::" + layer_name<P>() + ": the global batch (" + std::to_string(global_batch) +
                                    ") gives the data replicas " + std::to_string(m0) + " and " + std::to_string(mr) +
                                    " micro-batches, but ZeRO " + std::to_string(level) +
                                    " needs the same count on every replica; choose a global batch that the data "
                                    "axis divides, or set plan_options::micro_batches to a count that divides every replica's batch");
    }
    return slice(global_batch, replica_);
  }
  /// The replicas' weights in the batch split (empty: even); see plan_options::balance.
  const std::vector<double>& replica_weights() const noexcept { return replica_weights_; }
  /// Seconds this rank slept to emulate its slowness (plan_options::speeds).
  double emulated_wait_s() const noexcept { return slow_.waited_s(); }
  /// ZeRO level of the plan (shard<M, L>; 0 without).
  static constexpr int zero_level = level;
  /// One step: every micro-batch forward and backward under the schedule; this
  /// rank's gradients are final (summed over the data axis, or reduce-scattered
  /// into its range) when it returns. Returns this rank's share of the loss.
  double train_step(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) { return pass(c, x, labels, true); }
  /// train_step without the data-axis gradient sum (benchmarks' compute limit,
  /// wsp_trainer's local steps; split regions, pipeline messages, ZeRO 2-3's
  /// per-leaf collectives and a tied head's sum with its table still communicate).
  double compute_only_step(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) {
    return pass(c, x, labels, true, false);
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
    static_assert(V == 1 && !split_backward,
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
    pass(c, x, labels, true, false);
    return micro_shares_;
  }
  /// This rank's part of the squared gradient norm, each parameter counted once
  /// over the world (no collective): their sum over the world is the norm squared.
  /// `within_replica` (ZeRO 0-1): once over this rank's data replica instead, to
  /// sum over the replica's pipe and model ranks (a virtual worker's own norm).
  double grad_squares(bool within_replica = false) const {
    if (within_replica && level >= 2)
      throw std::logic_error("whale::executor::grad_squares: ZeRO 2-3 spread a replica's gradients over the data axis");
    return level >= 2 ? detail::owned_range_squares(prog_, zero_.shard_grads().data(), zero_.begin(), zero_.end(), be_)
                      : detail::owned_squares(prog_, grads_.data(), within_replica, be_);
  }
  /// Forward only (a forward-only schedule); this rank's share of the loss.
  double evaluate(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) { return pass(c, x, labels, false); }
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
  /// The global mean loss: shares summed over the world, once per model group.
  double reduce_loss(double share) {
    const auto t0 = tr_.now();
    double v = model_rank_ == 0 ? share : 0.0;
    all_reduce(ctx_->world(), view<double>(&v, {1}));
    tr_.add(span_kind::loss_all_reduce, step_ - 1, -1, t0, tr_.now());
    return v;
  }
  /// After a non-finite gradient norm: the first layer (flat order) whose
  /// gradient holds a NaN or Inf on any rank, named; empty if none (collective).
  std::string first_nonfinite_grad() const;
  /// The norm of the whole model's gradient, each parameter counted once (collective).
  double grad_norm() const {
    // ZeRO 2-3: the owned ranges partition each stage's gradients over the data axis
    double sq = grad_squares();
    all_reduce(ctx_->world(), view<double>(&sq, {1}));
    return std::sqrt(sq);
  }
  /// *out = the square of grad_norm(), with `out` in the backend's memory and
  /// nothing read back: each counted range's squares into a partial there,
  /// the partials added in grad_squares()'s order, then summed over the world
  /// by the device's own communicator (host copies around MPI only where
  /// device_collectives is off). The bits of grad_norm()'s square on the CPU
  /// and guarded backends (on GPUs NCCL may add the ranks' sums in another
  /// order). The trainer keeps a step's figures on the device with it
  /// (trainer_options::log_every > 1): no read of the norm or the loss; on a GPU
  /// the compute stream, not the host, waits for the world sum.
  void grad_sum_squares_into(double* out) const {
    if (be_.on_cpu()) {  // grad_norm()'s square, as it is
      *out = grad_squares();
      all_reduce(ctx_->world(), view<double>(out, {1}));
      return;
    }
    if (level >= 2) squares_into(detail::owned_range_ranges(prog_, zero_.begin(), zero_.end()), zero_.shard_grads().data(), out);
    else squares_into(detail::owned_ranges(prog_), grads_.data(), out);
    if (ctx_->size() == 1) return;
    if (dev_world_) {
      all_reduce(*dev_world_, view<double>(out, {1}));  // on a GPU joined: the device's queue waits, not the host
    } else {  // without the device's own communicators: through the host (a wait)
      double host = 0;
      be_.copy(&host, out, sizeof host);
      be_.synchronize();
      all_reduce(ctx_->world(), view<double>(&host, {1}));
      be_.copy(out, &host, sizeof host);
      be_.synchronize();
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
  int rank() const noexcept { return ctx_->rank(); }
  /// Whether the model has a tied head (tied_head; on any rank, not only this one's stage).
  bool has_tied_head() const { return tied_model_; }
  /// The backend this rank's layers and optimizer run on (every pass sets step_ctx::be to it).
  const backend_ref& backend() const noexcept { return be_; }
  /// On a device: the traffic of its own communicators over the data and model
  /// axes and of its pipeline channels (plan_options::device_collectives); zero
  /// when collectives and messages go through host copies.
  comm_stats device_traffic() const {
    comm_stats t;
    if (dev_data_) t += dev_data_->stats();
    if (dev_model_) t += dev_model_->stats();
    t += msg_.channel_traffic();
    return t;
  }
  /// Whether gradient buckets are blocking all-reduces (plan_options::blocking, or by backend).
  /// Unset, non-blocking where NCCL sums them; on the CPU and on a host-executed backend (the guarded one,
  /// which then sums as the CPU does) blocking.
  bool blocking_buckets() const noexcept { return o_.blocking.value_or(dev_data_ == nullptr || be_.host_executed()); }
  /// On a device: how often the host waited for an operation of its own
  /// communicators (device_comm::host_waits; each is a spin on a GPU).
  std::int64_t device_host_waits() const {
    std::int64_t n = msg_.channel_host_waits();
    for (const auto* d : {dev_data_.get(), dev_model_.get(), dev_world_.get()})
      if (d) n += d->host_waits();
    return n;
  }
  /// On a device: the traffic of its pipeline channels alone (in device_traffic() too).
  comm_stats pipe_device_traffic() const { return msg_.channel_traffic(); }
  /// The job's world communicator (checkpoints agree on errors and gather file records over it).
  world_comm& world() const noexcept { return ctx_->world(); }
  int world_size() const noexcept { return ctx_->size(); }
  /// The memory this rank's program needs for steps of `global_batch`
  /// sequences of `seq` tokens (plan/memory.hpp), the optimizer at
  /// `optimizer_bytes_per_param` per owned parameter (AdamW 8, SGD with momentum 4).
  memory_estimate predicted_memory(index_t global_batch, index_t seq, int optimizer_bytes_per_param = 8) const;
  /// Optimizer state for the range this rank updates.
  template <class O> typename O::state make_optimizer_state(const O& opt) const {
    const place_scope on(be_.memory());  // in the parameters' memory (a device's, on one)
    return opt.make_state(local_count());
  }
  /// One optimizer step of this rank's range under `gate` (in the backend's
  /// memory: the gradients scaled by *gate.scale as they are read, nothing
  /// changed while *gate.halt is set); ZeRO 1–2 then all-gather the parameters.
  /// The host reads neither.
  template <class O> void apply_optimizer(const O& opt, typename O::state& st, kernels::update_gate gate) {
    const auto t0 = tr_.now();
    update_on(be_, opt, st, local_params(), local_grads(), gate);
    if constexpr (level > 0 && level < 3) zero_.gather_after_update(params_.data());
    tr_.add(span_kind::optimizer, step_ - 1, -1, t0, tr_.now());
  }
  /// Scale the gradients (clipping), update this rank's range; ZeRO 1–2 then all-gather the parameters.
  template <class O> void apply_optimizer(const O& opt, typename O::state& st, float grad_scale) {
    const auto t0 = tr_.now();
    auto g = local_grads();
    if (grad_scale != 1.f) be_.launch(g.numel(), kernels::scale{g.data(), grad_scale});
    update_on(be_, opt, st, local_params(), g);
    if constexpr (level > 0 && level < 3) zero_.gather_after_update(params_.data());
    tr_.add(span_kind::optimizer, step_ - 1, -1, t0, tr_.now());
  }

  // ---- what this rank holds ----
  const program& placement() const noexcept { return prog_; }
  /// This rank's parameters and gradients: its stage's flat range [param_begin(), param_end())
  /// (parameters at ZeRO 3 and gradients at ZeRO 2-3: only the owned range, see range()).
  view<float> params() const noexcept { return level == 3 ? zero_.shard_params() : params_.v(); }
  view<float> grads() const noexcept { return level >= 2 ? zero_.shard_grads() : grads_.v(); }
  index_t param_count() const { return chunk_at_[V]; }
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
  /// The range this rank updates, relative to param_begin(): all, or its ZeRO range.
  std::pair<index_t, index_t> range() const { return level ? std::pair{zero_.begin(), zero_.end()} : std::pair<index_t, index_t>{0, param_count()}; }
  index_t local_count() const { return range().second - range().first; }
  view<float> local_params() const { return level == 3 ? zero_.shard_params() : params_.v().rows(range().first, local_count()); }
  view<float> local_grads() const { return level >= 2 ? zero_.shard_grads() : grads_.v().rows(range().first, local_count()); }
  /// This stage's unsplit parameters [full_param_begin(), full_param_end()), gathered
  /// from the shards (collective over the model and, for ZeRO 3, the data axis);
  /// interleaved: the rank's chunks one after another. (runtime/gather.hpp)
  tensor<float> stage_params();
  /// This stage's local parameters (param_count() floats) into `out`: collective at ZeRO level 3.
  void gather_params(view<float> out);
  /// The whole unsplit model's parameters on every rank, as network<unsplit model>
  /// holds them (collective over the world).
  tensor<float> full_params();
  int stage() const noexcept { return stage_; }
  int stages() const noexcept { return p_; }
  int replicas() const noexcept { return d_; }
  int model_degree() const noexcept { return model_comm_->size(); }
  std::vector<int> stage_blocks() const { return parts_[0].blocks(); }
  int chunks() const noexcept { return V; }
  int micro_batches() const noexcept { return m_; }
  int peak_live_micro_batches() const noexcept { return peak_live_; }
  int activation_slots_used() const noexcept { return max_slot_; }
  const schedule_report& schedule_info() const noexcept { return rep_; }
  /// Split schedules: the layers' weight-gradient computations the last training step put off to W passes.
  std::size_t deferred_weight_grads() const noexcept { return deferred_; }
  std::size_t bucket_count() const noexcept { return sync_.size(); }
  std::size_t comm_buffers() const noexcept { return zero_.comm_buffers(); }
  /// ZeRO-3: passes whose gather order differed from the one recorded for their kind.
  std::size_t gather_rerecords() const noexcept { return zero_.rerecords(); }
  const plan_options& options() const noexcept { return o_; }
  const tracer& trace() const noexcept { return tr_; }
  /// The recorder itself, for a loop around the executor that records spans of its own (wsp_trainer).
  tracer& trace_recorder() noexcept { return tr_; }
  auto& model() noexcept { return parts_[0].model(); }
  /// Gather every rank's spans (collective over the world), write the Chrome
  /// trace to options().trace_path on rank 0 if set, and return the merged events.
  std::vector<trace_event> finish_trace() {
    auto ev = gather_trace(ctx_->world(), tr_);
    trace_written_ = true;
    if (ctx_->rank() == 0 && !o_.trace_path.empty()) write_trace(o_.trace_path, ev);
    return ev;
  }
  friend std::ostream& operator<<(std::ostream& os, const executor& e) {
    os << "plan: " << layer_name<P>() << " over " << e.ctx_->mesh().shape() << "\n";
    if (e.p_ * V > 1)
      for (int s = 0; s < e.p_ * V; ++s)
        os << "  stage " << s % e.p_ << (V > 1 ? " chunk " + std::to_string(s / e.p_) : std::string()) << ": "
           << e.parts_[0].describe(s) << (s % e.p_ == e.stage_ ? "  <- this rank" : "") << "\n";
    if (level) os << "  ZeRO-" << level << " over data:" << e.d_ << "\n";
    if (e.d_ > 1)
      os << "  data: " << e.d_ << " replica(s); "
         << (level >= 2 ? std::string("gradients reduce-scattered per leaf") + (e.o_.bf16_reduce ? " in bf16" : "") : "gradients all-reduced in " + std::to_string(e.sync_.size()) + " bucket(s)")
         << (level ? ", ZeRO-" + std::to_string(level) + " owns [" + std::to_string(e.range().first) + ", " + std::to_string(e.range().second) + ")" : "")
         << "\n";
    if (e.p_ > 1 || e.o_.micro_batches > 1)
      os << "  schedule " << sched::name() << ", micro-batches "
         << (e.o_.micro_batches ? std::to_string(e.o_.micro_batches) : std::string(staged ? "auto (<= 4 x stages)" : "1")) << "\n";
    if (e.d_ > 1 && level < 2)
      os << "  buckets of <= " << e.o_.bucket_mib << " MiB" << (e.blocking_buckets() ? ", blocking" : ", non-blocking")
         << (e.o_.overlap ? ", during backward" : ", after backward") << (e.o_.bf16_reduce ? ", summed in bf16" : "")
         << "\n";
    const auto t = e.prog_.totals();
    os << "  this rank holds " << t.params_held << " of " << e.prog_.full_params << " parameters ("
       << static_cast<double>(t.params_held) * 4 / 1048576.0 << " MiB):\n";
    for (const auto& h : e.prog_.holds) {
      if (h.full_params == 0 && h.name.front() == '[') {  // an inserted conversion
        os << "    " << h.name << "\n";
        continue;
      }
      os << "    " << h.name << "  " << h.local_params;
      if (h.local_params != h.full_params) os << " of " << h.full_params;
      if (!h.split_over.empty()) os << ", split over " << h.split_over.name() << " (" << lay_name(h.layout_in) << " in)";
      if (h.recompute) os << ", recomputed";
      os << "\n";
    }
    return os;
  }

 private:
  void bind(seed s, index_t n);
  index_t chunk_size(int ch) const { return parts_[static_cast<std::size_t>(ch)].end() - parts_[static_cast<std::size_t>(ch)].begin(); }
  void one_chunk(const char* what) const {
    if (V > 1)
      throw std::logic_error(std::string("whale::executor::") + what + ": an interleaved pipe rank holds " + std::to_string(V) +
                             " chunks, not one range; use chunk_ranges() or full_params()");
  }
  /// (runtime/memory_step.hpp) The lowering options of real steps; the memory
  /// checks before the parameters and before the first step's activations.
  lower_options step_lowering(index_t global_batch, index_t seq, int optimizer_bytes_per_param) const;
  void check_state_memory(const program_totals& held, index_t n) const;
  /// plan_options::balance under memory caps: replicas whose predicted step of
  /// plan_batch rows would pass a rank's cap get only the rows that fit; the
  /// others share the rest by speed (collective over the world).
  void fit_rows_to_caps();
  detail::zero_engine::options zopts() const { return {o_.bucket_mib, o_.prefetch, o_.max_pending, o_.bf16_reduce}; }

  std::pair<index_t, index_t> slice(index_t global_batch, int replica) const {
    return detail::weighted_slice(global_batch, d_, replica, replica_weights_, std::max(1, o_.micro_batches));
  }
  int micro_count(index_t batch) const {
    if (in_flight_ > 0) return in_flight_;  // in_flight_step checked that it divides
    try {
      return detail::micro_batch_count(batch, o_.micro_batches, staged, p_);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("whale::" + layer_name<P>() + ": " + e.what());
    }
  }
  void schedule_for(int m) {
    if (m == m_) return;
    rep_ = check_schedule<sched>(p_, m);
    actions_ = sched::actions(stage_, p_, m);
    // this rank's messages in the order every rank issues them (messenger): a training pass's and a forward-only one's
    const auto all = schedule_lists<sched>(p_, m), fwd = detail::forwards_of(all);
    const auto fr = detail::replay(fwd, p_, m, V);
    round_[1] = rep_.round[static_cast<std::size_t>(stage_)];
    round_[0] = fr.round[static_cast<std::size_t>(stage_)];
    ops_[1] = detail::message_order(all, rep_.round, p_, m, V, stage_);
    ops_[0] = detail::message_order(fwd, fr.round, p_, m, V, stage_);
    m_ = m;
  }

  double pass(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels, bool train, bool sync = true,
              tensor<float>* logits = nullptr);
  void keep_logits(tensor<float>& out, cview<float> y, int micro, int m);
  std::vector<weight_task>& weight_queue(int slot) {
    if (static_cast<std::size_t>(slot) >= wq_.size()) wq_.resize(static_cast<std::size_t>(slot) + 1);
    return wq_[static_cast<std::size_t>(slot)];
  }

  /// *out = the squares of g's `ranges`, each range summed where it lies and
  /// the sums added in order (owned_squares()'s bits), on the device; nothing read back.
  void squares_into(const std::vector<std::pair<index_t, index_t>>& ranges, const float* g, double* out) const {
    const auto n = static_cast<index_t>(ranges.size());
    if (!sq_parts_.data() || sq_parts_.numel() < std::max<index_t>(n, 1)) {  // (an empty tensor counts 1 element)
      const place_scope on(be_.memory());
      sq_parts_ = tensor<double>({std::max<index_t>(n, 1)}, mem_kind::workspace);
    }
    for (index_t k = 0; k < n; ++k) {
      const auto [at, count] = ranges[static_cast<std::size_t>(k)];
      be_.sum_squares_into(count, g + at, sq_parts_.data() + k);
    }
    be_.launch(1, kernels::sum_in_order{sq_parts_.data(), n, 1.0, out, false});  // one running sum, as owned_squares() adds
  }

  const context* ctx_;
  plan_options o_;
  program prog_;
  backend_ref be_;  // where this rank computes: every layer, weight pass and update (plan_options::backend)
  world_comm *pipe_ = nullptr, *data_ = nullptr, *model_comm_ = nullptr;
  // on a device: the communicators that take its buffers over the data and model
  // axes (plan_options::device_collectives); before everything whose requests they serve
  std::unique_ptr<device_comm> dev_data_, dev_model_;
  std::unique_ptr<device_comm> dev_world_;  // on a device, over the world: the gradient norm's sum (grad_sum_squares_into)
  mutable tensor<double> sq_parts_;         // on a device: each counted range's squares
  int p_ = 1, d_ = 1, stage_ = 0, replica_ = 0, model_rank_ = 0;
  std::vector<std::pair<index_t, index_t>> no_sync_;  // ranges split over data (filled while binding)
  std::vector<detail::tie_pair> ties_;               // tied heads and tables this rank holds (runtime/tie.hpp)
  bool tied_model_ = false;                          // the model has a tied head somewhere
  std::array<stage_type, V> parts_;                 // this rank's chunks (one without interleaving)
  std::array<index_t, V + 1> chunk_at_{};           // where each chunk starts in the local flat buffer
  tensor<float> params_, grads_;
  tensor<input_type> in_;        // a device: this pass's rows, copied up
  tensor<std::int32_t> labels_;  // and its labels
  detail::zero_engine zero_;
  detail::grad_sync sync_;
  detail::messenger msg_;
  int m_ = 0;
  schedule_report rep_;
  std::vector<pipe_action> actions_, fwd_only_;
  std::vector<int> round_[2];             // [training]: the replay's round of each of this rank's actions
  std::vector<detail::pipe_op> ops_[2];   // [training]: this rank's messages in the order every rank issues them
  std::vector<std::vector<weight_task>> wq_;  // per activation slot: the weight gradients its B put off
  std::size_t deferred_ = 0;
  std::vector<char> posted_;
  std::vector<index_t> batch_after_;
  int live_ = 0, peak_live_ = 0, max_slot_ = 0, step_ = 0;
  bool memory_checked_ = false;
  tracer tr_;
  bool trace_written_ = false;
  std::vector<double> replica_weights_;  // plan_options::balance: each replica's speed
  detail::slowdown_hooks slow_;          // plan_options::speeds: this rank's emulated slowness
  int in_flight_ = 0;                    // in_flight_step: its minibatches are the pass's micro-batches
  std::function<void(int)> micro_done_;  // in_flight_step: each minibatch's gradients are final
  std::vector<double> micro_shares_;     // in_flight_step: each minibatch's loss share
};

}  // namespace whale

#include "whale/runtime/diagnose.hpp"
#include "whale/runtime/gather.hpp"
#include "whale/runtime/memory_step.hpp"
#include "whale/runtime/setup.hpp"
#include "whale/runtime/step.hpp"
