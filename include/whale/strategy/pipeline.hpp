// `stage<L...>` and `pipeline<Schedule, ...>` (the types), and `pipelined<P>`,
// the runtime of pipeline parallelism over the mesh's `pipe` axis (and of
// `replicate<pipeline<...>>` over data × pipe). Each rank holds only its own
// stage's parameters; activations go forward and their gradients backward by
// non-blocking point-to-point messages; micro-batches run under the Schedule
// (strategy/schedule.hpp), and every step ends with a flush, so one step equals
// single-process training on the same global batch. Stages may hold `split`
// regions over the model axis (3-D parallelism: data × pipe × model): each
// model rank of a stage holds its shards, activations between stages are
// replicated over the model axis, and stage s, model rank m talks to stage
// s±1, model rank m over the pipe communicator.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "whale/backend/cpu.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/nn/layer.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/strategy/data_parallel.hpp"
#include "whale/strategy/hybrid.hpp"
#include "whale/strategy/replicate.hpp"
#include "whale/strategy/schedule.hpp"
#include "whale/strategy/split.hpp"
#include "whale/comm/trace.hpp"

namespace whale {

namespace detail {
template <class> inline constexpr bool stage_misplaced = false;
}  // namespace detail

/// Consecutive layers that run on one coordinate of the pipe axis. Only
/// meaningful as a direct element of `pipeline<Schedule, stage<...>, ...>`;
/// anywhere else (a sequential, a network, make) it does not compile.
template <class... L>
struct stage : sequential<L...> {
  using layers = sequential<L...>;
  static std::string name() { return "stage<" + layers::name().substr(11); }
  /// Poisoned: a stage is bound only by its pipeline, which binds `layers`.
  template <class Use = void> void bind(param_binder&) {
    static_assert(detail::stage_misplaced<Use>,
                  "whale::stage: a stage may only be a direct element of whale::pipeline<Schedule, "
                  "stage<...>, stage<...>, ...> (it runs on its own rank of the pipe axis); outside a "
                  "pipeline use sequential<...> instead");
  }
};

template <class T> struct is_stage : std::false_type {};
template <class... L> struct is_stage<stage<L...>> : std::true_type {};
template <class T> inline constexpr bool is_stage_v = is_stage<T>::value;

namespace detail {
template <class T> struct pipe_is_repeat : std::false_type {};
template <std::size_t N, class B> struct pipe_is_repeat<repeat<N, B>> : std::true_type {};
template <class T> inline constexpr bool pipe_is_repeat_v = pipe_is_repeat<T>::value;

template <class T> struct tuple_types;
template <class... E> struct tuple_types<std::tuple<E...>> {
  static constexpr std::size_t n = sizeof...(E);
  static constexpr std::array<bool, n> repeats{pipe_is_repeat_v<E>...};
  static constexpr std::size_t repeat_count = (std::size_t{0} + ... + (pipe_is_repeat_v<E> ? 1 : 0));
  static constexpr std::size_t repeat_index = [] {
    for (std::size_t i = 0; i < n; ++i)
      if (repeats[i]) return i;
    return n;
  }();
  /// Width flowing into element i (any_features while unknown).
  static constexpr std::array<index_t, n> in_width = [] {
    constexpr std::array<index_t, n> ins{E::in_features...};
    constexpr std::array<index_t, n> outs{E::out_features...};
    std::array<index_t, n> w{};
    index_t cur = any_features;
    for (std::size_t i = 0; i < n; ++i) {
      if (cur == any_features) cur = ins[i];
      w[i] = cur;
      if (outs[i] != any_features) cur = outs[i];
    }
    return w;
  }();
};

template <class M> concept pipe_sequential_like = requires { typename M::tuple_type; M::size; };

/// Split regions anywhere in a model (through sequentials, repeats, residuals,
/// replicate and other wrappers): `any`, and `data` if one splits over axis::data.
struct split_scan {
  bool any = false, data = false;
};
template <class M> constexpr split_scan pipe_splits();
template <class M> struct pipe_split_of : std::false_type {};
template <class M, axis A, index_t D> struct pipe_split_of<split<M, A, D>> : std::true_type {
  static constexpr bool over_data = A == axis::data;
};
template <class... L> constexpr split_scan pipe_splits_all(tlist<L...>) {
  split_scan r;
  ((r.any = r.any || pipe_splits<L>().any, r.data = r.data || pipe_splits<L>().data), ...);
  return r;
}
template <class... I> constexpr split_scan pipe_splits_residual(const residual<I...>*) {
  return pipe_splits_all(tlist<I...>{});
}
template <class M> constexpr split_scan pipe_splits() {
  if constexpr (pipe_split_of<M>::value) return {true, pipe_split_of<M>::over_data};
  else if constexpr (requires { pipe_splits_residual(static_cast<const M*>(nullptr)); })
    return pipe_splits_residual(static_cast<const M*>(nullptr));
  else if constexpr (sequential_like<M>) return pipe_splits_all(elements_of<M>{});
  else if constexpr (requires { typename M::block_type; }) return pipe_splits<typename M::block_type>();
  else if constexpr (requires { typename M::inner; }) return pipe_splits<typename M::inner>();
  else return {};
}

template <bool Explicit, class... Parts> struct pipeline_flat;
template <class... S> struct pipeline_flat<true, S...> {
  using type = sequential<typename S::layers...>;
};
template <class M> struct pipeline_flat<false, M> {
  static_assert(pipe_sequential_like<M>,
                "whale::pipeline: give the stages explicitly (pipeline<Schedule, stage<...>, stage<...>>) "
                "or one model that is a sequential with one repeat<N, Block> among its elements "
                "(pipeline<Schedule, models::gpt>), whose blocks the pipeline cuts into stages");
  static_assert(!pipe_split_of<M>::value,
                "whale::pipeline<Schedule, split<M>>: the pipeline cannot cut one split region around the whole "
                "model; split its elements instead (e.g. sequential<split<embedding<V, D>>, ..., repeat<N, "
                "split<Block>>, ..., split<linear<D, V>>, softmax_cross_entropy>), which trains the same");
  using type = M;
};
}  // namespace detail

/// Pipeline parallelism over the mesh's pipe axis, in two forms:
///  * pipeline<Schedule, stage<A...>, stage<B...>, ...>: stage s on pipe
///    coordinate s. Trains exactly as sequential<sequential<A...>, sequential<B...>, ...>
///    (same parameters, same initialisation); the last stage ends in the loss.
///  * pipeline<Schedule, M>, M a sequential with one repeat<N, Block> among its
///    elements (e.g. models::gpt): the repeat's blocks are cut into as many
///    stages as the pipe axis has ranks, at run time (balanced by cost, or
///    pipeline_options::blocks); elements before the repeat join the first
///    stage, those after it (head, loss) the last. Trains exactly as M.
/// The type behaves as that flat model (a Loss); `make` builds its runtime.
template <class Sched, class... Parts>
struct pipeline : detail::pipeline_flat<(is_stage_v<Parts> && ...), Parts...>::type {
  static_assert(Schedule<Sched>,
                "whale::pipeline: the first argument must be a schedule (whale::gpipe, whale::one_f_one_b, "
                "or a class with static name() and actions(stage, stages, micro_batches))");
  static_assert(sizeof...(Parts) > 0, "whale::pipeline: give at least one stage");
  static_assert((is_stage_v<Parts> && ...) || sizeof...(Parts) == 1,
                "whale::pipeline: either every element after the schedule is a stage<...>, or there is "
                "exactly one model (a sequential containing one repeat<N, Block>)");
  static constexpr bool explicit_stages = (is_stage_v<Parts> && ...);
  using schedule = Sched;
  using flat = typename detail::pipeline_flat<explicit_stages, Parts...>::type;
  static_assert(Loss<flat>,
                "whale::pipeline: the last stage (or the model) must end in a loss (e.g. softmax_cross_entropy)");
  using elements = detail::tuple_types<typename flat::tuple_type>;
  static_assert(explicit_stages || elements::repeat_count == 1,
                "whale::pipeline<Schedule, M>: M must contain exactly one repeat<N, Block> among its "
                "elements (the blocks the pipeline cuts into stages); otherwise list the stages explicitly");
  /// Stages fixed by the type (explicit form), or 0 (as many as the pipe axis).
  static constexpr int fixed_stages = explicit_stages ? static_cast<int>(sizeof...(Parts)) : 0;
  static std::string name() {
    if constexpr (explicit_stages) {
      std::string s = "pipeline<" + Sched::name();
      ((s += ", " + Parts::name()), ...);
      return s + ">";
    } else {
      return "pipeline<" + Sched::name() + ", " + (layer_name<Parts>() + ...) + ">";
    }
  }
};

template <class T> struct is_pipeline : std::false_type {};
template <class S, class... P> struct is_pipeline<pipeline<S, P...>> : std::true_type {};
template <class T> inline constexpr bool is_pipeline_v = is_pipeline<T>::value;
/// pipeline<...> or replicate<pipeline<...>> (any nesting of replicate).
template <class T> inline constexpr bool is_pipeline_plan_v = is_pipeline_v<strip_replicate_t<T>>;

/// Run-time choices of a pipeline.
struct pipeline_options {
  /// Micro-batches per step (m). 0: the largest divisor of the per-replica
  /// batch that is at most 4 × stages.
  int micro_batches = 0;
  /// pipeline<S, M> only: blocks of the repeat on each stage (one count per
  /// stage, summing to N; uneven allowed; inner stages need at least one).
  /// Empty: balanced by the layers' cost metadata.
  std::vector<int> blocks;
  /// Tokens of context assumed when weighing attention's cost for balancing.
  index_t balance_seq = 128;
  /// Record a timeline (spans per micro-batch, sends, receives, all-reduce, optimizer).
  bool trace = false;
  /// Write the merged Chrome trace JSON here when the runtime finishes (implies trace).
  std::string trace_path;
  /// replicate<pipeline<...>>: the data-parallel gradient all-reduce.
  dp_options dp = dp_options::from_env();

  /// WHALE_MICRO_BATCHES, WHALE_STAGE_BLOCKS ("1,3"), WHALE_TRACE (a path).
  static pipeline_options from_env() {
    pipeline_options o;
    if (const char* e = std::getenv("WHALE_MICRO_BATCHES")) o.micro_batches = parse_int(e, "WHALE_MICRO_BATCHES");
    if (const char* e = std::getenv("WHALE_STAGE_BLOCKS")) o.blocks = parse_list(e, "WHALE_STAGE_BLOCKS");
    if (const char* e = std::getenv("WHALE_TRACE"); e && *e) o.trace_path = e;
    return o;
  }
  /// from_env(), then --micro-batches M, --stage-blocks 1,3 and --trace PATH,
  /// which are removed from argv (argv[argc] stays nullptr).
  static pipeline_options from_args(int& argc, char** argv) {
    pipeline_options o = from_env();
    int out = argc > 0 ? 1 : 0;
    for (int i = out; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument("whale::pipeline: " + a + " needs a value");
        return argv[++i];
      };
      if (a == "--micro-batches") o.micro_batches = parse_int(value(), "--micro-batches");
      else if (a == "--stage-blocks") o.blocks = parse_list(value(), "--stage-blocks");
      else if (a == "--trace") o.trace_path = value();
      else argv[out++] = argv[i];
    }
    argc = out;
    if (argv) argv[argc] = nullptr;
    return o;
  }
  static int parse_int(const std::string& v, const char* origin) {
    char* end = nullptr;
    const long n = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || n < 0 || n > 1 << 20)
      throw std::invalid_argument(std::string("whale::pipeline: ") + origin + " " + v +
                                  ": expected a non-negative integer");
    return static_cast<int>(n);
  }
  static std::vector<int> parse_list(const std::string& v, const char* origin) {
    std::vector<int> r;
    std::size_t at = 0;
    while (at <= v.size()) {
      auto end = v.find(',', at);
      if (end == std::string::npos) end = v.size();
      r.push_back(parse_int(v.substr(at, end - at), origin));
      at = end + 1;
    }
    return r;
  }
};

/// The runtime of a pipeline plan P (pipeline<...> or replicate<pipeline<...>>):
/// a `Trainable` for `trainer`. Built on every rank by make<P>(ctx, seed).
///
/// Each step: the per-replica batch is cut into m micro-batches; stage s runs
/// its Schedule's actions; forward j receives stage s-1's activation j (or
/// reads the tokens, on stage 0) and sends its output on; backward j receives
/// stage s+1's d(activation) (or starts from the loss, on the last stage) and
/// sends d(input) back. Receives are posted as soon as their activation slot is
/// free, sends never block (they copy into a pool), and all are complete when
/// the step returns. Gradients accumulate over micro-batches (step_ctx::accumulate)
/// and, with replicate, are all-reduced over the data axis in buckets while the
/// last backward runs.
template <class P>
class pipelined {
 public:
  using model_type = P;
  using pipe_type = strip_replicate_t<P>;
  static_assert(is_pipeline_v<pipe_type>,
                "whale::pipelined: the plan must be pipeline<...> or replicate<pipeline<...>>");
  using flat = typename pipe_type::flat;
  using sched = typename pipe_type::schedule;
  using input_type = typename flat::input_type;
  static constexpr bool replicated = is_replicate_v<P>;
  /// Stages hold split regions (over the model axis).
  static constexpr bool has_split = detail::pipe_splits<flat>().any;
  static_assert(!detail::pipe_splits<flat>().data,
                "whale::pipeline: split regions over axis::data are not supported inside pipeline stages (the "
                "batch is cut into micro-batches there); split over axis::model inside stages, and replicate the "
                "pipeline for data parallelism");

 private:
  using E = typename pipe_type::elements;
  static constexpr std::size_t n_elems = E::n;
  static constexpr std::size_t loss_index = n_elems - 1;
  static constexpr std::size_t rep_index = pipe_type::explicit_stages ? n_elems : E::repeat_index;
  static constexpr int max_micro = 16000;  // tags 2j, 2j+1 stay under MPI's guaranteed 32767

 public:
  pipelined(const context& ctx, seed s, pipeline_options o = pipeline_options::from_env())
      : ctx_(&ctx), o_(std::move(o)) {
    const auto& shape = ctx.mesh().shape();
    p_ = shape.size(axis::pipe);
    d_ = shape.size(axis::data);
    stage_ = ctx.mesh().coord(axis::pipe);
    replica_ = ctx.mesh().coord(axis::data);
    validate(shape);  // every rank, before any communication
    pipe_ = &ctx.mesh().comm(axis::pipe);
    data_ = &ctx.mesh().comm(axis::data);
    model_comm_ = &ctx.mesh().comm(axis::model);
    model_rank_ = ctx.mesh().coord(axis::model);
    if constexpr (has_split) {  // split regions learn their communicators before parameters are counted
      split_env env;
      env.data = data_;
      env.model = model_comm_;
      env.no_data_sync = &no_sync_;
      configure_layer(model_, env);
    }
    place();
    if (o_.micro_batches > 0) schedule_for(o_.micro_batches);  // a bad schedule fails here, on every rank
    params_ = tensor<float>({end_ - begin_}, mem_kind::params);
    grads_ = tensor<float>({end_ - begin_}, mem_kind::grads);
    bind_and_init(s);
    if (!no_sync_.empty())  // only splits over the data axis register these; they are refused above
      throw std::logic_error("whale::pipeline: a split region registered parameters without data-axis sync");
    count_for_norm();
    if constexpr (replicated) {
      if (d_ > 1) broadcast(*data_, params_.v(), 0);  // identical start in every replica
      make_buckets();
    }
    if (o_.trace || !o_.trace_path.empty()) {
      tr_.enable(ctx.rank(), stage_, replica_);
      barrier(ctx.world());
      tr_.set_origin();
    }
  }
  pipelined(const pipelined&) = delete;
  pipelined& operator=(const pipelined&) = delete;
  /// Writes the trace if a path was given and finish_trace() was not called (collective).
  ~pipelined() {
    if (!o_.trace_path.empty() && !trace_written_ && std::uncaught_exceptions() == 0) {
      try {
        finish_trace();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "whale: rank %d: %s\n", ctx_->rank(), e.what());
      }
    }
  }

  // ---- Trainable ----
  /// Every stage of a replica feeds the same rows: the replica's even slice.
  std::pair<index_t, index_t> local_batch(index_t global_batch) const {
    if (global_batch < d_)
      throw std::invalid_argument("whale::replicate<pipeline>: the global batch (" + std::to_string(global_batch) +
                                  ") is smaller than the data-parallel degree (" + std::to_string(d_) + ")");
    for (int r = 0; r < d_; ++r) micro_count(even_slice(global_batch, d_, r).second);  // same check everywhere
    return even_slice(global_batch, d_, replica_);
  }

  /// One step: every micro-batch forward and backward under the schedule; the
  /// stage's gradients are final (and summed over the data axis) when it returns.
  /// Returns this rank's share of the loss (0 except on the last stage).
  double train_step(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) {
    const index_t B = c.batch, T = c.seq;
    const int m = micro_count(B);
    schedule_for(m);
    if (x.shape().rank() == 0 || x.shape()[0] != B)
      throw std::invalid_argument("whale::pipeline: the input has " +
                                  std::to_string(x.shape().rank() ? x.shape()[0] : 0) + " rows but step_ctx says " +
                                  std::to_string(B) + " sequences");
    const index_t mb = B / m, rows = mb * T;
    const auto& slot = rep_.slot[static_cast<std::size_t>(stage_)];
    const auto& free_at = rep_.free_at[static_cast<std::size_t>(stage_)];
    const int n_slots = rep_.peak_live[static_cast<std::size_t>(stage_)];
    const bool first = stage_ == 0, last = stage_ == p_ - 1;
    if (!first) {
      xin_.resize(static_cast<std::size_t>(n_slots));
      for (auto& t : xin_) detail::ensure(t, {rows, in_width_}, mem_kind::activations);
    }
    if (!last) {
      gin_.resize(static_cast<std::size_t>(n_slots));
      for (auto& t : gin_) detail::ensure(t, {rows, out_width_}, mem_kind::comm);
    }
    act_req_.clear(), grad_req_.clear();
    act_req_.resize(static_cast<std::size_t>(m)), grad_req_.resize(static_cast<std::size_t>(m));
    std::vector<char> posted(static_cast<std::size_t>(m), 0);
    next_ = 0;

    double share = 0;
    int backwards = 0;
    const auto& acts = actions_;
    for (std::size_t k = 0; k < acts.size(); ++k) {
      // Post the receives of every micro-batch whose slot is free by now.
      for (int j = 0; j < m; ++j) {
        const auto ju = static_cast<std::size_t>(j);
        if (posted[ju] || free_at[ju] > static_cast<int>(k)) continue;
        posted[ju] = 1;
        const auto sl = static_cast<std::size_t>(slot[ju]);
        if (!first) act_req_[ju].emplace(pipe_->irecv(xin_[sl].data(), rows * in_width_, dtype::f32, stage_ - 1, 2 * j));
        if (!last) grad_req_[ju].emplace(pipe_->irecv(gin_[sl].data(), rows * out_width_, dtype::f32, stage_ + 1, 2 * j + 1));
      }
      const auto a = acts[k];
      const auto ju = static_cast<std::size_t>(a.micro);
      step_ctx mc;
      mc.batch = mb;
      mc.seq = T;
      mc.global_rows = c.global_rows > 0 ? c.global_rows : B * T;
      mc.slot = slot[ju];
      mc.hooks = c.hooks;
      if (a.kind == pipe_action::forward) {
        cview<float> in;
        if (!first) {
          const auto t0 = tr_.now();
          act_req_[ju]->wait();
          tr_.add(span_kind::recv_act, step_, a.micro, t0, tr_.now());
          in = xin_[static_cast<std::size_t>(slot[ju])].v();
        }
        const auto t0 = tr_.now();
        cview<input_type> x0;
        if (first) x0 = x.rows(a.micro * mb, mb);
        view<float> y;
        if (last) share += stage_forward_loss(mc, x0, in, labels.rows(a.micro * rows, rows));
        else y = stage_forward(mc, x0, in);
        tr_.add(span_kind::forward, step_, a.micro, t0, tr_.now());
        if (!last) post_send(y, stage_ + 1, 2 * a.micro, span_kind::send_act, a.micro);
        peak_live_ = std::max(peak_live_, ++live_);
        max_slot_ = std::max(max_slot_, mc.slot + 1);
      } else {
        cview<float> dy;
        if (!last) {
          const auto t0 = tr_.now();
          grad_req_[ju]->wait();
          tr_.add(span_kind::recv_grad, step_, a.micro, t0, tr_.now());
          dy = gin_[static_cast<std::size_t>(slot[ju])].v();
        }
        mc.accumulate = backwards > 0;
        const bool final_backward = ++backwards == m;
        if constexpr (replicated)
          if (final_backward && d_ > 1 && o_.dp.overlap) mc.grads_ready = [this](index_t off) { on_ready(off); };
        const auto t0 = tr_.now();
        auto dx = stage_backward(mc, dy);
        tr_.add(span_kind::backward, step_, a.micro, t0, tr_.now());
        if (!first) post_send(dx, stage_ - 1, 2 * a.micro + 1, span_kind::send_grad, a.micro);
        --live_;
      }
      progress();
    }
    for (auto& ob : outbox_)
      if (ob.req) ob.req->wait(), ob.req.reset();
    if constexpr (replicated) {
      if (d_ > 1) {
        const auto t0 = tr_.now();
        on_ready(begin_);  // launch what is left
        for (auto& b : buckets_) b.req->wait();
        tr_.add(span_kind::grad_all_reduce, step_, -1, t0, tr_.now());
      }
    }
    ++step_;
    return share;
  }

  /// The global mean loss: the last stages' shares summed over the world
  /// (model rank 0 only: the model ranks of a stage hold the same loss).
  double reduce_loss(double share) {
    const auto t0 = tr_.now();
    double v = model_rank_ == 0 ? share : 0.0;
    all_reduce(ctx_->world(), view<double>(&v, {1}));
    tr_.add(span_kind::loss_all_reduce, step_ - 1, -1, t0, tr_.now());
    return v;
  }
  /// The norm of the whole model's gradient, the same on every rank: stages'
  /// squares summed over the pipe axis, shards' over the model axis, parameters
  /// replicated over data or model counted once (collective: one all-reduce
  /// of one double over the world).
  double grad_norm() const { return detail::global_grad_norm(grads_.data(), begin_, counted_, &ctx_->world()); }
  int rank() const noexcept { return ctx_->rank(); }
  int world_size() const noexcept { return ctx_->size(); }
  template <class O> typename O::state make_optimizer_state(const O& opt) const {
    return opt.make_state(params_.numel());
  }
  template <class O> void apply_optimizer(const O& opt, typename O::state& st, float grad_scale) {
    const auto t0 = tr_.now();
    if (grad_scale != 1.f) cpu::scale(grads_.numel(), grad_scale, grads_.data());
    opt.update(st, params_.v(), grads_.v());
    tr_.add(span_kind::optimizer, step_ - 1, -1, t0, tr_.now());
  }

  // ---- what this rank holds ----
  int stage() const noexcept { return stage_; }
  int stages() const noexcept { return p_; }
  int replicas() const noexcept { return d_; }
  /// This stage's parameters: elements [param_begin(), param_end()) of the flat model's.
  view<float> params() const noexcept { return params_.v(); }
  view<float> grads() const noexcept { return grads_.v(); }
  index_t param_count() const noexcept { return params_.numel(); }
  index_t param_begin() const noexcept { return begin_; }
  index_t param_end() const noexcept { return end_; }
  /// Parameters of the whole model (all stages; with split regions, of this model rank's shards).
  index_t total_params() const noexcept { return total_; }
  /// This stage's range of the unsplit flat model's parameters (as network<unsplit
  /// model> holds them); equal to [param_begin(), param_end()) without split regions.
  index_t full_param_begin() const noexcept { return full_begin_; }
  index_t full_param_end() const noexcept { return full_end_; }
  /// Ranks of the model axis that share this stage's split regions.
  int model_degree() const noexcept { return model_comm_->size(); }
  /// This stage's unsplit parameters, [full_param_begin(), full_param_end()) of
  /// the unsplit model, gathered from the shards; collective over the model axis
  /// (every rank calls it).
  tensor<float> full_params() {
    tensor<float> full({full_end_ - full_begin_}, mem_kind::workspace);
    for_elems([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      if (!owns(I)) return;
      auto& e = model_.template get<I>();
      if constexpr (I == rep_index) {
        using R = std::remove_cvref_t<decltype(e)>;
        constexpr index_t per = R::block_type::cost().params;
        for (int k = first_block_[static_cast<std::size_t>(stage_)]; k < first_block_[static_cast<std::size_t>(stage_) + 1]; ++k)
          gather_full_params(e.block(static_cast<std::size_t>(k)), params_.data() + (block_offset(k) - begin_),
                             full.data() + (full_off_[I] + k * per - full_begin_));
      } else {
        gather_full_params(e, params_.data() + (off_[I] - begin_), full.data() + (full_off_[I] - full_begin_));
      }
    });
    return full;
  }
  /// Blocks of the repeat on each stage (pipeline<S, M>), or one per stage (explicit form).
  const std::vector<int>& stage_blocks() const noexcept { return blocks_; }
  /// Micro-batches of the last step (0 before the first).
  int micro_batches() const noexcept { return m_; }
  /// Most micro-batches whose activations were alive at once on this stage, and
  /// the activation slots used, over all steps so far (counted while running).
  int peak_live_micro_batches() const noexcept { return peak_live_; }
  int activation_slots_used() const noexcept { return max_slot_; }
  /// The schedule's replay for the current micro-batch count.
  const schedule_report& schedule_info() const noexcept { return rep_; }
  const pipeline_options& options() const noexcept { return o_; }
  const tracer& trace() const noexcept { return tr_; }

  /// Gather every rank's spans (collective over the world), write the Chrome
  /// trace to options().trace_path on rank 0 if set, and return the merged events.
  std::vector<trace_event> finish_trace() {
    auto ev = gather_trace(ctx_->world(), tr_);
    trace_written_ = true;
    if (ctx_->rank() == 0 && !o_.trace_path.empty()) write_trace(o_.trace_path, ev);
    return ev;
  }

  friend std::ostream& operator<<(std::ostream& os, const pipelined& n) {
    os << "plan: " << layer_name<P>() << " over " << n.ctx_->mesh().shape() << "\n"
       << "  pipeline: " << n.p_ << " stage(s) on the pipe axis, schedule " << sched::name() << ", micro-batches "
       << (n.o_.micro_batches ? std::to_string(n.o_.micro_batches) : std::string("auto (<= 4 x stages)")) << "\n";
    if constexpr (replicated)
      os << "  data parallel: " << n.d_ << " replica(s), stage gradients all-reduced over data in buckets of <= "
         << n.o_.dp.bucket_mib << " MiB\n";
    if constexpr (has_split)
      os << "  tensor parallel: split regions over " << n.model_comm_->size()
         << " model rank(s) per stage; activations between stages replicated over model\n";
    for (int s = 0; s < n.p_; ++s) {
      os << "  stage " << s << ": " << n.describe_stage(s) << "  [params " << n.stage_begin_[static_cast<std::size_t>(s)]
         << ".." << n.stage_begin_[static_cast<std::size_t>(s) + 1] << ")" << (s == n.stage_ ? "  <- this rank" : "")
         << "\n";
    }
    os << "  this rank holds " << n.param_count() << " of " << n.total_params() << " parameters ("
       << static_cast<double>(n.param_count()) * 4 / 1048576.0 << " MiB)\n";
    return os;
  }

 private:
  // ---- placement: which elements (and repeat blocks) each stage holds ----
  void validate(const mesh_shape& shape) {
    const std::string who = "whale::" + layer_name<P>() + ": ";
    if (!has_split && shape.size(axis::model) != 1)
      throw std::invalid_argument(who + "the mesh " + shape.spec() +
                                  " has a model axis, but no stage holds a split region (the model ranks would "
                                  "only repeat each other's work); launch with --mesh data=D,pipe=P, or split "
                                  "layers of the stages over axis::model");
    if (!replicated && d_ != 1)
      throw std::invalid_argument(who + "the mesh " + shape.spec() + " has " + std::to_string(d_) +
                                  " ranks on the data axis, but the plan is not replicated; launch with --mesh pipe=" +
                                  std::to_string(shape.size()) + " or wrap the pipeline in replicate<...>");
    if constexpr (pipe_type::explicit_stages) {
      if (p_ != pipe_type::fixed_stages)
        throw std::invalid_argument(
            who + "the pipeline has " + std::to_string(pipe_type::fixed_stages) + " stages but the mesh's pipe axis has " +
            std::to_string(p_) + " rank(s) (" + shape.spec() + "); every stage needs its own pipe rank: launch with --mesh " +
            (replicated ? "data=D,pipe=" : "pipe=") + std::to_string(pipe_type::fixed_stages) + " (and -np " +
            std::to_string(pipe_type::fixed_stages * d_) + ")");
    } else {
      using R = std::tuple_element_t<rep_index, typename flat::tuple_type>;
      constexpr int N = static_cast<int>(R::count);
      if (p_ > 1 && N < p_ - 2)
        throw std::invalid_argument(who + "the repeat has " + std::to_string(N) + " blocks, too few for " +
                                    std::to_string(p_) + " pipe ranks (each inner stage needs a block); use at most " +
                                    std::to_string(N + 2) + " pipeline stages");
      if (!o_.blocks.empty()) {
        int sum = 0;
        bool ok = static_cast<int>(o_.blocks.size()) == p_;
        for (std::size_t s = 0; s < o_.blocks.size(); ++s) {
          sum += o_.blocks[s];
          if (o_.blocks[s] < 0 || (o_.blocks[s] == 0 && s > 0 && static_cast<int>(s) + 1 < p_)) ok = false;
        }
        if (!ok || sum != N) {
          std::string got;
          for (auto b : o_.blocks) {
            if (!got.empty()) got += ',';
            got += std::to_string(b);
          }
          throw std::invalid_argument(who + "stage blocks {" + got + "} do not fit: give one count per pipe rank (" +
                                      std::to_string(p_) + "), summing to the repeat's " + std::to_string(N) +
                                      " blocks, each inner stage at least 1");
        }
      }
    }
    if (o_.micro_batches > max_micro)
      throw std::invalid_argument(who + "at most " + std::to_string(max_micro) + " micro-batches");
  }

  template <std::size_t I> using elem_t = std::tuple_element_t<I, typename flat::tuple_type>;
  template <class F> static void for_elems(F&& f) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (f(std::integral_constant<std::size_t, I>{}), ...);
    }(std::make_index_sequence<n_elems>{});
  }
  template <class F> static void for_elems_reverse(F&& f) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (f(std::integral_constant<std::size_t, n_elems - 1 - I>{}), ...);
    }(std::make_index_sequence<n_elems>{});
  }

  static double unit_cost(cost_info c, index_t width, index_t seq) {
    const auto s = c.scaled(width == any_features ? 0.0 : static_cast<double>(width));
    return s.fwd_flops + s.bwd_flops + 3.0 * s.seq_flops * static_cast<double>(seq);
  }

  // Balanced cut of N equal blocks over p stages, stage 0 also carrying `pre`
  // and stage p-1 `post`: minimise the most expensive stage (exact DP).
  static std::vector<int> balance(int N, int p, double pre, double post, double blk) {
    if (p == 1) return {N};
    const double inf = std::numeric_limits<double>::infinity();
    // best[s][k]: first k blocks on stages 0..s, cost of the worst; choice[s][k]: blocks on s
    std::vector<std::vector<double>> best(static_cast<std::size_t>(p), std::vector<double>(static_cast<std::size_t>(N) + 1, inf));
    std::vector<std::vector<int>> choice(static_cast<std::size_t>(p), std::vector<int>(static_cast<std::size_t>(N) + 1, 0));
    for (int k = 0; k <= N; ++k) best[0][static_cast<std::size_t>(k)] = pre + k * blk;
    for (int s = 1; s < p; ++s) {
      const bool inner = s < p - 1;
      for (int k = 0; k <= N; ++k)
        for (int n = inner ? 1 : 0; n <= k; ++n) {
          const double mine = n * blk + (s == p - 1 ? post : 0.0);
          const double v = std::max(best[static_cast<std::size_t>(s) - 1][static_cast<std::size_t>(k - n)], mine);
          if (v < best[static_cast<std::size_t>(s)][static_cast<std::size_t>(k)] - 1e-9) {
            best[static_cast<std::size_t>(s)][static_cast<std::size_t>(k)] = v;
            choice[static_cast<std::size_t>(s)][static_cast<std::size_t>(k)] = n;
          }
        }
    }
    std::vector<int> r(static_cast<std::size_t>(p));
    int k = N;
    for (int s = p - 1; s > 0; --s) {
      r[static_cast<std::size_t>(s)] = choice[static_cast<std::size_t>(s)][static_cast<std::size_t>(k)];
      k -= r[static_cast<std::size_t>(s)];
    }
    r[0] = k;
    return r;
  }

  void place() {
    // flat offsets of every element, as sequential::bind would give them
    index_t at = 0;
    for_elems([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      off_[I] = at;
      at += model_.template get<I>().param_count();
    });
    total_ = at;
    // the same offsets in the unsplit model (the types' parameter counts)
    index_t fat = 0;
    for_elems([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      full_off_[I] = fat;
      fat += elem_t<I>::cost().params;
    });
    if constexpr (pipe_type::explicit_stages) {
      for (std::size_t i = 0; i < n_elems; ++i) elem_stage_[i] = static_cast<int>(i);
      blocks_.assign(static_cast<std::size_t>(p_), 1);
    } else {
      for (std::size_t i = 0; i < n_elems; ++i) elem_stage_[i] = i < rep_index ? 0 : (i > rep_index ? p_ - 1 : -1);
      auto& rep = model_.template get<rep_index>();
      using R = std::remove_cvref_t<decltype(rep)>;
      constexpr int N = static_cast<int>(R::count);
      block_params_ = rep.block(0).param_count();
      if (!o_.blocks.empty()) {
        blocks_ = o_.blocks;
      } else {
        double pre = 0, post = 0;
        for_elems([&](auto ic) {
          constexpr std::size_t I = decltype(ic)::value;
          if constexpr (I != rep_index) {
            const double c = unit_cost(elem_t<I>::cost(), E::in_width[I], o_.balance_seq);
            (I < rep_index ? pre : post) += c;
          }
        });
        const double blk = unit_cost(R::block_type::cost(), E::in_width[rep_index], o_.balance_seq);
        blocks_ = balance(N, p_, pre, post, blk);
      }
      first_block_.assign(static_cast<std::size_t>(p_) + 1, 0);
      for (int s = 0; s < p_; ++s)
        first_block_[static_cast<std::size_t>(s) + 1] = first_block_[static_cast<std::size_t>(s)] + blocks_[static_cast<std::size_t>(s)];
    }
    // each stage's contiguous range of the flat parameters
    stage_begin_.assign(static_cast<std::size_t>(p_) + 1, total_);
    for (int s = p_ - 1; s >= 0; --s) {
      index_t b = stage_begin_[static_cast<std::size_t>(s) + 1];
      for (std::size_t i = n_elems; i-- > 0;) {
        if (i == rep_index) {
          if (blocks_[static_cast<std::size_t>(s)] > 0) b = std::min(b, block_offset(first_block_[static_cast<std::size_t>(s)]));
        } else if (elem_stage_[i] == s) {
          b = std::min(b, off_[i]);
        }
      }
      stage_begin_[static_cast<std::size_t>(s)] = b;
    }
    begin_ = stage_begin_[static_cast<std::size_t>(stage_)];
    end_ = stage_begin_[static_cast<std::size_t>(stage_) + 1];
    // this stage's unsplit range: its units are contiguous in the flat model
    full_begin_ = fat;
    full_end_ = 0;
    for_elems([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      if (!owns(I)) return;
      index_t b = full_off_[I], e = full_off_[I] + elem_t<I>::cost().params;
      if constexpr (I == rep_index) {
        constexpr index_t per = elem_t<I>::block_type::cost().params;
        b = full_off_[I] + first_block_[static_cast<std::size_t>(stage_)] * per;
        e = full_off_[I] + first_block_[static_cast<std::size_t>(stage_) + 1] * per;
      }
      full_begin_ = std::min(full_begin_, b);
      full_end_ = std::max(full_end_, e);
    });
    if (full_end_ < full_begin_) full_begin_ = full_end_ = 0;
    // widths at this stage's edges
    in_width_ = stage_in_width(stage_);
    out_width_ = stage_ + 1 < p_ ? stage_in_width(stage_ + 1) : 0;
    if ((stage_ > 0 && in_width_ == any_features) || (stage_ + 1 < p_ && out_width_ == any_features))
      throw std::invalid_argument("whale::" + layer_name<P>() +
                                  ": the width of the activation between two stages is not known from the layer types "
                                  "(both sides keep any width); start each stage with a layer of fixed in_features");
  }
  index_t block_offset(int b) const { return off_[rep_index < n_elems ? rep_index : 0] + b * block_params_; }
  // Width flowing into stage s's first element or block.
  index_t stage_in_width(int s) const {
    for (std::size_t i = 0; i < n_elems; ++i) {
      if (i == rep_index && blocks_[static_cast<std::size_t>(s)] > 0) return E::in_width[i];
      if (i != rep_index && elem_stage_[i] == s) return E::in_width[i];
    }
    return any_features;
  }
  bool owns(std::size_t i) const {
    if (i == rep_index) return blocks_[static_cast<std::size_t>(stage_)] > 0;
    return elem_stage_[i] == stage_;
  }
  std::string describe_stage(int s) const {
    std::string d;
    for_elems([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      std::string part;
      if constexpr (I == rep_index) {
        const int b0 = first_block_[static_cast<std::size_t>(s)], n = blocks_[static_cast<std::size_t>(s)];
        if (n > 0)
          part = std::to_string(n) + " x " + layer_name<typename elem_t<I>::block_type>() + " (blocks " +
                 std::to_string(b0) + ".." + std::to_string(b0 + n - 1) + ")";
      } else if (elem_stage_[I] == s) {
        part = layer_name<elem_t<I>>();
      }
      if (!part.empty()) d += (d.empty() ? "" : ", ") + part;
    });
    return d;
  }

  void bind_and_init(seed sd) {
    param_binder b(params_.data(), grads_.data(), end_, begin_);
    const counter_rng r(sd);
    for_elems([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      if (!owns(I)) return;
      auto& e = model_.template get<I>();
      if constexpr (I == rep_index) {
        for (int k = first_block_[static_cast<std::size_t>(stage_)]; k < first_block_[static_cast<std::size_t>(stage_) + 1]; ++k) {
          check_offset(b, block_offset(k));
          e.block(static_cast<std::size_t>(k)).bind(b);
          e.block(static_cast<std::size_t>(k)).init(r.child(I).child(static_cast<std::uint64_t>(k)));
        }
      } else {
        check_offset(b, off_[I]);
        e.bind(b);
        e.init(r.child(I));  // as sequential::init: element I from stream child(I)
      }
    });
    if (b.offset() != end_) throw std::logic_error("whale::pipeline: stage binding did not fill its parameter range");
  }
  // The ranges of this stage that this rank adds to the gradient norm.
  void count_for_norm() {
    const std::string who = "whale::" + layer_name<P>();
    for_elems([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      if (!owns(I)) return;
      auto& e = model_.template get<I>();
      if constexpr (I == rep_index) {
        using B = typename std::remove_cvref_t<decltype(e)>::block_type;
        for (int k = first_block_[static_cast<std::size_t>(stage_)]; k < first_block_[static_cast<std::size_t>(stage_) + 1]; ++k)
          detail::add_counted_ranges<B>(counted_, block_offset(k), e.block(static_cast<std::size_t>(k)).param_count(),
                                        ctx_->mesh(), who);
      } else {
        detail::add_counted_ranges<elem_t<I>>(counted_, off_[I], e.param_count(), ctx_->mesh(), who);
      }
    });
  }
  static void check_offset(const param_binder& b, index_t want) {
    if (b.offset() != want) throw std::logic_error("whale::pipeline: stage parameters out of order");
  }

  // ---- one stage's forward and backward of one micro-batch ----
  // x0: the data rows (stage 0); in: the received activation (other stages).
  view<float> run_layers(step_ctx& c, cview<input_type> x0, cview<float> in) {
    cview<float> cur = in;
    if constexpr (std::is_same_v<input_type, float>)
      if (stage_ == 0) cur = x0;
    view<float> y;
    for_elems([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      if constexpr (I != loss_index) {
        if (!owns(I)) return;
        auto& e = model_.template get<I>();
        if constexpr (I == rep_index) {
          for (int k = first_block_[static_cast<std::size_t>(stage_)]; k < first_block_[static_cast<std::size_t>(stage_) + 1]; ++k) {
            y = run_forward(e.block(static_cast<std::size_t>(k)), c, cur, block_offset(k));
            cur = y;
          }
        } else {
          if constexpr (I == 0) y = run_forward(e, c, x0, off_[I]);
          else y = run_forward(e, c, cur, off_[I]);
          cur = y;
        }
      }
    });
    if (stage_ > 0 && y.data() == nullptr) y = view<float>(const_cast<float*>(in.data()), in.shape());
    return y;
  }
  view<float> stage_forward(step_ctx& c, cview<input_type> x0, cview<float> in) { return run_layers(c, x0, in); }
  double stage_forward_loss(step_ctx& c, cview<input_type> x0, cview<float> in, cview<std::int32_t> labels) {
    auto& loss = model_.template get<loss_index>();
    bool any_layer = false;
    for (std::size_t i = 0; i < loss_index; ++i) any_layer = any_layer || owns(i);
    if constexpr (loss_index == 0) {
      return run_forward_loss(loss, c, x0, labels, off_[loss_index]);
    } else {
      if (!any_layer) {
        if constexpr (std::is_same_v<input_type, float>)
          if (stage_ == 0) return run_forward_loss(loss, c, x0, labels, off_[loss_index]);
        return run_forward_loss(loss, c, in, labels, off_[loss_index]);
      }
      auto y = run_layers(c, x0, in);
      return run_forward_loss(loss, c, cview<float>(y), labels, off_[loss_index]);
    }
  }
  // Is (element I, block k) this stage's first unit? Its d(input) is needed only upstream.
  bool is_first_unit(std::size_t i, int k) const {
    for (std::size_t j = 0; j < n_elems; ++j) {
      if (!owns(j)) continue;
      if (j != i) return false;
      return j != rep_index || k == first_block_[static_cast<std::size_t>(stage_)];
    }
    return false;
  }
  view<float> stage_backward(step_ctx& c, cview<float> dy) {
    const bool upstream = stage_ > 0;
    cview<float> g = dy;
    view<float> d;
    for_elems_reverse([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      if (!owns(I)) return;
      auto& e = model_.template get<I>();
      if constexpr (I == loss_index) {
        c.need_input_grad = upstream || !is_first_unit(I, 0);
        d = run_backward_loss(e, c, off_[I]);
        if (c.grads_ready) c.grads_ready(off_[I]);
        g = d;
      } else if constexpr (I == rep_index) {
        for (int k = first_block_[static_cast<std::size_t>(stage_) + 1]; k-- > first_block_[static_cast<std::size_t>(stage_)];) {
          c.need_input_grad = upstream || !is_first_unit(I, k);
          d = run_backward(e.block(static_cast<std::size_t>(k)), c, g, block_offset(k));
          if (c.grads_ready) c.grads_ready(block_offset(k));
          g = d;
        }
      } else {
        c.need_input_grad = upstream || !is_first_unit(I, 0);
        d = run_backward(e, c, g, off_[I]);
        if (c.grads_ready) c.grads_ready(off_[I]);
        g = d;
      }
    });
    return d;
  }

  // ---- schedule, micro-batches, messages ----
  int micro_count(index_t batch) const {
    const std::string who = "whale::" + layer_name<P>() + ": ";
    if (o_.micro_batches > 0) {
      if (batch % o_.micro_batches != 0 || batch < o_.micro_batches)
        throw std::invalid_argument(who + std::to_string(o_.micro_batches) +
                                    " micro-batches do not divide the per-replica batch of " + std::to_string(batch) +
                                    " sequences; choose a micro-batch count that divides it");
      return o_.micro_batches;
    }
    int best = 1;
    for (int m = 1; m <= std::min<index_t>(batch, 4 * p_); ++m)
      if (batch % m == 0) best = m;
    return best;
  }
  void schedule_for(int m) {
    if (m == m_) return;
    rep_ = check_schedule<sched>(p_, m);
    actions_ = sched::actions(stage_, p_, m);
    m_ = m;
  }
  void post_send(cview<float> v, int dst, int tag, span_kind k, int micro) {
    const auto t0 = tr_.now();
    outbox* ob = nullptr;
    for (auto& o : outbox_)
      if (!o.req || o.req->test()) {
        o.req.reset();
        ob = &o;
        break;
      }
    if (!ob) ob = &outbox_.emplace_back();
    detail::ensure(ob->buf, v.shape(), mem_kind::comm);
    copy(v, ob->buf.v());
    ob->req.emplace(pipe_->isend(ob->buf.data(), v.numel(), dtype::f32, dst, tag));
    tr_.add(k, step_, micro, t0, tr_.now());
  }
  // Poll outstanding messages so that MPI moves them while this rank computes.
  void progress() {
    for (auto& o : outbox_)
      if (o.req && o.req->test()) o.req.reset();
    for (auto& r : act_req_)
      if (r) r->test();
    for (auto& r : grad_req_)
      if (r) r->test();
  }

  // ---- data-parallel gradient buckets (replicate<pipeline>) ----
  struct bucket {
    index_t begin = 0, end = 0;  // local gradient range
    std::optional<typename world_comm::request> req;
  };
  void make_buckets() {
    const index_t n = end_ - begin_;
    const auto per = std::max<index_t>(1, static_cast<index_t>(o_.dp.bucket_mib * 1048576.0 / sizeof(float)));
    for (index_t e = n; e > 0; e -= per) buckets_.push_back({std::max<index_t>(0, e - per), e, {}});
  }
  // Every gradient at global flat index >= offset is final: launch the buckets it completes.
  void on_ready(index_t offset) {
    const index_t local = offset - begin_;
    while (next_ < buckets_.size() && buckets_[next_].begin >= local) {
      auto& b = buckets_[next_++];
      b.req.emplace(data_->iall_reduce(grads_.data() + b.begin, b.end - b.begin, dtype::f32, reduce_op::sum));
    }
    for (std::size_t i = 0; i < next_; ++i) buckets_[i].req->test();
  }

  struct outbox {
    tensor<float> buf;
    std::optional<typename world_comm::request> req;
  };

  const context* ctx_;
  pipeline_options o_;
  world_comm* pipe_ = nullptr;
  world_comm* data_ = nullptr;
  world_comm* model_comm_ = nullptr;
  int model_rank_ = 0;
  std::vector<std::pair<index_t, index_t>> no_sync_;  // filled by split regions over data (refused)
  int p_ = 1, d_ = 1, stage_ = 0, replica_ = 0;
  flat model_;
  std::array<index_t, n_elems> off_{}, full_off_{};
  index_t full_begin_ = 0, full_end_ = 0;
  std::array<int, n_elems> elem_stage_{};
  std::vector<int> blocks_, first_block_;
  std::vector<index_t> stage_begin_;
  index_t block_params_ = 0, begin_ = 0, end_ = 0, total_ = 0;
  index_t in_width_ = 0, out_width_ = 0;
  tensor<float> params_, grads_;
  detail::flat_ranges counted_;  // what this rank adds to the gradient norm
  // schedule
  int m_ = 0;
  schedule_report rep_;
  std::vector<pipe_action> actions_;
  // per-slot receive buffers and per-micro-batch requests
  std::vector<tensor<float>> xin_, gin_;
  std::vector<std::optional<typename world_comm::request>> act_req_, grad_req_;
  std::vector<outbox> outbox_;
  std::vector<bucket> buckets_;
  std::size_t next_ = 0;
  int live_ = 0, peak_live_ = 0, max_slot_ = 0;
  int step_ = 0;
  tracer tr_;
  bool trace_written_ = false;
};

}  // namespace whale
