// `shard<M, Level>`: ZeRO stages 1–3 over the mesh's `data` axis, and its
// runtime `sharded<S>` (the trainer's Trainable surface). The flat parameter
// space is cut into contiguous, near-even ranges, one per data rank; each rank
// updates only its range. No pipeline or split composition here (see below).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <span>
#include <ostream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "whale/backend/cpu.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/nn/layer.hpp"
#include "whale/strategy/data_parallel.hpp"
#include "whale/strategy/replicate.hpp"

namespace whale {

namespace detail {
/// Whether a model type holds a part that shard cannot (yet) compose with:
/// a split region (`is_split`) or a pipeline (`schedule`), at any depth of
/// the containers whale knows (sequential, repeat, residual, recompute, replicate).
template <class M> constexpr bool shard_incompatible_part() {
  if constexpr (requires { M::is_split; }) return true;
  else if constexpr (requires { typename M::schedule; }) return true;
  else if constexpr (requires { typename M::tuple_type; })
    return []<class... E>(std::tuple<E...>*) { return (shard_incompatible_part<E>() || ...); }(
        static_cast<typename M::tuple_type*>(nullptr));
  else if constexpr (requires { typename M::inner_type; }) return shard_incompatible_part<typename M::inner_type>();
  else if constexpr (requires { typename M::block_type; }) return shard_incompatible_part<typename M::block_type>();
  else if constexpr (requires { typename M::inner; }) return shard_incompatible_part<typename M::inner>();
  else return false;
}
template <class T> struct is_shard_impl : std::false_type {};
}  // namespace detail

/// ZeRO data parallelism of a whole model M over the mesh's data axis.
///   Level 1: optimizer state partitioned; gradients all-reduced (in buckets,
///            during backward); each rank updates its range, then parameters
///            are all-gathered.
///   Level 2: plus gradients partitioned: each leaf layer's gradients go to a
///            temporary buffer and are reduce-scattered (non-blocking) as soon
///            as its backward ends; each rank keeps only its range.
///   Level 3: plus parameters partitioned: a leaf's parameters are all-gathered
///            just before its forward and again before its backward and freed
///            after; the next leaf's gather is prefetched (non-blocking).
/// Behaves exactly as M (same parameters, same initialisation); `make` builds
/// the runtime. shard<replicate<M>> is shard<M> (the batch is split over the
/// data axis either way). See docs/shard.md for memory formulas.
template <class M, int Level = 3>
struct shard : M {
  static_assert(Level >= 1 && Level <= 3,
                "whale::shard<M, Level>: Level must be 1 (optimizer state partitioned), 2 (plus "
                "gradients) or 3 (plus parameters, the default)");
  static_assert(Loss<M>,
                "whale::shard: shard the whole model (a sequential ending in a loss); sharding one "
                "part of a model is not supported yet — wrap the whole model in whale::shard<...>");
  static_assert(!detail::is_or_holds<detail::part_kind::shard, M>(),
                "whale::shard: shard<shard<M>> is not meaningful (there is one data axis), nor is a shard<...> "
                "inside the sharded model; use one shard<M, Level> around the whole model");
  static_assert(!detail::shard_incompatible_part<M>(),
                "whale::shard: the model contains a split<...> region or a pipeline<...>; shard does not "
                "compose with them yet (sharding inside each pipeline stage's data group and sharding split "
                "parameters over the data axis are planned). Use replicate<...> for the data axis, or shard "
                "a model without split/pipeline");
  using inner = M;
  static constexpr int level = Level;
  static std::string name() { return "shard<" + layer_name<M>() + ", " + std::to_string(Level) + ">"; }
};

namespace detail {
template <class M, int L> struct is_shard_impl<shard<M, L>> : std::true_type {};
}  // namespace detail
template <class T> inline constexpr bool is_shard_v = detail::is_shard_impl<T>::value;

/// Options of the sharded runtime.
struct shard_options {
  double bucket_mib = 25.0;  ///< gradient bucket size: level 1 all-reduces, levels 2–3 reduce-scatters (WHALE_BUCKET_MIB)
  bool prefetch = true;      ///< level 3: gather the next leaf while the current one runs (WHALE_ZERO_PREFETCH)
  int max_pending = 2;       ///< levels 2–3: leaves whose reduce-scatters may be in flight before the oldest is waited for
  static shard_options from_env() {
    shard_options o;
    if (const char* e = std::getenv("WHALE_BUCKET_MIB")) o.bucket_mib = std::atof(e);
    if (const char* e = std::getenv("WHALE_ZERO_PREFETCH")) o.prefetch = std::string(e) != "0";
    return o;
  }
};

/// Model-state bytes per rank predicted by ZeRO's formulas (docs/shard.md), for
/// Ψ parameters, `shard` of them on this rank, K optimizer bytes per parameter.
/// level 0 is plain data parallelism.
constexpr std::int64_t zero_model_state_bytes(int level, std::int64_t psi, std::int64_t shard, std::int64_t k) {
  switch (level) {
    case 1: return 8 * psi + k * shard;
    case 2: return 4 * psi + (4 + k) * shard;
    case 3: return (8 + k) * shard;
    default: return (8 + k) * psi;
  }
}

/// The runtime of shard<M, Level>: a Trainable whose ranks each own one
/// contiguous range [begin, end) of the flat parameters (near-even:
/// block_counts over the data ranks). It holds:
///   level 1: all parameters, all gradients, optimizer state of its range
///   level 2: all parameters, gradients and optimizer state of its range
///   level 3: parameters, gradients and optimizer state of its range only
/// plus, for levels 2–3, a small pool of communication buffers (mem_kind::comm)
/// for gathered leaf parameters and leaf gradients awaiting their reduce-scatter.
template <class S>
class sharded {
  static_assert(is_shard_v<S>, "whale::sharded: the model must be shard<M, Level>; wrap it in whale::shard");

 public:
  using model_type = S;
  using inner_model = strip_replicate_t<typename S::inner>;
  using input_type = typename S::input_type;
  static constexpr int level = S::level;

  sharded(const context& ctx, seed s, shard_options o = shard_options::from_env())
      : ctx_(&ctx), comm_(&ctx.mesh().comm(axis::data)), o_(o), hooks_(this) {
    const auto& shape = ctx.mesh().shape();
    if (shape.size(axis::pipe) != 1 || shape.size(axis::model) != 1)
      throw std::invalid_argument("whale::shard: this plan uses only the data axis, but the mesh is " +
                                  shape.spec() + "; launch with --mesh data=" + std::to_string(ctx.size()));
    if (o_.bucket_mib <= 0)
      throw std::invalid_argument("whale::shard: bucket size must be positive (got " +
                                  std::to_string(o_.bucket_mib) + " MiB)");
    if (o_.max_pending < 1) throw std::invalid_argument("whale::shard: max_pending must be at least 1");
    n_ = model_.param_count();
    counts_ = block_counts(n_, comm_->size());
    starts_.assign(counts_.size(), 0);
    for (std::size_t r = 1; r < counts_.size(); ++r) starts_[r] = starts_[r - 1] + counts_[r - 1];
    begin_ = starts_[static_cast<std::size_t>(comm_->rank())];
    scratch_counts_.assign(counts_.size(), 0);
    end_ = begin_ + counts_[static_cast<std::size_t>(comm_->rank())];
    // Every rank initialises from the same seed: parameters agree without a broadcast.
    if constexpr (level <= 2) {
      full_params_ = tensor<float>({n_}, mem_kind::params);
      if constexpr (level == 1) full_grads_ = tensor<float>({n_}, mem_kind::grads);
      else shard_grads_ = tensor<float>({local_count()}, mem_kind::grads);
      param_binder b(full_params_.data(), level == 1 ? full_grads_.data() : nullptr, n_);
      model_.bind(b);
      model_.init(counter_rng(s));
      if constexpr (level == 1) make_buckets();
    } else {
      shard_params_ = tensor<float>({local_count()}, mem_kind::params);
      shard_grads_ = tensor<float>({local_count()}, mem_kind::grads);
      {
        // init is a function of the whole model's streams: run it into a
        // transient full-size buffer (workspace), keep this rank's range.
        tensor<float> tmp({n_}, mem_kind::workspace);
        param_binder b(tmp.data(), nullptr, n_);
        model_.bind(b);
        model_.init(counter_rng(s));
        copy<float>(cview<float>(tmp.data() + begin_, {local_count()}), shard_params_.v());
      }
      param_binder none(nullptr, nullptr, n_);  // leaves point at gathered buffers only while they run
      model_.bind(none);
    }
  }
  sharded(const sharded&) = delete;
  sharded& operator=(const sharded&) = delete;

  // ---- Trainable ----
  std::pair<index_t, index_t> local_batch(index_t global_batch) const {
    if (global_batch < comm_->size())
      throw std::invalid_argument("whale::shard: the global batch (" + std::to_string(global_batch) +
                                  ") is smaller than the data-parallel degree (" + std::to_string(comm_->size()) +
                                  "); every rank needs at least one sample");
    return even_slice(global_batch, comm_->size(), comm_->rank());
  }

  /// Forward and backward on this rank's rows. When it returns, this rank's
  /// range of the gradients holds their sum over the data axis.
  double train_step(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) {
    if (c.accumulate)
      throw std::invalid_argument("whale::shard: gradient accumulation (step_ctx::accumulate) is not supported; "
                                  "run one pass per step");
    double loss = 0;
    if constexpr (level == 1) {
      next_bucket_ = 0;
      if (comm_->size() > 1) c.grads_ready = [this](index_t offset) { on_ready(offset); };
      loss = model_.forward_loss(c, x, labels);
      c.need_input_grad = false;
      model_.backward_loss(c);
      c.grads_ready = nullptr;
      if (comm_->size() > 1) {
        on_ready(0);
        for (auto& b : buckets_) b.req->wait();
      }
    } else {
      hooks_.next = c.hooks;
      c.hooks = &hooks_;
      loss = model_.forward_loss(c, x, labels);
      c.need_input_grad = false;
      model_.backward_loss(c);
      c.hooks = hooks_.next;
      finish_pass();
    }
    return loss;
  }
  /// Forward only (levels 2–3 gather parameters as in training); this rank's share of the loss.
  double evaluate(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) {
    if constexpr (level <= 2) return model_.forward_loss(c, x, labels);
    hooks_.next = c.hooks;
    c.hooks = &hooks_;
    const double loss = model_.forward_loss(c, x, labels);
    c.hooks = hooks_.next;
    finish_pass();
    return loss;
  }
  double reduce_loss(double share) {
    double v = share;
    all_reduce(*comm_, view<double>(&v, {1}));
    return v;
  }
  /// Global gradient norm: level 1 holds all summed gradients; levels 2–3 sum
  /// the squares of their ranges over the data axis (collective).
  double grad_norm() {
    if constexpr (level == 1) return std::sqrt(cpu::sum_squares(n_, full_grads_.data()));
    double sq = cpu::sum_squares(local_count(), shard_grads_.data());
    all_reduce(*comm_, view<double>(&sq, {1}));
    return std::sqrt(sq);
  }
  int rank() const noexcept { return ctx_->rank(); }
  int world_size() const noexcept { return ctx_->size(); }
  /// Optimizer state for this rank's range only.
  template <class O> typename O::state make_optimizer_state(const O& opt) const { return opt.make_state(local_count()); }
  /// Update this rank's range; levels 1–2 then all-gather the parameters.
  template <class O> void apply_optimizer(const O& opt, typename O::state& s, float grad_scale) {
    auto g = local_grads();
    if (grad_scale != 1.f) cpu::scale(g.numel(), grad_scale, g.data());
    opt.update(s, local_params(), g);
    if constexpr (level <= 2)
      if (comm_->size() > 1)
        all_gather_v(*comm_, cview<float>(full_params_.data() + begin_, {local_count()}), full_params_.v(),
                     std::span<const index_t>(counts_));
  }

  // ---- inspection ----
  index_t param_count() const noexcept { return n_; }
  /// This rank's flat range [first, second).
  std::pair<index_t, index_t> range() const noexcept { return {begin_, end_}; }
  index_t local_count() const noexcept { return end_ - begin_; }
  /// Parameters and (summed) gradients of this rank's range.
  view<float> local_params() const noexcept {
    if constexpr (level <= 2) return view<float>(full_params_.data() + begin_, {local_count()});
    else return shard_params_.v();
  }
  view<float> local_grads() const noexcept {
    if constexpr (level == 1) return view<float>(full_grads_.data() + begin_, {local_count()});
    else return shard_grads_.v();
  }
  /// All parameters into `out` (param_count() floats): collective at level 3.
  void gather_params(view<float> out) {
    if (out.numel() != n_)
      throw std::invalid_argument("whale::shard::gather_params: the output holds " + std::to_string(out.numel()) +
                                  " floats, the model has " + std::to_string(n_));
    if constexpr (level <= 2) copy<float>(full_params_.v(), out);
    else all_gather_v(*comm_, cview<float>(shard_params_.v()), out, std::span<const index_t>(counts_));
  }
  /// Flat ranges per rank (rank r: [starts[r], starts[r] + counts[r])).
  const std::vector<index_t>& counts() const noexcept { return counts_; }
  inner_model& model() noexcept { return model_; }
  /// Comm buffers this runtime holds (levels 2–3), and how many exist.
  std::size_t comm_buffers() const noexcept { return pool_.size(); }

  friend std::ostream& operator<<(std::ostream& os, const sharded& z) {
    const int p = z.comm_->size();
    os << "plan: " << S::name() << " over " << z.ctx_->mesh().shape() << "\n"
       << "  ZeRO-" << level << " over data:" << p << ", batch split<0>; rank " << z.comm_->rank() << " owns ["
       << z.begin_ << ", " << z.end_ << ") of " << z.n_ << " parameters\n"
       << "  holds: parameters " << (level == 3 ? "its range" : "all") << ", gradients "
       << (level == 1 ? "all (all-reduced in buckets)" : "its range (reduce-scattered per leaf)")
       << ", optimizer state its range" << (level <= 2 ? "; parameters all-gathered after the step" : "")
       << (level == 3 ? "; each leaf's parameters all-gathered before its forward and its backward" : "") << "\n";
    inner_model::print_structure(os, 2, inner_model::in_features);
    return os;
  }

 private:
  // ---------------- level 1: bucketed all-reduce (as data_parallel) ----------------
  struct bucket {
    index_t begin = 0, end = 0;
    std::optional<typename world_comm::request> req;
  };
  void make_buckets() {
    const auto per = std::max<index_t>(1, static_cast<index_t>(o_.bucket_mib * 1048576.0 / sizeof(float)));
    for (index_t e = n_; e > 0; e -= per) buckets_.push_back({std::max<index_t>(0, e - per), e, {}});
  }
  void on_ready(index_t offset) {
    while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].begin >= offset) {
      auto& b = buckets_[next_bucket_++];
      b.req.emplace(comm_->iall_reduce(full_grads_.data() + b.begin, b.end - b.begin, dtype::f32, reduce_op::sum));
    }
    for (std::size_t i = 0; i < next_bucket_; ++i) buckets_[i].req->test();
  }

  // ---------------- levels 2–3: per-leaf gathers and reduce-scatters ----------------
  /// A leaf's flat range split over the ranks: counts[r] of its elements live on rank r.
  struct leaf_info {
    index_t offset = 0, count = 0;
    std::vector<index_t> counts;
    index_t mine_at = 0;   // first element of this rank's piece, within the leaf
    index_t mine = 0;      // this rank's piece size
  };
  const leaf_info& info(index_t offset, index_t count) {
    auto it = leaves_.find(offset);
    if (it != leaves_.end()) return it->second;
    leaf_info l;
    l.offset = offset;
    l.count = count;
    const int p = comm_->size();
    for (int r = 0; r < p; ++r) {
      const index_t lo = std::max(offset, starts_[static_cast<std::size_t>(r)]);
      const index_t hi = std::min(offset + count, starts_[static_cast<std::size_t>(r)] + counts_[static_cast<std::size_t>(r)]);
      l.counts.push_back(std::max<index_t>(0, hi - lo));
      if (r == comm_->rank()) {
        l.mine = std::max<index_t>(0, hi - lo);
        l.mine_at = l.mine ? lo - offset : 0;
      }
    }
    return leaves_.emplace(offset, std::move(l)).first->second;
  }

  // A small pool of comm buffers: a free one of exactly this size, else a new
  // one. Exact sizes and releases at fixed points (not when a test() happens
  // to succeed) make every step take the same buffers: after the first step
  // nothing is allocated.
  struct buffer {
    tensor<float> t;
    bool busy = false;
  };
  int acquire(index_t count) {
    int best = -1;
    for (std::size_t i = 0; i < pool_.size() && best < 0; ++i)
      if (!pool_[i].busy && static_cast<index_t>(pool_[i].t.capacity()) == count) best = static_cast<int>(i);
    if (best < 0) {
      pool_.push_back({tensor<float>({count}, mem_kind::comm), false});
      best = static_cast<int>(pool_.size() - 1);
    }
    pool_[static_cast<std::size_t>(best)].busy = true;
    return best;
  }
  float* data(int b) const noexcept { return pool_[static_cast<std::size_t>(b)].t.data(); }
  void release(int b) noexcept {
    if (b >= 0) pool_[static_cast<std::size_t>(b)].busy = false;
  }

  // Reduce-scatters in flight: their gradient buffers return to the pool when done.
  struct pending {
    typename world_comm::request req;
    int buf;    // the leaf's gradient buffer
    bool last;  // the leaf's last bucket: its buffer returns to the pool when this completes
  };
  void progress() {
    for (auto& p : pending_) p.req.test();  // drive MPI; buffers return in wait_oldest only
  }
  void wait_oldest() {
    pending_.front().req.wait();
    if (pending_.front().last) {
      release(pending_.front().buf);
      --pending_leaves_;
    }
    pending_.erase(pending_.begin());
  }

  // Level 3: a gathered leaf (the one in use, or the prefetched next one).
  struct gathered {
    index_t offset = -1;
    int buf = -1;
    std::optional<typename world_comm::request> req;
  };
  void start_gather(gathered& g, const leaf_info& l) {
    g.offset = l.offset;
    g.buf = acquire(l.count);
    if (dry_) return;
    const float* mine = shard_params_.data() + (l.offset + l.mine_at - begin_);
    if (!l.mine) mine = shard_params_.data();
    g.req.emplace(iall_gather_v(*comm_, cview<float>(mine, {l.mine}), view<float>(data(g.buf), {l.count}),
                                std::span<const index_t>(l.counts)));
  }
  void drop(gathered& g) {
    if (g.req) g.req->wait();
    g.req.reset();
    release(g.buf);
    g = gathered{};
  }

  // The order in which leaves ask for their parameters, recorded in the first
  // pass and used to prefetch in later ones (a change of order re-records).
  struct event {
    index_t offset;
    bool backward;
    friend bool operator==(const event&, const event&) = default;
  };

  /// Level 3: the gathered parameters of leaf `l` for event `ev`; prefetches the next.
  float* gather_for(const leaf_info& l, event ev) {
    progress();
    if (recording_) {
      trace_.push_back(ev);
    } else if (pos_ >= trace_.size() || !(trace_[pos_] == ev)) {
      drop(next_);  // the order changed: every rank sees the same change
      trace_.resize(pos_);
      trace_.push_back(ev);
      recording_ = true;
    }
    ++pos_;
    if (held_.offset != l.offset) {
      drop(held_);
      if (next_.offset == l.offset) std::swap(held_, next_);
      else start_gather(held_, l);
    }
    if (held_.req) {
      held_.req->wait();
      held_.req.reset();
    }
    if (o_.prefetch && !recording_ && pos_ < trace_.size()) {
      const auto& nx = trace_[pos_];
      if (nx.offset != l.offset && next_.offset != nx.offset) {
        drop(next_);
        start_gather(next_, leaves_.at(nx.offset));
      }
    }
    return data(held_.buf);
  }
  /// Level 3: leaf `l` is done with its parameters; keep them if the next event wants them.
  void done_with(const leaf_info& l) {
    const bool again = !recording_ && pos_ < trace_.size() && trace_[pos_].offset == l.offset;
    if (!again && held_.offset == l.offset) drop(held_);
  }

  void leaf_before_forward(const leaf_ref& r) {
    if constexpr (level == 3) {
      const auto& l = info(r.offset, r.count);
      r.rebind(gather_for(l, {r.offset, false}), nullptr);
    }
  }
  void leaf_after_forward(const leaf_ref& r) {
    if constexpr (level == 3) {
      r.rebind(nullptr, nullptr);
      done_with(info(r.offset, r.count));
    }
  }
  void leaf_before_backward(const leaf_ref& r) {
    const auto& l = info(r.offset, r.count);
    float* p = nullptr;
    if constexpr (level == 3) p = gather_for(l, {r.offset, true});
    else p = full_params_.data() + r.offset;
    grad_buf_ = acquire(l.count);
    r.rebind(p, data(grad_buf_));
  }
  /// Reduce-scatter leaf `l`'s gradients (in grad_buf_) into the ranges,
  /// non-blocking, in buckets of at most bucket_mib: bounded temporaries
  /// inside MPI, and the first buckets travel while the rest are queued.
  void scatter_grads(const leaf_info& l) {
    const auto per = std::max<index_t>(1, static_cast<index_t>(o_.bucket_mib * 1048576.0 / sizeof(float)));
    const int p = comm_->size();
    for (index_t a = 0; a < l.count; a += per) {
      const index_t b = std::min(l.count, a + per);  // bucket [a, b) of the leaf
      const index_t ga = l.offset + a, gb = l.offset + b;
      index_t mine = 0, mine_at = 0;
      for (int r = 0; r < p; ++r) {
        const auto ru = static_cast<std::size_t>(r);
        const index_t lo = std::max(ga, starts_[ru]), hi = std::min(gb, starts_[ru] + counts_[ru]);
        scratch_counts_[ru] = std::max<index_t>(0, hi - lo);
        if (r == comm_->rank() && hi > lo) mine = hi - lo, mine_at = lo - begin_;
      }
      const bool last = b == l.count;
      if (dry_) {
        pending_.push_back({typename world_comm::request{}, grad_buf_, last});
      } else {
        pending_.push_back({ireduce_scatter_v(*comm_, cview<float>(data(grad_buf_) + a, {b - a}),
                                              view<float>(shard_grads_.data() + mine_at, {mine}),
                                              std::span<const index_t>(scratch_counts_)),
                            grad_buf_, last});
      }
    }
    ++pending_leaves_;
    grad_buf_ = -1;
    progress();
    while (pending_leaves_ > o_.max_pending) wait_oldest();
  }
  void leaf_after_backward(const leaf_ref& r) {
    const auto& l = info(r.offset, r.count);
    scatter_grads(l);
    if constexpr (level == 3) {
      r.rebind(nullptr, nullptr);
      done_with(l);
    } else {
      r.rebind(full_params_.data() + r.offset, nullptr);
    }
  }
  /// End of a pass: every reduce-scatter done, every gather buffer back in the pool.
  void finish_pass() {
    while (!pending_.empty()) wait_oldest();
    if constexpr (level == 3) {
      drop(next_);
      drop(held_);
    }
    const bool recorded = recording_;
    recording_ = false;
    pos_ = 0;
    if (level == 3 && recorded && o_.prefetch && !dry_) rehearse();
  }
  /// Level 3, after a pass that recorded the order: replay the buffer traffic
  /// of the next pass (with prefetching) without communicating, so the pool
  /// holds every buffer the next passes take and they allocate nothing.
  void rehearse() {
    dry_ = true;
    const auto trace = trace_;
    for (const auto& e : trace) {
      const auto& l = leaves_.at(e.offset);
      gather_for(l, e);
      if (e.backward) {
        grad_buf_ = acquire(l.count);
        scatter_grads(l);
      }
      done_with(l);
    }
    finish_pass();
    dry_ = false;
  }

  struct zero_hooks final : layer_hooks {
    explicit zero_hooks(sharded* s) : self(s) {}
    sharded* self;
    layer_hooks* next = nullptr;  // hooks that were set before ours (e.g. a trace): called inside ours
    void before_forward(const leaf_ref& r) override {
      if (r.count) self->leaf_before_forward(r);
      if (next) next->before_forward(r);
    }
    void after_forward(const leaf_ref& r) override {
      if (next) next->after_forward(r);
      if (r.count) self->leaf_after_forward(r);
    }
    void before_backward(const leaf_ref& r) override {
      if (r.count) self->leaf_before_backward(r);
      if (next) next->before_backward(r);
    }
    void after_backward(const leaf_ref& r) override {
      if (next) next->after_backward(r);
      if (r.count) self->leaf_after_backward(r);
    }
  };

  const context* ctx_;
  world_comm* comm_;
  shard_options o_;
  inner_model model_;
  index_t n_ = 0, begin_ = 0, end_ = 0;
  std::vector<index_t> counts_, starts_;
  tensor<float> full_params_, full_grads_, shard_params_, shard_grads_;
  // level 1
  std::vector<bucket> buckets_;
  std::size_t next_bucket_ = 0;
  // levels 2–3
  zero_hooks hooks_;
  std::unordered_map<index_t, leaf_info> leaves_;
  std::vector<buffer> pool_;
  std::vector<pending> pending_;
  int pending_leaves_ = 0;
  std::vector<index_t> scratch_counts_;
  int grad_buf_ = -1;
  gathered held_, next_;
  std::vector<event> trace_;
  std::size_t pos_ = 0;
  bool recording_ = true;
  bool dry_ = false;  // rehearse(): buffers only, no communication
};

}  // namespace whale
