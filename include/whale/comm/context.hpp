// whale::context: process start-up and shut-down. Initializes MPI when built
// with whale::mpi (else a world of one local rank), reads and removes whale's
// flags (--mesh, --threads), builds the mesh, installs failure handling.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "whale/backend/cpu.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/failure.hpp"
#include "whale/comm/local_comm.hpp"
#include "whale/comm/mesh.hpp"
#ifdef WHALE_HAS_MPI
#include "whale/comm/mpi_comm.hpp"
#endif

namespace whale {

/// The communicator of the world: mpi_comm with whale::mpi, else local_comm.
#ifdef WHALE_HAS_MPI
using world_comm = mpi_comm;
#else
using world_comm = local_comm;
#endif
using mesh = basic_mesh<world_comm>;

namespace detail {
/// whale's own command-line flags, removed from argv by context::init.
struct context_flags {
  std::optional<std::string> mesh;     // --mesh SPEC | --mesh=SPEC
  std::optional<std::string> threads;  // --threads N | --threads=N
};

/// Remove whale's flags from argv (argv[argc] stays nullptr), returning them.
/// Throws mesh_error for a flag without its value.
inline context_flags take_flags(int& argc, char** argv) {
  context_flags f;
  int out = argc > 0 ? 1 : 0;
  for (int i = out; i < argc; ++i) {
    std::string_view a = argv[i];
    auto take = [&](std::string_view flag, std::optional<std::string>& into) {
      if (a == flag) {
        if (i + 1 >= argc)
          throw mesh_error("whale: " + std::string(flag) + " needs a value (e.g. " +
                           (flag == "--mesh" ? "--mesh data=2,model=2" : "--threads 4") + ")");
        into = argv[++i];
        return true;
      }
      if (a.size() > flag.size() && a.substr(0, flag.size()) == flag && a[flag.size()] == '=') {
        into = std::string(a.substr(flag.size() + 1));
        return true;
      }
      return false;
    };
    if (take("--mesh", f.mesh) || take("--threads", f.threads)) continue;
    argv[out++] = argv[i];
  }
  argc = out;
  if (argv) argv[argc] = nullptr;
  return f;
}

}  // namespace detail

/// The running job as one rank sees it.
///
///     auto ctx = whale::context::init(argc, argv);
///     whale::run_guarded(ctx, [&] { ... });
///
/// init: MPI_Init (unless MPI is already initialized; then the caller keeps
/// ownership and finalizes), removes `--mesh SPEC` and `--threads N` from argv
/// (else WHALE_MESH / WHALE_THREADS; threads default 1, see cpu::set_threads),
/// builds the mesh (default: every rank on `data`) and installs a terminate
/// handler that reports "whale: rank R: <message>" and aborts the job.
/// A bad mesh or flag: every rank prints "whale: rank R: <why>" and the job
/// exits with status 2 before any work (when whale owns MPI; else init throws
/// mesh_error). Non-copyable, movable; the destructor finalizes MPI.
class context {
  struct state {
    bool owns_mpi = false;
    int threads = 1;
    world_comm world;
    whale::mesh mesh;
    state(bool owns, int t, world_comm w, mesh_shape s)
        : owns_mpi(owns), threads(t), world(std::move(w)), mesh(world, s) {}
  };

 public:
  static context init(int& argc, char**& argv) { return init_impl(&argc, &argv); }
  /// Without a command line: WHALE_MESH and WHALE_THREADS only.
  static context init() { return init_impl(nullptr, nullptr); }

  context(context&&) noexcept = default;
  context& operator=(context&& o) noexcept {
    if (this != &o) {
      shut_down();
      s_ = std::move(o.s_);
    }
    return *this;
  }
  context(const context&) = delete;
  context& operator=(const context&) = delete;
  ~context() { shut_down(); }

  /// Another context over the same ranks, in the same order, on the mesh `spec` (e.g.
  /// "model=4"), to run a second plan beside the first (e.g. load a checkpoint under
  /// another plan). It does not own MPI. Collective; a bad spec throws mesh_error on every rank.
  context with_mesh(const std::string& spec) const {
    world_comm world = new_world();
    std::string error;
    mesh_shape shape;
    try {
      shape = mesh_shape::parse(spec, world.size(), "with_mesh");
    } catch (const detail::parse_error& e) {
      error = e.what();
    } catch (const mesh_error& e) {
      error = e.what();
    }
    if (any_rank_failed(world, error, "the mesh '" + spec + "'")) throw mesh_error(error);
#ifdef WHALE_HAS_MPI
    world = world.split(0, rank(), "world");  // this context's rank order (with_rank_order) is kept
#endif
    return context(std::make_unique<state>(false, s_->threads, std::move(world), shape));
  }

  /// Another context over the same ranks and mesh shape in which rank i is this
  /// context's rank order[i] (e.g. whale::worker_order: which devices form each
  /// virtual worker). It does not own MPI. Collective; `order` must be the same
  /// permutation of 0..size-1 on every rank (std::invalid_argument otherwise, on every rank).
  context with_rank_order(const std::vector<int>& order) const {
    std::string error;
    std::vector<int> seen(static_cast<std::size_t>(size()), 0);
    [[maybe_unused]] int mine = -1;  // (used under MPI)
    if (static_cast<int>(order.size()) != size()) {
      error = "whale::context::with_rank_order: " + std::to_string(order.size()) + " entries for " + std::to_string(size()) + " ranks";
    } else {
      for (int i = 0; i < size() && error.empty(); ++i) {
        const int r = order[static_cast<std::size_t>(i)];
        if (r < 0 || r >= size() || seen[static_cast<std::size_t>(r)]++)
          error = "whale::context::with_rank_order: the order is not a permutation of the ranks 0.." + std::to_string(size() - 1);
        if (r == rank()) mine = i;
      }
    }
    world_comm world = new_world();
    if (any_rank_failed(world, error, "the rank order")) throw std::invalid_argument(error);
#ifdef WHALE_HAS_MPI
    world = world.split(0, mine, "world");
#else
    (void)mine;
#endif
    return context(std::make_unique<state>(false, s_->threads, std::move(world), mesh().shape()));
  }

  int rank() const noexcept { return s_->world.rank(); }
  int size() const noexcept { return s_->world.size(); }
  int threads() const noexcept { return s_->threads; }
  world_comm& world() const noexcept { return s_->world; }
  whale::mesh& mesh() const noexcept { return s_->mesh; }

  /// Run f(); an exception from it reports "whale: rank R: <what()>" on stderr
  /// and aborts the whole job (MPI_Abort), so no other rank waits forever.
  template <class F> decltype(auto) guard(F&& f) const {
    try {
      return std::forward<F>(f)();
    } catch (const std::exception& e) {
      detail::fatal(e.what());
    } catch (...) {
      detail::fatal("unknown exception (not derived from std::exception)");
    }
  }

 private:
  explicit context(std::unique_ptr<state> s) : s_(std::move(s)) {}

  /// A world communicator of its own (an MPI_COMM_WORLD duplicate, or the single process).
  static world_comm new_world() {
#ifdef WHALE_HAS_MPI
    return mpi_comm::world();
#else
    return local_comm("world");
#endif
  }
  /// Whether any rank's `error` is set (collective); a rank without one gets a message saying so.
  static bool any_rank_failed([[maybe_unused]] world_comm& world, std::string& error, [[maybe_unused]] const std::string& what) {
    int bad = error.empty() ? 0 : 1;
#ifdef WHALE_HAS_MPI
    int any = 0;
    MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, world.native());
    if (any && !bad) error = "whale: another rank rejected " + what + "; see its message";
    bad = any;
#endif
    return bad != 0;
  }

  static context init_impl(int* argc, char*** argv) {
    bool owns = false;
#ifdef WHALE_HAS_MPI
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) {
      // FUNNELED: only the main thread calls MPI (the watchdog thread never does).
      int provided = 0;
      if (argc) MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
      else MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      owns = true;
    }
#endif
    detail::install_terminate_handler();
    world_comm world = new_world();
    // Validate everything before any work; every rank learns whether any failed.
    std::string error;
    mesh_shape shape;
    int threads = 1;
    try {
      detail::context_flags f;
      if (argc && argv) f = detail::take_flags(*argc, *argv);
      threads = f.threads ? static_cast<int>(detail::parse_int(*f.threads, "--threads", 1, 4096)) : env::threads().value_or(1);
      std::string origin = "--mesh";
      std::string spec;
      if (f.mesh) spec = *f.mesh;
      else if (const char* e = env::text("WHALE_MESH")) spec = e, origin = "WHALE_MESH";
      shape = mesh_shape::parse(spec, world.size(), origin);
      set_watchdog_timeout(env::watchdog_seconds());
      set_heartbeat_timeout(env::heartbeat_seconds());
      (void)cpu::active_isa();  // WHALE_CPU_ISA is checked here, at start-up, not at the first kernel
    } catch (const detail::parse_error& e) {
      error = e.what();
    } catch (const mesh_error& e) {
      error = e.what();
#ifndef WHALE_HAS_MPI
      if (error.find("but the job has 1 ") != std::string::npos)
        error += " (this program was built without MPI; link whale::mpi to run on several ranks)";
#endif
    } catch (const std::invalid_argument& e) {  // WHALE_CPU_ISA
      error = e.what();
    }
    if (any_rank_failed(world, error, "the mesh or flags")) {
      if (!owns) throw mesh_error(error);
      // "whale: rank R: whale: ..." reads badly; drop the inner prefix.
      std::string_view msg = error;
      if (msg.substr(0, 7) == "whale: ") msg.remove_prefix(7);
      detail::report(msg);
      std::fflush(stdout);
      { world_comm gone = std::move(world); }
#ifdef WHALE_HAS_MPI
      MPI_Finalize();
#endif
      std::exit(2);
    }
    cpu::set_threads(threads);
    return context(std::make_unique<state>(owns, threads, std::move(world), shape));
  }

  void shut_down() noexcept {
    if (!s_) return;
    if (std::uncaught_exceptions() > 0) {
#ifdef WHALE_HAS_MPI
      // Finalizing while peers may wait in a collective would hang them: leave MPI
      // as it is, let the exception reach its handler (which prints it), end the job soon.
      if (detail::mpi_active()) {
        detail::exit_soon(2.0, "the whale::context is destroyed while an exception propagates; the job ends in 2 s "
                               "(use ctx.guard or whale::run_guarded to end it at once, with the message)");
        (void)s_.release();  // never finalized: peers may still wait in a collective
        return;
      }
#endif
    }
    const bool owns = s_->owns_mpi;
    s_.reset();
#ifdef WHALE_HAS_MPI
    if (owns && detail::mpi_active()) MPI_Finalize();
#else
    (void)owns;
#endif
  }

  std::unique_ptr<state> s_;
};

/// Run f() under ctx's failure handling (see context::guard).
template <class F> decltype(auto) run_guarded(const context& ctx, F&& f) {
  return ctx.guard(std::forward<F>(f));
}

}  // namespace whale
