// The lowered program against the run: for each plan, the bytes one training
// step sends and receives on this rank, as the communicators count them, equal
// the program's totals; the operations it issues on each communicator equal the
// program's over that group in kind, size, peer and order, and its collectives
// the program's in order across groups, from the first step on; its leaves run
// in the order of the program's compute operations; and what the rank holds
// equals the program's holdings — on every rank, at 1, 2 and 4 ranks.
// This ties plan/lower.hpp to the runtimes: a collective the program forgets,
// invents, or orders otherwise fails here.
#include <doctest/doctest.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "whale/comm/context.hpp"
#include "whale/models/gpt.hpp"
#include "whale/nn/gelu.hpp"
#include "whale/nn/relu.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/plan/lower.hpp"
#include "whale/plan/memory.hpp"
#include "whale/runtime/make.hpp"
#include "whale/train/trainer.hpp"
#include "support/plan_check.hpp"

using namespace whale;

namespace {
// Legend: B sequences per step, T tokens per sequence.
using mlp = sequential<linear<16, 32>, gelu, linear<32, 32>, gelu, linear<32, 8>, softmax_cross_entropy>;
using megatron = sequential<linear<16, 32>, split<sequential<linear<32, 64>, gelu, linear<64, 32>>>, linear<32, 8>,
                            softmax_cross_entropy>;
using xc_small = sequential<replicate<sequential<linear<16, 32>, relu>>,
                            split<sequential<linear<32, 64>, softmax_cross_entropy>, axis::data>>;
using small_gpt = models::gpt_model<64, 16, 32, 2, 64, 4>;  // vocabulary 64, 16 positions, width 32, 2 heads
// small_gpt with its blocks recomputed in backward
using rec_gpt = sequential<embedding<64, 32>, position_embedding<16, 32>, repeat<4, recompute<transformer_block<32, 2, 64>>>,
                           layer_norm<32>, linear<32, 64>, softmax_cross_entropy>;
using tp_gpt = sequential<split<embedding<64, 32>>, position_embedding<16, 32>, repeat<2, split<transformer_block<32, 2, 64>>>,
                          layer_norm<32>, split<sequential<linear<32, 64>, softmax_cross_entropy>>>;

struct measured {
  std::int64_t sent = 0, received = 0;
  memory_stats memory;  ///< peaks by category over the run, less what was live before it
  std::array<std::vector<std::string>, 8> calls;  ///< by group (axes' bits): the operations issued, in order
  std::vector<std::string> collectives;  ///< every group's collectives, "group: said", in the order issued across groups
  std::array<std::vector<std::string>, 8> first_calls;  ///< the same as `calls`, of the first step
  std::vector<leaf_use> uses;  ///< the leaves with parameters as a step ran them (their flat offsets)
  /// In that step, in the order they happened: each leaf's backward ending ("b" and its flat
  /// offset) and each all-reduce over data ("a" and its count), from the process's call counter.
  std::vector<std::pair<char, index_t>> data_timeline;
  pass_order order;          ///< the order the step's passes ran in
  bool program_order = false;  ///< taken from the step's program
};

/// An operation as the program and the communicators both can say it:
/// "all_reduce 96", "reduce_scatter keeps 24", "all_gather 48", "send 128 to 3".
std::string said(const op& o) {
  const auto n = std::to_string(o.elements);
  if (o.kind == op_kind::send) return "send " + n + " to " + std::to_string(o.peer);
  if (o.kind == op_kind::recv) return "recv " + n + " from " + std::to_string(o.peer);
  switch (o.coll) {
    case coll_kind::all_reduce: return "all_reduce " + n;
    case coll_kind::all_gather: return "all_gather " + n;
    case coll_kind::reduce_scatter: return "reduce_scatter keeps " + std::to_string(o.mine);
    case coll_kind::broadcast: return "broadcast " + n;
  }
  return "?";
}
/// The same for an operation a communicator of `size` ranks issued.
std::string said(const detail::mpi_comm_state::call& c, int size) {
  const auto n = std::to_string(c.count);
  switch (c.op) {
    case detail::coll::all_reduce: return "all_reduce " + n;
    case detail::coll::all_gather: return "all_gather " + std::to_string(c.count * size);
    case detail::coll::all_gather_v: return "all_gather " + std::to_string(c.total);
    case detail::coll::reduce_scatter:
    case detail::coll::reduce_scatter_v: return "reduce_scatter keeps " + n;
    case detail::coll::broadcast: return "broadcast " + n;
    case detail::coll::send: return "send " + n + " to " + std::to_string(c.peer);
    case detail::coll::recv: return "recv " + n + " from " + std::to_string(c.peer);
    default: return detail::to_string(c.op);
  }
}

/// Uses with each offset replaced by its place among the offsets used: the hooks see the
/// model's flat offsets, the program this rank's buffer's (a stage's, or interleaved
/// chunks back to back), both in the model's order.
std::vector<leaf_use> ranked(std::vector<leaf_use> uses) {
  std::vector<index_t> at;
  for (const auto& u : uses) at.push_back(u.local_offset);
  std::sort(at.begin(), at.end());
  at.erase(std::unique(at.begin(), at.end()), at.end());
  for (auto& u : uses) u.local_offset = std::lower_bound(at.begin(), at.end(), u.local_offset) - at.begin();
  return uses;
}

/// Every leaf with parameters a pass runs, as layer hooks see them: its flat offset and
/// count, forward (or recompute) or backward.
struct use_recorder final : layer_hooks {
  std::vector<leaf_use> uses;
  std::vector<std::pair<std::uint64_t, index_t>> backward_ends;  // (place among the recorded calls, flat offset)
  void after_backward(const leaf_ref& r) override {
    if (r.count) backward_ends.push_back({detail::mpi_comm_state::next_recorded(), r.offset});
  }
  void before_forward(const leaf_ref& r) override {
    if (r.count) uses.push_back({r.offset, r.count, false});
  }
  void before_backward(const leaf_ref& r) override {
    if (r.count) uses.push_back({r.offset, r.count, true});
  }
};

/// Train plan P for 3 steps on `spec`; the traffic of the third step on this rank,
/// and the parameters this rank holds; then one more training step, its leaves recorded.
template <class P, class Data>
std::pair<measured, index_t> run(const context& ctx, Data data, plan_options po, index_t batch, index_t seq) {
  // the process's activation pool keeps the buffers of plans run before (recompute<...>
  // takes its blocks' buffers from it): returned to the heap, so this plan's peak is its own
  detail::activation_pool::instance().trim();
  const auto start = memory_snapshot();
  reset_memory_peaks();
  auto net = make<P>(ctx, seed{42}, po);
  trainer t(net, sgd{.lr = 0.01f, .momentum = 0.9f}, test::quiet());
  auto stats = [&] {
    auto s = ctx.mesh().stats();
    s += ctx.world().stats();
    return s;
  };
  auto group_comm = [&](unsigned b) -> world_comm& { return ctx.mesh().comm(axes::from_bits(b)); };
  measured m;
  for (unsigned b = 1; b < 7; ++b) group_comm(b).record_calls(true);  // the first step (not the world's: its memory check agrees over it)
  t.step(data, 0);
  for (unsigned b = 1; b < 7; ++b) {
    auto& c = group_comm(b);
    if (c.size() > 1)
      for (const auto& call : c.recorded_calls()) m.first_calls[b].push_back(said(call, c.size()));
    c.record_calls(false);
  }
  t.step(data, 1);
  const auto before = stats();
  for (unsigned b = 1; b < 8; ++b) group_comm(b).record_calls(true);
  ctx.world().record_calls(true);
  t.step(data, 2);
  const auto after = stats();
  std::vector<std::pair<std::uint64_t, std::string>> across;  // (place among the process's calls, "group: said")
  for (unsigned b = 1; b < 8; ++b) {  // the world's calls are the group of every axis
    for (auto* c : {&group_comm(b), b == 7 ? &ctx.world() : nullptr}) {
      if (!c) continue;
      if (c->size() > 1)
        for (const auto& call : c->recorded_calls()) {
          m.calls[b].push_back(said(call, c->size()));
          if (call.peer < 0) across.emplace_back(call.order, axes::from_bits(b).name() + ": " + m.calls[b].back());
        }
      c->record_calls(false);
    }
  }
  std::sort(across.begin(), across.end());
  for (auto& [order, what] : across) m.collectives.push_back(std::move(what));
  auto mem = memory_snapshot();
  for (int k = 0; k < mem_kind_count; ++k) mem.peak[static_cast<std::size_t>(k)] -= start.live[static_cast<std::size_t>(k)];
  m.order = net.pass_order_run(), m.program_order = net.runs_program_order();
  {  // the compute: one more training step's leaves, in the order they ran
    use_recorder rec;
    const auto [first, count] = net.local_batch(batch);
    auto b = data.get(3, first, count);
    step_ctx c;
    c.batch = count, c.seq = seq, c.global_rows = batch * seq;
    c.hooks = &rec;
    auto& data_comm = group_comm(1);
    data_comm.record_calls(true);
    (void)net.train_step(c, b.inputs, b.labels);
    std::vector<std::tuple<std::uint64_t, char, index_t>> timeline;
    for (const auto& [order, offset] : rec.backward_ends) timeline.emplace_back(order, 'b', offset);
    if (data_comm.size() > 1)
      for (const auto& call : data_comm.recorded_calls())
        if (call.op == detail::coll::all_reduce) timeline.emplace_back(call.order, 'a', call.count);
    data_comm.record_calls(false);
    std::sort(timeline.begin(), timeline.end());
    for (const auto& [order, what, n] : timeline) m.data_timeline.push_back({what, n});
    m.uses = std::move(rec.uses);
  }
  m.sent = after.bytes_sent - before.bytes_sent, m.received = after.bytes_received - before.bytes_received, m.memory = mem;
  return {m, net.param_count()};
}

template <class P, class Data>
void check_plan(const std::string& spec, Data make_data, index_t batch, index_t seq, lower_options o = {}) {
  auto po = plan_options::from_env();  // as make<P>(ctx, seed) takes them, with the lowering's micro-batches
  if (o.micro_batches > 0) po.micro_batches = o.micro_batches;
  po.bucket_mib = o.bucket_mib;      // the lowering's buckets are the run's
  po.overlap = o.overlap_buckets;
  auto ctx = test::on_mesh(spec);
  o.global_batch = batch;
  o.seq = seq;
  o.optimizer_bytes_per_param = 4;  // SGD with momentum
  try {  // a plan error is the same on every rank: report it here, before the context goes
    const auto prog = lower<P>(ctx.mesh().shape(), ctx.rank(), o);
    const auto [m, held] = run<P>(ctx, make_data(), po, batch, seq);
    const auto t = prog.totals();
    INFO("plan " << layer_name<P>() << " on " << spec << ", rank " << ctx.rank() << "\n" << prog);
    CHECK(t.bytes_sent == m.sent);
    CHECK(t.bytes_received == m.received);
    CHECK(t.params_held == held);
    // the passes ran in the order of the step's program, which is this one's
    CHECK(m.program_order);
    CHECK(m.order.micro_batches == prog.micro_batches);
    CHECK(m.order.actions == prog.order.actions);
    CHECK(m.order.rounds == prog.order.rounds);
    CHECK(m.order.messages == prog.order.messages);
    CHECK(m.order.report.slot == prog.order.report.slot);
    // every communicator's operations, in the order issued, are the program's over that group
    for (unsigned b = 1; b < 8; ++b) {
      std::vector<std::string> want;
      for (const auto& o : prog.ops) {
        const bool talks = o.kind == op_kind::send || o.kind == op_kind::recv || o.kind == op_kind::collective;
        if (talks && o.group_size > 1 && o.group.bits() == b) want.push_back(said(o));
      }
      // in order: the collectives, and the messages to or from each peer (a receive is posted as
      // soon as its buffer is free, before operations the program orders first; messages match
      // by peer and tag, so only each peer's own order matters)
      auto stream_of = [](const std::string& x) {  // "" for collectives, "send ... to 3" -> "send to 3"
        if (!x.starts_with("send ") && !x.starts_with("recv ")) return std::string();
        return x.substr(0, 4) + x.substr(x.rfind(' ', x.rfind(' ') - 1));
      };
      std::vector<std::string> streams{""};
      for (const auto& x : want) streams.push_back(stream_of(x));
      std::sort(streams.begin(), streams.end());
      streams.erase(std::unique(streams.begin(), streams.end()), streams.end());
      for (const auto& k : streams) {
        auto stream = [&](const std::vector<std::string>& all) {
          std::vector<std::string> r;
          for (const auto& x : all)
            if (stream_of(x) == k) r.push_back(x);
          return r;
        };
        const auto w = stream(want), g = stream(m.calls[b]);
        std::ostringstream ws, gs;
        for (const auto& x : w) ws << "\n  " << x;
        for (const auto& x : g) gs << "\n  " << x;
        INFO("group " << axes::from_bits(b).name() << ", " << (k.empty() ? std::string("collectives") : k)
                      << ": the program's" << ws.str() << "\nissued" << gs.str());
        CHECK(g == w);
      }
      // nothing issued that the program lacks (a message to a peer it never names)
      std::size_t counted = 0;
      for (const auto& x : m.calls[b]) counted += std::find(streams.begin(), streams.end(), stream_of(x)) != streams.end();
      CHECK(counted == m.calls[b].size());
    }
    // the compute ran as the program lists it: every leaf with parameters, forward, recomputed
    // and backward, in the program's order (the order ZeRO-3 gathers in)
    {
      const auto want = ranked(prog.leaf_uses());
      const auto ran = ranked(m.uses);
      std::ostringstream ws, gs;
      for (const auto& u : want) ws << " " << (u.backward ? "b" : "f") << u.local_offset;
      for (const auto& u : ran) gs << " " << (u.backward ? "b" : "f") << u.local_offset;
      INFO("the leaves' uses (each leaf by its place in this rank's order): the program's" << ws.str() << "\nran" << gs.str());
      CHECK(ran == want);
    }
    // each gradient bucket's all-reduce went right after the backward its launch point names
    // (or after the last backward): the latest backward to end before it is that leaf's
    if (!prog.grad_buckets.empty()) {
      const auto at = prog.bucket_launches();
      std::vector<index_t> offsets;  // the program's leaves with parameters, and the flat offsets the hooks saw, by place
      for (const auto& u : prog.leaf_uses()) offsets.push_back(u.local_offset);
      std::vector<index_t> seen;
      for (const auto& u : m.uses) seen.push_back(u.local_offset);
      for (auto* v : {&offsets, &seen}) {
        std::sort(v->begin(), v->end());
        v->erase(std::unique(v->begin(), v->end()), v->end());
      }
      REQUIRE(offsets.size() == seen.size());
      std::size_t k = 0, backwards = 0;
      index_t last = -1;  // the flat offset of the latest backward to end
      for (const auto& [what, n] : m.data_timeline) {
        if (what == 'b') {
          last = n, ++backwards;
          continue;
        }
        if (k >= at.size() || n != prog.grad_buckets[k].second - prog.grad_buckets[k].first) continue;  // not a bucket
        INFO("bucket " << k << " [" << prog.grad_buckets[k].first << ", " << prog.grad_buckets[k].second << "), launch point "
                       << at[k] << ", after the backward of the leaf at flat offset " << last);
        if (at[k] == program::after_backward) {
          CHECK(backwards == m.uses.size() - static_cast<std::size_t>(std::count_if(m.uses.begin(), m.uses.end(), [](const leaf_use& u) { return !u.backward; })));
        } else {
          const auto place = std::lower_bound(offsets.begin(), offsets.end(), at[k]) - offsets.begin();
          CHECK(last == seen[static_cast<std::size_t>(place)]);
        }
        ++k;
      }
      CHECK(k == at.size());
    }
    // the first step issues what later steps do (ZeRO-3 gathers in the program's order from
    // the first, prefetching: nothing is recorded first); the world aside
    for (unsigned b = 1; b < 7; ++b) {
      INFO("group " << axes::from_bits(b).name() << ": the first step's operations against the third's");
      CHECK(m.first_calls[b] == m.calls[b]);
    }
    // the collectives of every group in one order, as the program's operations and their
    // dependencies order them: a bucket's all-reduce right after the backward it waits for,
    // before the model group's collectives of the layers before it
    {
      std::vector<std::string> want;
      for (const auto& o : prog.ops)
        if (o.kind == op_kind::collective && o.group_size > 1) want.push_back(o.group.name() + ": " + said(o));
      std::ostringstream ws, gs;
      for (const auto& x : want) ws << "\n  " << x;
      for (const auto& x : m.collectives) gs << "\n  " << x;
      INFO("every group's collectives: the program's" << ws.str() << "\nissued" << gs.str());
      CHECK(m.collectives == want);
    }
    // the predicted memory (plan/memory.hpp) against the tracker's peaks: model
    // state exactly, activations within 5% (and 4 KiB), buffers within bounds
    const auto e = predict_memory(describe<P>(), prog);
    INFO("predicted " << e << "\nmeasured " << m.memory);
    CHECK(e.params == m.memory.peak_of(mem_kind::params));
    CHECK(e.grads == m.memory.peak_of(mem_kind::grads));
    CHECK(e.optimizer == m.memory.peak_of(mem_kind::optimizer));
    const auto near = [](std::int64_t predicted, std::int64_t measured) {
      return static_cast<double>(std::llabs(predicted - measured)) <= 0.05 * static_cast<double>(std::max<std::int64_t>(measured, 1)) + 4096;
    };
    CHECK(near(e.activations, m.memory.peak_of(mem_kind::activations)));
    // pipelines: one outgoing copy per live micro-batch is an upper bound (as many exist as sends are unfinished)
    const auto comm = m.memory.peak_of(mem_kind::comm);
    if (!(prog.zero_level >= 2 && ctx.mesh().shape().size(axis::data) == 1)) {  // (ZeRO on one data rank: buffers for no collective, not predicted)
      INFO("comm predicted " << e.comm << " bytes, measured " << comm);
      CHECK(e.comm >= comm - 4096);
      CHECK(e.comm <= 2 * comm + 4096);
    }
  } catch (const std::exception& e) {
    FAIL_CHECK("plan " << layer_name<P>() << " on " << spec << ": " << std::string(e.what()));
  }
}

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
std::string data_mesh(int n) { return "data=" + std::to_string(n); }
}  // namespace

TEST_CASE("program bytes equal the counted bytes: replicate") {
  const int n = world_size();
  check_plan<replicate<mlp>>(data_mesh(n), [] { return teacher_data(seed{7}, 16, 8, 8); }, 8, 1);
}

TEST_CASE("program bytes equal the counted bytes: split over model (Megatron pair), with and without data") {
  const int n = world_size();
  check_plan<megatron>("model=" + std::to_string(n), [] { return teacher_data(seed{7}, 16, 8, 8); }, 8, 1);
  if (n == 4) check_plan<megatron>("data=2,model=2", [] { return teacher_data(seed{7}, 16, 8, 8); }, 8, 1);
}

TEST_CASE("program bytes equal the counted bytes: Whale's xc plan (classifier split over data)") {
  const int n = world_size();
  check_plan<xc_small>(data_mesh(n), [] { return teacher_data(seed{7}, 16, 64, 8); }, 8, 1);
}

TEST_CASE("program bytes equal the counted bytes: tensor-parallel gpt") {
  const int n = world_size();
  const std::string spec = n == 4 ? "data=2,model=2" : "model=" + std::to_string(n);
  check_plan<tp_gpt>(spec, [] { return markov_data(seed{7}, 64, 16, 4); }, 4, 16);
  // the whole model split (auto_plan's tensor-parallel candidate): a split residual ends in
  // its exit all-reduce, whose unit carries the residual's stream buffers
  check_plan<split<small_gpt, axis::model>>(spec, [] { return markov_data(seed{7}, 64, 16, 4); }, 4, 16);
}

TEST_CASE("program bytes equal the counted bytes: pipelines (1F1B, ZB-H1 and interleaved cut at run time, GPipe explicit, data x pipe)") {
  const int n = world_size();
  check_plan<pipeline<one_f_one_b, small_gpt>>("pipe=" + std::to_string(n), [] { return markov_data(seed{7}, 64, 16, 8); },
                                               8, 16);
  if (n <= 2) {  // the zero-bubble and interleaved schedules (4 blocks: at most 2 pipe ranks of 2 chunks)
    check_plan<pipeline<zb_h1, small_gpt>>("pipe=" + std::to_string(n), [] { return markov_data(seed{7}, 64, 16, 8); }, 8, 16);
    check_plan<pipeline<interleaved_1f1b<2>, small_gpt>>("pipe=" + std::to_string(n),
                                                         [] { return markov_data(seed{7}, 64, 16, 8); }, 8, 16);
  }
  if (n == 2) {
    using two = pipeline<gpipe, stage<linear<16, 32>, gelu>, stage<linear<32, 8>, softmax_cross_entropy>>;
    check_plan<two>("pipe=2", [] { return teacher_data(seed{7}, 16, 8, 8); }, 8, 1);
  }
  if (n == 4) {
    check_plan<replicate<pipeline<one_f_one_b, small_gpt>>>("data=2,pipe=2", [] { return markov_data(seed{7}, 64, 16, 8); },
                                                            8, 16);
    using tp_pipe = pipeline<one_f_one_b, tp_gpt>;
    check_plan<tp_pipe>("pipe=2,model=2", [] { return markov_data(seed{7}, 64, 16, 8); }, 8, 16);
  }
}

TEST_CASE("program bytes equal the counted bytes: ZeRO levels 1, 2, 3") {
  const int n = world_size();
  check_plan<shard<mlp, 1>>(data_mesh(n), [] { return teacher_data(seed{7}, 16, 8, 8); }, 8, 1);
  check_plan<shard<mlp, 2>>(data_mesh(n), [] { return teacher_data(seed{7}, 16, 8, 8); }, 8, 1);
  check_plan<shard<mlp, 3>>(data_mesh(n), [] { return teacher_data(seed{7}, 16, 8, 8); }, 8, 1);
  check_plan<shard<small_gpt, 3>>(data_mesh(n), [] { return markov_data(seed{7}, 64, 16, 4); }, 4, 16);
}

TEST_CASE("program operations equal the issued ones: ZeRO 2 and 3 over several micro-batches") {
  // one engine pass spans the step's micro-batches: ZeRO-3's gathers run one leaf ahead across them
  const int n = world_size();
  lower_options two;
  two.micro_batches = 2;
  check_plan<shard<mlp, 2>>(data_mesh(n), [] { return teacher_data(seed{7}, 16, 8, 8); }, 8, 1, two);
  check_plan<shard<mlp, 3>>(data_mesh(n), [] { return teacher_data(seed{7}, 16, 8, 8); }, 8, 1, two);
  check_plan<shard<small_gpt, 3>>(data_mesh(n), [] { return markov_data(seed{7}, 64, 16, 8); }, 8, 16, two);
}

TEST_CASE("program operations equal the issued ones: ZeRO-3 inside pipeline stages, and with the blocks recomputed") {
  const int n = world_size();
  const std::string pipe = n >= 4 ? "data=" + std::to_string(n / 2) + ",pipe=2" : n == 2 ? "data=1,pipe=2" : "data=1";
  const auto tokens = [] { return markov_data(seed{7}, 64, 16, 8); };
  check_plan<shard<pipeline<one_f_one_b, small_gpt>, 3>>(pipe, tokens, 8, 16);
  check_plan<shard<rec_gpt, 3>>(data_mesh(n), tokens, 8, 16);
  check_plan<shard<pipeline<one_f_one_b, rec_gpt>, 3>>(pipe, tokens, 8, 16);
}

TEST_CASE("program operations equal the issued ones: ZeRO with tensor parallelism and with pipelines, schedules over data, micro-batches without a pipeline") {
  // the compositions of docs/compositions.md that the cases above leave out (3-D needs 8 ranks: mpi_compose)
  const int n = world_size();
  const auto tokens = [] { return markov_data(seed{7}, 64, 16, 8); };
  lower_options two;
  two.micro_batches = 2;
  // gradient accumulation inside a step: the buckets are summed after the last micro-batch
  check_plan<replicate<small_gpt>>(data_mesh(n), tokens, 8, 16, two);
  check_plan<tp_gpt>(n == 4 ? "data=2,model=2" : "model=" + std::to_string(n), tokens, 8, 16, two);
  if (n == 4) {
    const auto four = [] { return markov_data(seed{7}, 64, 16, 4); };
    check_plan<shard<tp_gpt, 1>>("data=2,model=2", four, 4, 16);
    check_plan<shard<tp_gpt, 2>>("data=2,model=2", four, 4, 16);
    check_plan<shard<tp_gpt, 3>>("data=2,model=2", four, 4, 16);
    check_plan<shard<pipeline<one_f_one_b, small_gpt>, 1>>("data=2,pipe=2", tokens, 8, 16);
    check_plan<shard<pipeline<one_f_one_b, small_gpt>, 2>>("data=2,pipe=2", tokens, 8, 16);
    check_plan<replicate<pipeline<zb_h1, small_gpt>>>("data=2,pipe=2", tokens, 8, 16);
    check_plan<shard<pipeline<zb_h1, small_gpt>, 1>>("data=2,pipe=2", tokens, 8, 16);
    check_plan<replicate<pipeline<interleaved_1f1b<2>, small_gpt>>>("data=2,pipe=2", tokens, 8, 16);
    check_plan<shard<pipeline<interleaved_1f1b<2>, small_gpt>, 1>>("data=2,pipe=2", tokens, 8, 16);
  }
}

TEST_CASE("program operations equal the issued ones: small buckets summed as the backward that finishes each ends, and after backward without overlap") {
  // many buckets: each all-reduce over data goes right after the leaf whose backward finishes it, among the
  // model group's collectives of the layers before it (the order across groups); without overlap, all at the end
  const int n = world_size();
  const auto tokens = [] { return markov_data(seed{7}, 64, 16, 8); };
  lower_options small;
  small.bucket_mib = 4096.0 / 1048576.0;  // 1,024 floats a bucket
  check_plan<replicate<small_gpt>>(data_mesh(n), tokens, 8, 16, small);
  if (n == 4) {
    check_plan<tp_gpt>("data=2,model=2", tokens, 8, 16, small);
    check_plan<megatron>("data=2,model=2", [] { return teacher_data(seed{7}, 16, 8, 8); }, 8, 1, small);
    check_plan<replicate<pipeline<one_f_one_b, small_gpt>>>("data=2,pipe=2", tokens, 8, 16, small);
  }
  lower_options late = small;
  late.overlap_buckets = false;
  check_plan<replicate<small_gpt>>(data_mesh(n), tokens, 8, 16, late);
  if (n == 4) check_plan<tp_gpt>("data=2,model=2", tokens, 8, 16, late);
}
