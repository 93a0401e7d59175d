// Wave Synchronous Parallel (HetPipe): parameter holders sharded over the
// world in MPI windows, pushed to and pulled from with passive-target one-sided
// calls, and one clock per rank. Compiled once (no model types); the loop that
// uses it is train/wsp_trainer.hpp.
#pragma once

#ifndef WHALE_HAS_MPI
#error "whale/runtime/wsp.hpp needs MPI: link whale::mpi (Wave Synchronous Parallel keeps its parameters in MPI windows)"
#endif

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/comm/mpi_comm.hpp"
#include "whale/plan/partition.hpp"

namespace whale::detail {

/// The global weights of a WSP job and the clocks of its ranks.
///
/// - Holders: world rank r holds block r of the flat model [0, n) (near-even
///   blocks) in an MPI window; a push adds a delta to every block it overlaps
///   (MPI_Accumulate, MPI_SUM: element-wise atomic), a pull
///   reads them (MPI_Get_accumulate with MPI_NO_OP, atomic against pushes).
/// - Clocks: rank 0's window holds one int64 per world rank (waves pushed) and a
///   stop word; a rank advances its own clock after its push completed at the
///   holders (the flush), so a clock of c means "every update of waves <= c is in";
///   a second count per rank says how many waves' weights it has pulled, and
///   a third word per rank holds a number it published (e.g. its recent loss).
/// Nothing here waits for a peer's participation: a rank makes progress alone
/// (on one node Open MPI serves these windows from shared memory). Each rank
/// opens one passive-target epoch on both windows for the holders' whole life
/// (MPI_Win_lock_all, no exclusive lock is ever taken) and completes each
/// operation with a flush, so no call pays a lock and an unlock (on a network,
/// a message each).
class wsp_holders {
 public:
  /// Collective over `world`; the weights start at zero (fill them with push()).
  wsp_holders(mpi_comm& world, index_t n) : comm_(world.native()), n_(n) {
    rank_ = world.rank();
    size_ = world.size();
    counts_ = block_counts(n, size_);
    starts_.assign(counts_.size(), 0);
    for (std::size_t r = 1; r < counts_.size(); ++r) starts_[r] = starts_[r - 1] + counts_[r - 1];
    const auto me = static_cast<std::size_t>(rank_);
    float* base = nullptr;
    check(MPI_Win_allocate(static_cast<MPI_Aint>(std::max<index_t>(1, counts_[me]) * sizeof(float)), sizeof(float),
                           MPI_INFO_NULL, comm_, &base, &params_win_),
          "MPI_Win_allocate (parameters)", window_hint);
    std::fill_n(base, counts_[me], 0.f);
    std::int64_t* clocks = nullptr;
    const index_t words = rank_ == 0 ? 3 * size_ + 2 : 0;  // clocks, pulls, stop, finished, published values
    check(MPI_Win_allocate(static_cast<MPI_Aint>(std::max<index_t>(1, words) * sizeof(std::int64_t)),
                           sizeof(std::int64_t), MPI_INFO_NULL, comm_, &clocks, &clock_win_),
          "MPI_Win_allocate (clocks)", window_hint);
    std::fill_n(clocks, words, std::int64_t{0});
    clocks_.assign(3 * static_cast<std::size_t>(size_) + 2, 0);
    MPI_Barrier(comm_);  // every holder initialised before anyone pushes
    check(MPI_Win_lock_all(MPI_MODE_NOCHECK, params_win_), "MPI_Win_lock_all (parameters)");
    check(MPI_Win_lock_all(MPI_MODE_NOCHECK, clock_win_), "MPI_Win_lock_all (clocks)");
  }
  wsp_holders(const wsp_holders&) = delete;
  wsp_holders& operator=(const wsp_holders&) = delete;
  /// Collective (MPI_Win_free).
  ~wsp_holders() {
    if (params_win_ != MPI_WIN_NULL) MPI_Win_unlock_all(params_win_), MPI_Win_free(&params_win_);
    if (clock_win_ != MPI_WIN_NULL) MPI_Win_unlock_all(clock_win_), MPI_Win_free(&clock_win_);
  }

  /// Adds `delta` to the global weights [offset, offset + delta.numel()).
  /// Complete at every holder when it returns.
  void push(cview<float> delta, index_t offset) {
    each_block(offset, delta.numel(), [&](int h, index_t at, index_t len, index_t src) {
      check(MPI_Accumulate(delta.data() + src, static_cast<int>(len), MPI_FLOAT, h, static_cast<MPI_Aint>(at),
                           static_cast<int>(len), MPI_FLOAT, MPI_SUM, params_win_),
            "MPI_Accumulate");
    });
    each_block(offset, delta.numel(), [&](int h, index_t, index_t, index_t) { check(MPI_Win_flush(h, params_win_), "MPI_Win_flush"); });
  }
  /// Reads the global weights [offset, offset + out.numel()) into `out`.
  void pull(view<float> out, index_t offset) {
    each_block(offset, out.numel(), [&](int h, index_t at, index_t len, index_t dst) {
      check(MPI_Get_accumulate(nullptr, 0, MPI_FLOAT, out.data() + dst, static_cast<int>(len), MPI_FLOAT, h,
                               static_cast<MPI_Aint>(at), static_cast<int>(len), MPI_FLOAT, MPI_NO_OP, params_win_),
            "MPI_Get_accumulate");
    });
    each_block(offset, out.numel(), [&](int h, index_t, index_t, index_t) { check(MPI_Win_flush(h, params_win_), "MPI_Win_flush"); });
  }
  /// This rank has pushed one more wave.
  void advance() { add_word(rank_, 1); }
  /// This rank has pulled the weights after one more wave.
  void pulled() { add_word(size_ + rank_, 1); }
  /// Publish one number of this rank's (e.g. its recent loss) for every rank to read.
  void publish(double v) {
    std::int64_t bits = 0;
    std::memcpy(&bits, &v, sizeof bits);
    check(MPI_Accumulate(&bits, 1, MPI_INT64_T, 0, 2 * size_ + 2 + rank_, 1, MPI_INT64_T, MPI_REPLACE, clock_win_),
          "MPI_Accumulate");
    check(MPI_Win_flush(0, clock_win_), "MPI_Win_flush");
  }
  /// What rank r published last, as last read (0 if nothing yet).
  double published(int r) const {
    double v = 0;
    std::memcpy(&v, &clocks_[2 * static_cast<std::size_t>(size_) + 2 + static_cast<std::size_t>(r)], sizeof v);
    return v;
  }
  /// Ask every rank to stop at its next wave boundary.
  void request_stop() { add_word(2 * size_, 1); }
  /// Reads every clock; returns the smallest. stop_requested() tells the stop word.
  std::int64_t read_clocks() {
    const int words = 3 * size_ + 2;
    check(MPI_Get_accumulate(nullptr, 0, MPI_INT64_T, clocks_.data(), words, MPI_INT64_T, 0, 0, words, MPI_INT64_T,
                             MPI_NO_OP, clock_win_),
          "MPI_Get_accumulate");
    check(MPI_Win_flush(0, clock_win_), "MPI_Win_flush");
    return *std::min_element(clocks_.begin(), clocks_.begin() + size_);
  }
  /// The smallest clock of any rank, as last read.
  std::int64_t least_clock() const { return *std::min_element(clocks_.begin(), clocks_.begin() + size_); }
  /// The smallest count of pulls of any rank, as last read.
  std::int64_t min_pulled() const { return *std::min_element(clocks_.begin() + size_, clocks_.begin() + 2 * size_); }
  bool stop_requested() const noexcept { return clocks_[2 * static_cast<std::size_t>(size_)] > 0; }
  /// Every rank's clock as last read.
  std::vector<std::int64_t> clocks() const { return {clocks_.begin(), clocks_.begin() + size_}; }
  /// This rank has pushed its last wave; returns once every rank has (polling,
  /// so a rank that finished early keeps no peer from progressing).
  void finish(int poll_us = 200) {
    add_word(2 * size_ + 1, 1);
    wait([&] { return clocks_[2 * static_cast<std::size_t>(size_) + 1] >= size_; }, poll_us, size_, "finish");
  }
  /// Polls the clocks until done() (which reads what read_clocks() left), under
  /// the watchdog (WHALE_WATCHDOG_S): a rank that died or hangs is named, not waited for forever.
  template <class Done> void wait(Done done, int poll_us, std::int64_t need, const char* what) {
    read_clocks();
    if (done()) return;
    need_ = need;
    what_ = what;
    watchdog::scope w({this, &describe_wait, nullptr}, watchdog_timeout());
    while (!done()) {
      std::this_thread::sleep_for(std::chrono::microseconds(poll_us));
      read_clocks();
    }
  }

 private:
  template <class F> void each_block(index_t offset, index_t count, F&& f) {
    if (offset < 0 || offset + count > n_) throw std::out_of_range("whale::wsp: a range outside the model");
    auto part = [&](int h) {  // [lo, hi) of the range that holder h keeps
      const auto hu = static_cast<std::size_t>(h);
      return std::pair<index_t, index_t>{std::max(offset, starts_[hu]), std::min(offset + count, starts_[hu] + counts_[hu])};
    };
    for (int h = 0; h < size_; ++h)  // every part checked before any operation is issued (none left unflushed)
      if (const auto [lo, hi] = part(h); hi - lo > INT_MAX)
        throw std::length_error("whale::wsp: a holder's block of " + std::to_string(hi - lo) +
                                " parameters exceeds MPI's count limit (INT_MAX); use more ranks");
    // each rank starts at its own holder: ranks that push or pull at once do not
    // queue on one holder after another (a holder serves one accumulate at a time)
    for (int i = 0; i < size_; ++i) {
      const int h = (rank_ + i) % size_;
      const auto [lo, hi] = part(h);
      if (hi > lo) f(h, lo - starts_[static_cast<std::size_t>(h)], hi - lo, lo - offset);
    }
  }
  void add_word(int word, std::int64_t v) {
    check(MPI_Accumulate(&v, 1, MPI_INT64_T, 0, word, 1, MPI_INT64_T, MPI_SUM, clock_win_), "MPI_Accumulate");
    check(MPI_Win_flush(0, clock_win_), "MPI_Win_flush");
  }
  static std::string describe_wait(const void* self, double seconds) {
    const auto& h = *static_cast<const wsp_holders*>(self);
    std::string behind;
    for (int r = 0; r < h.size_; ++r) {
      const auto c = h.clocks_[static_cast<std::size_t>(r)], p = h.clocks_[static_cast<std::size_t>(h.size_ + r)];
      behind += (r ? ", " : "") + std::to_string(r) + ": pushed " + std::to_string(c) + ", pulled " + std::to_string(p);
    }
    return "whale::wsp: rank " + std::to_string(h.rank_) + " waited " + std::to_string(static_cast<int>(seconds)) +
           " s at '" + h.what_ + "' for the ranks' waves to reach " + std::to_string(h.need_) + " (waves per rank " +
           behind + "); a rank has died, hangs, or is more than WHALE_WATCHDOG_S slower than the others";
  }
  // What a window that cannot be made across nodes needs (Open MPI 4's one-sided "rdma"
  // component takes InfiniBand or UCX transports, not TCP; its "pt2pt" one works over any).
  static constexpr const char* window_hint =
      "; WSP's windows span every rank: where the ranks' nodes talk over TCP only, Open MPI 4 needs a one-sided "
      "component that works there (mpirun --mca osc sm,pt2pt), as its default 'rdma' one needs InfiniBand or UCX";
  static void check(int rc, const char* call, const char* hint = "") {
    if (rc != MPI_SUCCESS)
      throw std::runtime_error(std::string("whale::wsp: ") + call + " failed: " + mpi_error_text(rc) + hint);
  }

  MPI_Comm comm_;
  index_t n_;
  int rank_ = 0, size_ = 1;
  std::vector<index_t> counts_, starts_;
  std::vector<std::int64_t> clocks_;
  MPI_Win params_win_ = MPI_WIN_NULL, clock_win_ = MPI_WIN_NULL;
  std::int64_t need_ = 0;       // what wait() waits for, for the watchdog's message
  const char* what_ = "";
};

/// The holders' layout where a rank's parameters are not one range of the
/// model's (tensor parallelism, interleaved chunks): the concatenation of what
/// each position of a worker (its pipe x model coordinates) holds, the same in
/// every worker. Returns this rank's offset in it and its total (collective
/// over the world); workers holding different counts at one position are an error.
inline std::pair<index_t, index_t> wsp_position_layout(const context& ctx, index_t mine) {
  const auto& shape = ctx.mesh().shape();
  const int positions = shape.size(axis::pipe | axis::model);
  const int position = shape.index_in(axis::pipe | axis::model, ctx.rank());
  std::vector<index_t> held(static_cast<std::size_t>(ctx.size()));
  all_gather(ctx.world(), cview<index_t>(&mine, {1}), view<index_t>(held.data(), {ctx.size()}));
  std::vector<index_t> per(static_cast<std::size_t>(positions), -1);
  for (int r = 0; r < ctx.size(); ++r) {
    auto& p = per[static_cast<std::size_t>(shape.index_in(axis::pipe | axis::model, r))];
    if (p >= 0 && p != held[static_cast<std::size_t>(r)])
      throw std::invalid_argument("whale::wsp_trainer: two virtual workers hold different parameter counts at one "
                                  "position; with tensor parallelism (a model axis) or interleaved chunks every "
                                  "worker must cut its pipeline alike (no plan_options::worker_cuts)");
    p = held[static_cast<std::size_t>(r)];
  }
  return {std::accumulate(per.begin(), per.begin() + position, index_t{0}), std::accumulate(per.begin(), per.end(), index_t{0})};
}

}  // namespace whale::detail
