// Checkpoints of any plan: `save_checkpoint` / `load_checkpoint` (collective),
// sharded by what each rank owns, and loadable under any other plan or mesh.
//
// Each rank writes only the unsplit-parameter slices it owns (with their
// optimizer state): a replica group's slices once (data coordinate 0, or the
// ZeRO owner of each range), a tensor-parallel shard once per shard, a
// replicated tail (a row-parallel bias) once. Loading reads, on every rank,
// exactly the slices its lowered program places there, from whichever files
// hold them: no gather, and any plan, mesh or world size on either side. The
// files and their format: train/checkpoint_format.hpp, docs/checkpoints.md. A
// network on a device (a GPU, the guarded backend) is saved from, and loaded
// into, host copies of its parameters and optimizer state.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/detail/compiled.hpp"
#include "whale/nn/layer.hpp"
#include "whale/optim/optimizer.hpp"
#include "whale/plan/describe.hpp"
#include "whale/plan/program.hpp"
#include "whale/train/checkpoint_dir.hpp"
#include "whale/train/checkpoint_format.hpp"
#include "whale/train/interrupt.hpp"

namespace whale {

/// What a load found.
struct checkpoint_info {
  std::string dir;            ///< the step directory that was read
  std::int64_t step = 0;      ///< the data step to train next (steps done so far)
  std::string plan, mesh;     ///< what it was saved under
  int ranks = 1;
  std::string note;           ///< a complete folder an interrupted save left aside, and how to use it ("" if none)
};

/// A network whose parameters a checkpoint can address: a single-process
/// network<M>, or a plan's executor (its lowered program places each slice).
template <class N>
concept Checkpointable = requires(N& n) {
  typename N::model_type;
  { n.params() } -> std::convertible_to<view<float>>;
  { n.param_count() } -> std::convertible_to<index_t>;
  { n.rank() } -> std::convertible_to<int>;
  { n.world_size() } -> std::convertible_to<int>;
};

namespace ckpt {

/// Where this rank's flat buffer lies in the unsplit model, and what of it the rank writes.
struct layout {
  std::vector<piece> all;   ///< every local parameter
  std::vector<piece> mine;  ///< what this rank writes (it owns them)
  index_t resident_first = 0, resident_end = 0;  ///< local indices present in params()
  index_t state_first = 0, state_end = 0;        ///< local indices the optimizer state covers
};

/// The parts of `ps` whose local index lies in [a, b).
inline std::vector<piece> clip(const std::vector<piece>& ps, index_t a, index_t b) {
  std::vector<piece> out;
  for (const auto& p : ps) {
    const index_t lo = std::max(a, p.local), hi = std::min(b, p.local + p.count);
    if (lo < hi) out.push_back({p.full + (lo - p.local), lo, hi - lo});
  }
  return out;
}

/// A rank's layout from its lowered program.
inline layout layout_of(const program& p, index_t resident_first, index_t resident_end, index_t state_first, index_t state_end) {
  layout L{{}, {}, resident_first, resident_end, state_first, state_end};
  const bool zero = p.zero_level > 0;
  for (const auto& h : p.holds)
    for (const auto& r : h.runs) {
      const piece pc{h.full_offset + r.full, h.local_offset + r.local, r.count};
      L.all.push_back(pc);
      bool writes = true;
      for (int a = 0; a < axis_count; ++a) {
        const auto ax = static_cast<axis>(a);
        const bool copies = h.replicated_over.contains(ax) || (r.whole && h.split_over.contains(ax));
        // under ZeRO, ownership of ranges (below) decides over the data axis
        if (copies && p.coords[static_cast<std::size_t>(a)] != 0 && !(zero && ax == axis::data)) writes = false;
      }
      if (zero && p.mesh.size(axis::data) > 1 && h.split_over.contains(axis::data))
        throw std::invalid_argument("whale: checkpoints: " + h.name + " is split over the data axis under ZeRO; not supported");
      if (writes) L.mine.push_back(pc);
    }
  if (zero) L.mine = clip(L.mine, p.owned_begin, p.owned_end);
  L.mine = clip(L.mine, state_first, state_end);
  return L;
}

template <class Net> layout layout_for(Net& net) {
  if constexpr (requires { net.placement(); }) {
    const index_t n = net.param_count();
    const auto [sb, se] = net.range();
    const bool all = net.params().numel() == n;  // ZeRO 3 keeps only the owned range
    return layout_of(net.placement(), all ? 0 : sb, all ? n : se, sb, se);
  } else {
    const index_t n = net.param_count();
    return {{{0, 0, n}}, {{0, 0, n}}, 0, n, 0, n};
  }
}
template <class Net> std::string plan_name(Net& net) {
  if constexpr (requires { net.placement(); }) return net.placement().plan;
  else return "network<" + layer_name<typename Net::model_type>() + ">";
}
template <class Net> std::string mesh_name(Net& net) {
  if constexpr (requires { net.placement(); }) {
    std::ostringstream o;
    o << net.placement().mesh;
    return o.str();
  } else {
    return "one process";
  }
}

/// The world communicator of a plan, or null for a single process.
template <class Net> world_comm* world_of(Net& net) {
  if constexpr (requires { net.world(); }) return &net.world();
  else return nullptr;
}

/// Rank `root`'s `s` on every rank (`c` null: a single process).
inline void share(world_comm* c, std::string& s, int root = 0) {
  if (!c) return;
  std::int64_t n = static_cast<std::int64_t>(s.size());
  broadcast(*c, view<std::int64_t>(&n, {1}), root);
  s.resize(static_cast<std::size_t>(n));
  if (n > 0) broadcast(*c, view<char>(s.data(), {static_cast<index_t>(n)}), root);
}
/// Every rank learns whether any rank failed, and throws that rank's message
/// (the lowest failing rank's). `c` null: a single process.
inline void agree(world_comm* c, const std::string& err) {
  if (!c) {
    if (!err.empty()) throw std::runtime_error(err);
    return;
  }
  int first = err.empty() ? INT_MAX : c->rank();
  all_reduce(*c, view<int>(&first, {1}), reduce_op::min);
  if (first == INT_MAX) return;
  std::string msg = err;
  share(c, msg, first);
  throw std::runtime_error(first == c->rank() ? msg : "rank " + std::to_string(first) + " reports: " + msg);
}
template <class Net> void agree(Net& net, const std::string& err) { agree(world_of(net), err); }
template <class F> std::string catching(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

/// The unsplit model's tensors (its leaf layers with parameters, flat order).
inline std::vector<unit_rec> units_of(const model_desc& d) {
  std::vector<unit_rec> u;
  index_t at = 0;
  for (const auto& x : d.units) {
    if (x.full_params > 0) u.push_back({at, x.full_params, x.unsplit});
    at += x.full_params;
  }
  return u;
}
template <class M> std::vector<unit_rec> units_of() { return units_of(describe<M>()); }
template <class Opt> std::vector<std::string> vector_names(const Opt& opt) {
  std::vector<std::string> v{"param"};
  auto s = opt.make_state(1);
  for (const auto& sv : s.vectors()) v.push_back(sv.name);
  return v;
}

/// The backend a network keeps its parameters in: the CPU for one without backend().
template <class Net> backend_ref backend_of(const Net& net) {
  if constexpr (requires { net.backend(); }) return net.backend();
  else return {};
}

/// A vector of a network on a device, and its host copy, which save and load
/// read and write (the files are written from host memory).
struct mirror {
  float* device = nullptr;
  std::vector<float> host;
};

/// What save and load need of a network and its optimizer, without their types.
struct target {
  world_comm* comm = nullptr;
  int rank = 0, world = 1;
  layout L;
  float* params = nullptr;              ///< its resident parameters (local index L.resident_first), in host memory
  std::vector<float*> state;            ///< its optimizer vectors (local index L.state_first), in host memory
  std::int64_t* optimizer_steps = nullptr;
  meta expected;                        ///< model, plan, mesh, params, optimizer, vectors, units (no files, no step)
  backend_ref be;                       ///< where the network keeps them
  std::vector<mirror> mirrors;          ///< on a device: the host copies params and state point into
  /// On a device: the host copies, loaded, copied back into the device's
  /// vectors (collective: every rank learns of a failure). Nothing on the CPU.
  void upload() {
    const std::string err = catching([&] {
      for (auto& m : mirrors) be.copy(m.device, m.host.data(), m.host.size() * sizeof(float));
      if (!mirrors.empty()) be.synchronize();
    });
    agree(comm, err);
  }
};
/// `saving`: for a save, where a rank that writes nothing needs no host copies.
template <class Net, class Opt> target target_of(Net& net, const Opt& opt, typename Opt::state& st, bool saving) {
  target t;
  t.comm = world_of(net);
  t.rank = net.rank(), t.world = net.world_size();
  t.be = backend_of(net);
  std::string err = catching([&] { t.L = layout_for(net); });
  agree(t.comm, err);
  auto vectors = st.vectors();
  err = catching([&] {  // on a device, host copies of the parameters and the optimizer state
    auto host_of = [&](view<float> v) -> float* {
      if (t.be.on_cpu() || v.numel() == 0) return v.data();
      if (saving && t.L.mine.empty()) return nullptr;  // writes nothing: not read
      auto& m = t.mirrors.emplace_back();
      m.device = v.data();
      m.host.resize(static_cast<std::size_t>(v.numel()));
      t.be.copy(m.host.data(), v.data(), v.bytes());
      return m.host.data();  // (the heap block stays put when mirrors grows)
    };
    t.params = host_of(net.params());
    for (auto& v : vectors) t.state.push_back(host_of(v.values));
    if (!t.mirrors.empty()) t.be.synchronize();
  });
  agree(t.comm, err);
  t.optimizer_steps = &st.steps;
  auto& m = t.expected;
  m.model = layer_name<typename Net::model_type>();
  m.plan = plan_name(net);
  m.mesh = mesh_name(net);
  m.ranks = t.world;
  const auto d = describe<typename Net::model_type>();
  m.params = d.full_params;
  m.units = units_of(d);
  m.optimizer = Opt::name();
  m.optimizer_steps = st.steps;
  m.vectors = vector_names(opt);
  return t;
}

/// save_checkpoint's work, for any network (see there).
WHALE_CORE_INLINE std::string save(const std::string& dir, target& t, std::int64_t step, int keep_last);

/// load_checkpoint's work, for any network (see there).
WHALE_CORE_INLINE checkpoint_info load(const std::string& path, target& t);

}  // namespace ckpt

/// Save a checkpoint of step `step` (the data steps done) under `dir` as
/// `dir/step-<step>/`, collective over the world: every rank writes its shard,
/// rank 0 the metadata, and the directory appears only once complete. With
/// `keep_last` > 0, older step directories beyond that many are removed. A
/// SIGINT or SIGTERM during the save ends the process once it is done
/// (train/interrupt.hpp).
/// Returns the step directory. Throws on every rank if any rank fails.
template <Checkpointable Net, class Opt>
  requires CheckpointableState<typename Opt::state>
std::string save_checkpoint(const std::string& dir, Net& net, const Opt& opt, typename Opt::state& st, std::int64_t step,
                            int keep_last = 0) {
  const detail::interrupt_deferral finish_first;  // SIGINT/SIGTERM during a save end the process after it
  auto t = ckpt::target_of(net, opt, st, true);
  return ckpt::save(dir, t, step, keep_last);
}

/// Load a checkpoint into `net` and `st` (collective): `path` is a step
/// directory, or a checkpoint directory whose newest complete step is taken.
/// Any plan, mesh and world size may have saved it; every rank reads the
/// slices its program places there. The optimizer must be of the same kind.
/// Throws on every rank, naming the file or the tensor, if it is missing,
/// corrupt, truncated or of another model.
template <Checkpointable Net, class Opt>
  requires CheckpointableState<typename Opt::state>
checkpoint_info load_checkpoint(const std::string& path, Net& net, const Opt& opt, typename Opt::state& st) {
  auto t = ckpt::target_of(net, opt, st, false);
  return ckpt::load(path, t);
}

}  // namespace whale

#if WHALE_CORE_DEFINITIONS  // header-only, or the compiled core's own unit (detail/compiled.hpp)
#include "whale/train/checkpoint_impl.hpp"
#endif
