// The part of executor<P> (runtime/executor.hpp) that does not depend on the
// model: compiled once per program, not once per plan. It holds what a rank's
// runtime owns whatever its layers are — the lowered program, the backend,
// the communicators, the ZeRO engine, the gradient buckets, the messenger, the
// schedule's state, the trace — and does what needs only those: the launch
// checks, lowering this rank's program, the batch split, the memory checks,
// the gradient norm, the loss sum. The plan's type tells it what it needs to
// know as values (plan_facts); executor<P> adds the layers and the steps.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "whale/backend/cpu.hpp"
#include "whale/comm/device_comm.hpp"
#include "whale/comm/trace.hpp"
#include "whale/detail/compiled.hpp"
#include "whale/optim/optimizer.hpp"
#include "whale/plan/lower.hpp"
#include "whale/plan/memory.hpp"
#include "whale/runtime/agree.hpp"
#include "whale/runtime/grad_norm.hpp"
#include "whale/runtime/grad_sync.hpp"
#include "whale/runtime/memory_check.hpp"
#include "whale/runtime/messenger.hpp"
#include "whale/runtime/options.hpp"
#include "whale/runtime/slowdown.hpp"
#include "whale/runtime/tie.hpp"
#include "whale/runtime/zero.hpp"

namespace whale::detail {

/// What the model-independent runtime knows of plan P, as values: its name and
/// description, and the choices its type fixes (executor<P> fills them).
struct plan_facts {
  std::string name;           // layer_name<P>()
  model_desc desc;            // describe<P>()
  int zero_level = 0;         // shard<M, L>: L
  int chunks = 1;             // model chunks per pipe rank (interleaved schedules: V)
  bool staged = false;        // a pipeline<...>
  bool replicated = false;    // replicate<...> or shard<...>
  bool has_split = false;     // a stage holds a split region
  bool splits_data = false;   // a split region over axis::data
  bool split_backward = false;   // the schedule puts weight gradients off to W passes (zb_h1)
  bool explicit_stages = false;  // pipeline<schedule, stage<...>...>
  int fixed_stages = 0;          // the stage count the type fixes; 0: any
  std::string schedule = "1f1b";  // the schedule's name (a pipeline's; 1f1b without one)
};

/// What a pass of the schedule does: train (forward and backward) or only
/// evaluate, and whether a training pass sums the gradients over the data axis.
struct pass_mode {
  bool train = true;
  bool data_sum = true;
};
/// A training step: gradients final on every rank (summed over data, or scattered by ZeRO 2-3).
inline constexpr pass_mode training_pass{true, true};
/// A training step without the data-axis sum: each replica keeps its own gradients.
inline constexpr pass_mode local_training_pass{true, false};
/// Forward passes only: the loss, or the logits.
inline constexpr pass_mode evaluation_pass{false, false};

/// executor<P>'s model-independent state and work (see the file's comment).
class executor_core {
 public:
  /// Tags 2j, 2j+1 of a pass's messages stay under MPI's guaranteed 32767.
  static constexpr int max_micro = 16000;

  executor_core(const executor_core&) = delete;
  executor_core& operator=(const executor_core&) = delete;

  /// Every stage of a replica feeds the same rows: the replica's slice of the
  /// global batch (even, or by speed with plan_options::balance).
  std::pair<index_t, index_t> local_batch(index_t global_batch) const;
  /// The replicas' weights in the batch split (empty: even); see plan_options::balance.
  const std::vector<double>& replica_weights() const noexcept { return replica_weights_; }
  /// Seconds this rank slept to emulate its slowness (plan_options::speeds).
  double emulated_wait_s() const noexcept { return slow_.waited_s(); }
  /// The memory check before the first training step's activations and
  /// communication buffers, with `data_bytes` of this rank's data-source
  /// buffers (counted on the CPU, where they share the memory), run once:
  /// the trainer runs it before it fetches the first batch (collective).
  void check_step_memory(const step_ctx& c, std::int64_t data_bytes = 0);
  /// This rank's part of the squared gradient norm, each parameter counted once
  /// over the world (no collective): their sum over the world is the norm squared.
  /// `within_replica` (ZeRO 0-1): once over this rank's data replica instead, to
  /// sum over the replica's pipe and model ranks (a virtual worker's own norm).
  double grad_squares(bool within_replica = false) const {
    if (within_replica && level_ >= 2)
      throw std::logic_error("whale::executor::grad_squares: ZeRO 2-3 spread a replica's gradients over the data axis");
    return level_ >= 2 ? owned_range_squares(prog_, zero_.shard_grads().data(), zero_.begin(), zero_.end(), be_)
                       : owned_squares(prog_, grads_.data(), within_replica, be_);
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
  void grad_sum_squares_into(double* out) const;
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
  memory_estimate predicted_memory(index_t global_batch, index_t seq, int optimizer_bytes_per_param = 8) const {
    const auto prog = lower(desc_, ctx_->mesh().shape(), ctx_->rank(), step_lowering(global_batch, seq, optimizer_bytes_per_param));
    return predict_memory(desc_, prog, o_);
  }

  /// Every rank's program of a step of `global_batch` sequences of `seq` tokens,
  /// lowered as predicted_memory lowers this rank's, for a replay of the whole
  /// step (plan/simulate.hpp: its time, its bytes between nodes). Pure.
  std::vector<program> step_programs(index_t global_batch, index_t seq) const {
    std::vector<program> all;
    for (int r = 0; r < ctx_->size(); ++r) all.push_back(lower(desc_, ctx_->mesh().shape(), r, step_lowering(global_batch, seq, 4)));
    return all;
  }
  /// The plan over the mesh, its stages (each virtual stage's layers), the
  /// data axis, the schedule and what this rank holds: executor<P>'s operator<<.
  void print(std::ostream& os) const;
  /// The plan's description (plan/describe.hpp), as lowering reads it.
  const model_desc& description() const noexcept { return desc_; }

  /// Optimizer state for the range this rank updates (runtime/executor_update.hpp, as the three below).
  template <class O> typename O::state make_optimizer_state(const O& opt) const;
  /// One optimizer step of this rank's range under `gate` (in the backend's memory: the gradients scaled by
  /// *gate.scale as they are read, nothing changed while *gate.halt is set); ZeRO 1–2 then all-gather the
  /// parameters. The host reads neither.
  template <class O> void apply_optimizer(const O& opt, typename O::state& st, kernels::update_gate gate);
  /// Scale the gradients (clipping), update this rank's range; ZeRO 1–2 then all-gather the parameters.
  template <class O> void apply_optimizer(const O& opt, typename O::state& st, float grad_scale);

  // ---- what this rank holds ----
  const program& placement() const noexcept { return prog_; }
  /// This rank's parameters and gradients: its stage's flat range [param_begin(), param_end())
  /// (parameters at ZeRO 3 and gradients at ZeRO 2-3: only the owned range, see range()).
  view<float> params() const noexcept { return level_ == 3 ? zero_.shard_params() : params_.v(); }
  view<float> grads() const noexcept { return level_ >= 2 ? zero_.shard_grads() : grads_.v(); }
  index_t param_count() const { return chunk_at_.back(); }
  /// The range this rank updates, relative to param_begin(): all, or its ZeRO range.
  std::pair<index_t, index_t> range() const {
    return level_ ? std::pair{zero_.begin(), zero_.end()} : std::pair<index_t, index_t>{0, param_count()};
  }
  index_t local_count() const { return range().second - range().first; }
  view<float> local_params() const { return level_ == 3 ? zero_.shard_params() : params_.v().rows(range().first, local_count()); }
  view<float> local_grads() const { return level_ >= 2 ? zero_.shard_grads() : grads_.v().rows(range().first, local_count()); }
  /// This stage's local parameters (param_count() floats) into `out`: collective at ZeRO level 3.
  void gather_params(view<float> out);
  int stage() const noexcept { return stage_; }
  int stages() const noexcept { return stages_; }
  int replicas() const noexcept { return replicas_; }
  int model_degree() const noexcept { return model_comm_->size(); }
  int chunks() const noexcept { return facts_.chunks; }
  int micro_batches() const noexcept { return order_.micro_batches; }
  int peak_live_micro_batches() const noexcept { return peak_live_; }
  int activation_slots_used() const noexcept { return max_slot_; }
  /// The order the last pass ran in (its actions, rounds and messages), and
  /// whether it was the step program's (program::order) rather than made alone.
  const pass_order& pass_order_run() const noexcept { return order_; }
  bool runs_program_order() const noexcept { return order_from_program_; }
  /// The replay of the schedule the last pass ran (peak live micro-batches, slots, bubble).
  const schedule_report& schedule_info() const noexcept { return order_.report; }
  /// Split schedules: the layers' weight-gradient computations the last training step put off to W passes.
  std::size_t deferred_weight_grads() const noexcept { return deferred_; }
  std::size_t bucket_count() const noexcept { return sync_.size(); }
  std::size_t comm_buffers() const noexcept { return zero_.comm_buffers(); }
  /// ZeRO-3: passes whose gather order differed from the one recorded for their kind.
  std::size_t gather_rerecords() const noexcept { return zero_.rerecords(); }
  const plan_options& options() const noexcept { return o_; }
  /// The number format of the plan's steps (plan_options::precision): the trainer trains in it.
  whale::precision precision() const noexcept { return o_.precision; }
  const tracer& trace() const noexcept { return tr_; }
  /// The recorder itself, for a loop around the executor that records spans of its own (wsp_trainer).
  tracer& trace_recorder() noexcept { return tr_; }
  /// Gather every rank's spans (collective over the world), write the Chrome
  /// trace to options().trace_path on rank 0 if set, and return the merged events.
  std::vector<trace_event> finish_trace() {
    auto ev = gather_trace(ctx_->world(), tr_);
    trace_written_ = true;
    if (ctx_->rank() == 0 && !o_.trace_path.empty()) write_trace(o_.trace_path, ev);
    return ev;
  }

 protected:
  /// The launch checks (every rank alike, before any collective of the plan) and the communicators.
  executor_core(const context& ctx, plan_options o, plan_facts facts);
  /// Once the split regions have checked their own degrees (executor<P>): the
  /// options that need them checked, an unequal ranks' stage cut, this rank's program.
  void lower_program();
  /// full_params() from this rank's unsplit parameters `mine`, its chunks' of
  /// `chunk_sizes` one after another: every rank's chunks gathered over the
  /// pipe axis and put in virtual-stage order (chunk c of rank r is c·p + r).
  tensor<float> all_stages_params(tensor<float> mine, const std::vector<index_t>& chunk_sizes) const;
  /// Writes the trace if a path was given and finish_trace() was not called (collective).
  ~executor_core() {
    if (!o_.trace_path.empty() && !trace_written_ && std::uncaught_exceptions() == 0) {
      try {
        finish_trace();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "whale: rank %d: %s\n", ctx_->rank(), e.what());
      }
    }
  }

  /// "whale::<plan>: ", the start of every message of the runtime.
  std::string who() const { return "whale::" + facts_.name + ": "; }
  /// The lowering options of this rank's placement: p micro-batches of one
  /// sequence per replica, valid for every schedule (rows do not matter here).
  lower_options placement_lowering() const {
    lower_options lo = lowering_of(o_, replicas_ * stages_);
    lo.micro_batches = facts_.staged ? stages_ : 0;
    return lo;
  }
  /// The lowering options of real steps (the memory checks before the
  /// parameters and before the first step's activations use them).
  lower_options step_lowering(index_t global_batch, index_t seq, int optimizer_bytes_per_param) const {
    lower_options lo = lowering_of(o_, global_batch, seq);
    lo.replica_weights = replica_weights_;
    lo.optimizer_bytes_per_param = optimizer_bytes_per_param;
    return lo;
  }
  void check_state_memory(const program_totals& held, index_t n) const;
  /// plan_options::balance under memory caps: replicas whose predicted step of
  /// plan_batch rows would pass a rank's cap get only the rows that fit; the
  /// others share the rest by speed (collective over the world).
  void fit_rows_to_caps();
  /// Once the chunks are placed (chunk_at_ filled): the parameter count the
  /// program holds is the runtime's, the tied heads' tables are found, and the
  /// state fits this node's memory and its caps.
  void check_placement();
  /// After binding: the program's gradient buckets, which must cover exactly
  /// the ranges binding found summed over data; the pipeline's messages; the trace.
  void finish_setup();
  /// The order passes of m micro-batches run in: that of the step's program
  /// (lowered for the first training step's memory check; its order is kept) when it has m
  /// micro-batches, else made alone by the same function (pass_order_of).
  /// Throws, naming the stages, if the schedule cannot run them.
  void order_for(int m);
  /// What a pass asks of this rank's chunk `ch` (executor<P> answers with its
  /// layers): its message widths and where its parameters begin; the forward
  /// of micro-batch `micro` (of mb sequences; the pass's own rows on the first
  /// stage, `in` elsewhere) to its output, its loss or its logits; the backward.
  virtual index_t chunk_in_width(int ch) const = 0;
  virtual index_t chunk_out_width(int ch) const = 0;
  virtual index_t chunk_begin(int ch) const = 0;
  virtual view<float> chunk_forward(int ch, step_ctx& c, int micro, index_t mb, cview<float> in) = 0;
  virtual double chunk_forward_loss(int ch, step_ctx& c, int micro, index_t mb, cview<float> in, cview<std::int32_t> labels) = 0;
  virtual view<float> chunk_logits(int ch, step_ctx& c, int micro, index_t mb, cview<float> in) = 0;
  virtual view<float> chunk_backward(int ch, step_ctx& c, cview<float> dy) = 0;
  /// The layers of virtual stage `vstage` (of stages() x chunks()), for print().
  virtual std::string stage_description(int vstage) const = 0;
  /// (runtime/pass.hpp) What a pass refuses before it starts: gradients
  /// accumulated across calls where they cannot be, a data-axis sum of worker cuts.
  void check_pass(const step_ctx& c, pass_mode mode) const;
  /// (runtime/pass.hpp) One pass of m micro-batches under the schedule (the
  /// input rows are executor<P>'s): this rank's share of the loss.
  double run_pass(step_ctx& c, int m, cview<std::int32_t> labels, pass_mode mode, tensor<float>* logits,
                  const std::array<step_ctx::host_mirror, 2>& mirrors);
  /// forward(): micro-batch `micro`'s logits `y` into `out` (host memory).
  void keep_logits(tensor<float>& out, cview<float> y, int micro, int m);
  /// apply_optimizer(opt, st, gate) that also writes the step's change into `delta` (ZeRO 0; executor<P> offers it there).
  template <class O>
  void apply_optimizer_with_delta(const O& opt, typename O::state& st, kernels::update_gate gate, kernels::update_delta delta);
  /// The ZeRO engine's settings, from the plan's options.
  zero_engine::options zero_engine_options() const { return {o_.bucket_mib, o_.prefetch, o_.max_pending, o_.bf16_reduce}; }
  /// Rows [first, first + count) of `global_batch` that replica `replica` takes.
  std::pair<index_t, index_t> slice(index_t global_batch, int replica) const {
    return weighted_slice(global_batch, replicas_, replica, replica_weights_, std::max(1, o_.micro_batches));
  }
  /// The micro-batches of a pass of `batch` sequences on this rank.
  int micro_count(index_t batch) const {
    if (in_flight_ > 0) return in_flight_;  // in_flight_step checked that it divides
    try {
      return micro_batch_count(batch, o_.micro_batches, facts_.staged, stages_, facts_.chunks);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(who() + e.what());
    }
  }
  std::vector<weight_task>& weight_queue(int slot) {
    if (static_cast<std::size_t>(slot) >= weight_queues_.size()) weight_queues_.resize(static_cast<std::size_t>(slot) + 1);
    return weight_queues_[static_cast<std::size_t>(slot)];
  }
  /// *out = the squares of g's `ranges`, each range summed where it lies and
  /// the sums added in order (owned_squares()'s bits), on the device; nothing read back.
  void squares_into(const std::vector<std::pair<index_t, index_t>>& ranges, const float* g, double* out) const;

  const context* ctx_;
  plan_options o_;
  plan_facts facts_;
  const int level_;   // facts_.zero_level
  const model_desc& desc_ = facts_.desc;
  program prog_;
  backend_ref be_;  // where this rank computes: every layer, weight pass and update (plan_options::backend)
  world_comm *pipe_ = nullptr, *data_ = nullptr, *model_comm_ = nullptr;
  // on a device: the communicators that take its buffers over the data and model
  // axes (plan_options::device_collectives); before everything whose requests they serve
  std::unique_ptr<device_comm> dev_data_, dev_model_;
  std::unique_ptr<device_comm> dev_world_;  // on a device, over the world: the gradient norm's sum (grad_sum_squares_into)
  mutable tensor<double> sq_parts_;         // on a device: each counted range's squares
  int stages_ = 1, replicas_ = 1, stage_ = 0, replica_ = 0, model_rank_ = 0;
  std::vector<std::pair<index_t, index_t>> no_sync_;  // ranges split over data (filled while binding)
  std::vector<tie_pair> ties_;                       // tied heads and tables this rank holds (runtime/tie.hpp)
  bool tied_model_ = false;                          // the model has a tied head somewhere
  std::vector<index_t> chunk_at_;                    // where each chunk starts in the local flat buffer (chunks + 1)
  tensor<float> params_, grads_;
  zero_engine zero_;
  grad_sync sync_;
  messenger msg_;
  pass_order step_order_;         // the order of the training step's program (lowered by its memory check)
  pass_order order_;              // what passes of order_.micro_batches run: actions, rounds, messages
  bool order_from_program_ = false;  // order_ is step_prog_'s
  std::vector<std::vector<weight_task>> weight_queues_;  // per activation slot: the weight gradients its B put off
  std::size_t deferred_ = 0;
  std::vector<char> posted_;
  std::vector<index_t> batch_after_;
  int live_ = 0, peak_live_ = 0, max_slot_ = 0, step_ = 0;
  bool memory_checked_ = false;
  tracer tr_;
  bool trace_written_ = false;
  std::vector<double> replica_weights_;  // plan_options::balance: each replica's speed
  slowdown_hooks slow_;                  // plan_options::speeds: this rank's emulated slowness
  int in_flight_ = 0;                    // in_flight_step: its minibatches are the pass's micro-batches
  std::function<void(int)> micro_done_;  // in_flight_step: each minibatch's gradients are final
  std::vector<double> micro_shares_;     // in_flight_step: each minibatch's loss share
};

}  // namespace whale::detail

#include "whale/runtime/executor_update.hpp"
#if WHALE_CORE_DEFINITIONS  // header-only, or the compiled core's own unit (detail/compiled.hpp)
#include "whale/runtime/executor_core_impl.hpp"
#include "whale/runtime/executor_memory_impl.hpp"
#include "whale/runtime/pass.hpp"
#endif
