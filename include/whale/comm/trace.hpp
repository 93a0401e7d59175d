// Timelines: a per-rank recorder of spans (forward/backward of a micro-batch,
// send, receive wait, all-reduce, optimizer), their merge across ranks into one
// Chrome trace-event JSON (one row per rank; open it in Perfetto or
// chrome://tracing), and the pipeline bubble measured from the spans.
// A leaf utility: it needs only comm/ and the standard library, so runtimes in
// strategy/ may record into it. It does not decide what to record.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "whale/comm/collectives.hpp"
#include "whale/detail/io.hpp"

namespace whale {

/// What a span measured.
enum class span_kind : std::int32_t {
  forward,          ///< a stage's forward of one micro-batch
  backward,         ///< a stage's backward of one micro-batch
  send_act,         ///< copy + post of an activation send to the next stage
  send_grad,        ///< copy + post of a gradient send to the previous stage
  recv_act,         ///< waiting for the previous stage's activation
  recv_grad,        ///< waiting for the next stage's gradient
  grad_all_reduce,  ///< waiting for the data-parallel gradient all-reduce after backward
  loss_all_reduce,  ///< summing the loss shares over ranks
  optimizer,        ///< the optimizer step
  weight,           ///< a split schedule's weight-gradient pass of one micro-batch
  wsp_push,         ///< Wave Synchronous Parallel: pushing wave `micro`'s update to the holders
  wsp_wait,         ///< waiting at the end of wave `micro` for the staleness bound
  wsp_pull,         ///< pulling the weights that hold every worker's waves <= `micro`
};
inline constexpr int span_kind_count = 13;
inline const char* to_string(span_kind k) noexcept {
  constexpr const char* names[] = {"forward",   "backward", "send act",  "send grad", "recv act",
                                   "recv grad", "all-reduce grads", "all-reduce loss", "optimizer", "weight",
                                   "wsp push",  "wsp wait", "wsp pull"};
  return names[static_cast<int>(k)];
}
inline const char* category(span_kind k) noexcept {
  switch (k) {
    case span_kind::forward:
    case span_kind::backward:
    case span_kind::weight: return "compute";
    case span_kind::send_act:
    case span_kind::send_grad:
    case span_kind::recv_act:
    case span_kind::recv_grad: return "p2p";
    case span_kind::grad_all_reduce:
    case span_kind::loss_all_reduce: return "collective";
    case span_kind::wsp_push:
    case span_kind::wsp_wait:
    case span_kind::wsp_pull: return "wsp";
    default: return "optimizer";
  }
}

/// One span, plain data (gathered across ranks as bytes).
struct trace_event {
  std::int32_t kind = 0;     ///< span_kind
  std::int32_t rank = 0;     ///< world rank
  std::int32_t stage = 0;    ///< pipeline stage (pipe coordinate)
  std::int32_t replica = 0;  ///< data-parallel replica (data coordinate)
  std::int32_t step = 0;     ///< training step, counted from 0 by the recorder's owner
  std::int32_t micro = -1;   ///< micro-batch, or -1
  double ts_us = 0;          ///< start, microseconds since the common origin
  double dur_us = 0;         ///< duration, microseconds
  span_kind what() const noexcept { return static_cast<span_kind>(kind); }
  /// "F3", "B3", "W3", "recv act 3", "optimizer", ...
  std::string name() const {
    // Appends rather than "F" + std::to_string(...): GCC 12 warns falsely (-Wrestrict) on the latter.
    std::string n;
    if (what() == span_kind::forward) n = "F";
    else if (what() == span_kind::backward) n = "B";
    else if (what() == span_kind::weight) n = "W";
    else {
      n = to_string(what());
      if (micro < 0) return n;
      n += ' ';
    }
    n += std::to_string(micro);
    return n;
  }
};

/// Records this rank's spans. Off by default: `add` is then a no-op.
class tracer {
 public:
  using clock = std::chrono::steady_clock;
  tracer() = default;
  /// Turn recording on; `place` sets the rank/stage/replica every event carries.
  void enable(int rank, int stage, int replica) {
    on_ = true;
    rank_ = rank, stage_ = stage, replica_ = replica;
    origin_ = clock::now();
  }
  bool on() const noexcept { return on_; }
  /// Take the origin now (call right after a barrier so that ranks agree on it).
  void set_origin() noexcept { origin_ = clock::now(); }
  clock::time_point now() const noexcept { return on_ ? clock::now() : clock::time_point{}; }
  /// Record a span [t0, t1) of kind k.
  void add(span_kind k, int step, int micro, clock::time_point t0, clock::time_point t1) {
    if (!on_) return;
    if (events_.size() >= max_events) return;  // a bounded timeline; long runs keep their start
    trace_event e;
    e.kind = static_cast<std::int32_t>(k);
    e.rank = rank_, e.stage = stage_, e.replica = replica_, e.step = step, e.micro = micro;
    e.ts_us = std::chrono::duration<double, std::micro>(t0 - origin_).count();
    e.dur_us = std::chrono::duration<double, std::micro>(t1 - t0).count();
    events_.push_back(e);
  }
  const std::vector<trace_event>& events() const noexcept { return events_; }
  void clear() noexcept { events_.clear(); }
  static constexpr std::size_t max_events = std::size_t{1} << 22;

 private:
  bool on_ = false;
  int rank_ = 0, stage_ = 0, replica_ = 0;
  clock::time_point origin_{};
  std::vector<trace_event> events_;
};

/// Every rank's events, in rank order, on every rank. Collective over `world`.
template <Communicator C> std::vector<trace_event> gather_trace(C& world, const tracer& t) {
  const auto& mine = t.events();
  std::vector<index_t> counts(static_cast<std::size_t>(world.size()));
  index_t n = static_cast<index_t>(mine.size() * sizeof(trace_event));
  all_gather(world, view<index_t, typename C::space>(&n, {1}),
             view<index_t, typename C::space>(counts.data(), {static_cast<index_t>(counts.size())}));
  index_t total = 0;
  for (auto c : counts) total += c;
  std::vector<trace_event> all(static_cast<std::size_t>(total) / sizeof(trace_event));
  std::vector<std::uint8_t> in(static_cast<std::size_t>(n));
  if (n) std::memcpy(in.data(), mine.data(), static_cast<std::size_t>(n));
  all_gather_v(world, view<std::uint8_t, typename C::space>(in.data(), {n}),
               view<std::uint8_t, typename C::space>(reinterpret_cast<std::uint8_t*>(all.data()), {total}), counts);
  return all;
}

/// Chrome trace-event JSON: one process row per rank ("rank R · stage S · replica D"),
/// complete events ("ph": "X") in microseconds.
inline std::string trace_json(const std::vector<trace_event>& ev) {
  std::string s = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  std::map<int, std::pair<int, int>> ranks;
  for (const auto& e : ev) ranks[e.rank] = {e.stage, e.replica};
  bool first = true;
  auto sep = [&] {
    if (!first) s += ",\n";
    first = false;
  };
  char b[512];
  for (const auto& [r, sr] : ranks) {
    sep();
    std::snprintf(b, sizeof b,
                  "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": %d, \"tid\": 0, \"args\": {\"name\": "
                  "\"rank %d \\u00b7 stage %d \\u00b7 replica %d\"}}",
                  r, r, sr.first, sr.second);
    s += b;
    sep();
    std::snprintf(b, sizeof b,
                  "{\"ph\": \"M\", \"name\": \"process_sort_index\", \"pid\": %d, \"tid\": 0, \"args\": "
                  "{\"sort_index\": %d}}",
                  r, r);
    s += b;
  }
  for (const auto& e : ev) {
    sep();
    std::snprintf(b, sizeof b,
                  "{\"ph\": \"X\", \"name\": \"%s\", \"cat\": \"%s\", \"pid\": %d, \"tid\": 0, \"ts\": %.3f, "
                  "\"dur\": %.3f, \"args\": {\"step\": %d, \"micro\": %d, \"stage\": %d}}",
                  e.name().c_str(), category(e.what()), e.rank, e.ts_us, e.dur_us, e.step, e.micro, e.stage);
    s += b;
  }
  s += "\n]}\n";
  return s;
}

/// Write trace_json(ev) to `path` atomically (a temporary beside it, then
/// renamed); throws std::runtime_error naming the path and the system's reason.
inline void write_trace(const std::string& path, const std::vector<trace_event>& ev) {
  detail::write_file_atomically(path, trace_json(ev), "whale::trace");
}

/// Before any work: rank 0 checks that `path` can be written and every rank of
/// `world` learns its verdict; throws std::invalid_argument on every rank,
/// naming `origin`, the path and the reason (collective).
template <class W> void check_output_path(W& world, const std::string& path, const std::string& origin) {
  std::string problem = world.rank() == 0 ? detail::output_path_problem(path) : std::string();
  index_t n = static_cast<index_t>(problem.size());
  broadcast(world, view<index_t>(&n, {1}), 0);
  problem.resize(static_cast<std::size_t>(n));
  if (n > 0) broadcast(world, view<std::uint8_t>(reinterpret_cast<std::uint8_t*>(problem.data()), {n}), 0);
  if (n > 0) throw std::invalid_argument(origin + " '" + path + "': " + problem + "; nothing was run");
}

/// The pipeline bubble measured from a merged trace: for each step and
/// replica, the window runs from the first forward to the last backward on any
/// stage; stage s's bubble is the part of the window it spent outside its own
/// forward and backward spans. Per stage: the mean over steps >= `first_step`
/// and over replicas.
/// With unequal stages the faster ones also idle while they wait for the
/// slowest; `bottleneck` (the idle fraction of the busiest stage, which sets
/// the step time) is the bubble that (p-1)/(m+p-1) models, and `imbalance`
/// (1 - least busy / most busy) is the rest.
struct bubble_report {
  std::vector<double> per_stage;  ///< idle fraction of each stage
  std::vector<double> busy_us;    ///< forward + backward time of each stage, per step
  double mean = 0;                ///< mean over stages
  double bottleneck = 0;          ///< idle fraction of the busiest stage
  double imbalance = 0;           ///< 1 - min(busy) / max(busy)
  int steps = 0;                  ///< steps measured
};
inline bubble_report measure_bubble(const std::vector<trace_event>& ev, int first_step = 0) {
  struct window {
    double begin = 1e300, end = -1e300;
  };
  std::map<std::pair<int, int>, window> win;                   // (step, replica)
  std::map<std::tuple<int, int, int>, double> busy;            // (step, replica, stage)
  int stages = 0;
  for (const auto& e : ev) {
    if (e.step < first_step) continue;
    if (e.what() != span_kind::forward && e.what() != span_kind::backward && e.what() != span_kind::weight) continue;
    auto& w = win[{e.step, e.replica}];
    w.begin = std::min(w.begin, e.ts_us);
    w.end = std::max(w.end, e.ts_us + e.dur_us);
    busy[{e.step, e.replica, e.stage}] += e.dur_us;
    stages = std::max(stages, e.stage + 1);
  }
  bubble_report r;
  r.per_stage.assign(static_cast<std::size_t>(stages), 0.0);
  r.busy_us.assign(static_cast<std::size_t>(stages), 0.0);
  std::vector<int> n(static_cast<std::size_t>(stages), 0);
  std::map<int, int> steps;
  for (const auto& [k, b] : busy) {
    const auto& w = win[{std::get<0>(k), std::get<1>(k)}];
    const double len = w.end - w.begin;
    if (len <= 0) continue;
    const auto s = static_cast<std::size_t>(std::get<2>(k));
    r.per_stage[s] += 1.0 - b / len;
    r.busy_us[s] += b;
    ++n[s];
    steps[std::get<0>(k)] = 1;
  }
  double sum = 0;
  for (std::size_t s = 0; s < r.per_stage.size(); ++s) {
    if (n[s]) r.per_stage[s] /= n[s], r.busy_us[s] /= n[s];
    sum += r.per_stage[s];
  }
  if (stages) {
    const auto hi = std::max_element(r.busy_us.begin(), r.busy_us.end());
    const auto lo = std::min_element(r.busy_us.begin(), r.busy_us.end());
    r.bottleneck = r.per_stage[static_cast<std::size_t>(hi - r.busy_us.begin())];
    r.imbalance = *hi > 0 ? 1.0 - *lo / *hi : 0.0;
  }
  r.mean = stages ? sum / stages : 0.0;
  r.steps = static_cast<int>(steps.size());
  return r;
}

}  // namespace whale
