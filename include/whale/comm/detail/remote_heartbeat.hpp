// Heartbeats between nodes. The node-shared heartbeat (watchdog.hpp) cannot
// see a rank on another node, so every rank also opens a UDP socket when the
// world communicator is first made, and the ranks learn each other's address,
// host name, pid and node in one all-gather. Twice a second the heartbeat
// thread sends one datagram to every rank on another node and drains its own
// socket, noting when each was last heard. A rank that is frozen or killed,
// or whose node's link is down, falls silent; a rank that waits on it in a
// communication call sees how long (mpi_comm::request::peer_problem). A
// datagram needs nothing of its receiver, so a frozen peer cannot block the
// channel, as it could a TCP connection or an MPI call.
//
// A killed rank's node is still up: its kernel answers the next beat with
// "port unreachable", which this socket asks to see (IP_RECVERR). Such a
// refusal, sent by the address a peer's beats came from for its port, after
// its last beat, and 1.2 s of silence since, say that its process is gone;
// the waiting rank then ends the job naming it, its host and the other ranks
// of that node. mpirun notices its daemon's death too and may end the job
// first (naming the node at most): the line whale prints on SIGTERM then names
// the ranks refused and silent for 0.5 s, as learnt at least 0.1 s before the
// signal (set_peer_note), not those that end on the same signal.
//
// A peer is watched once it has been heard from: where UDP between the nodes
// is blocked, nothing is ever heard and nothing is reported (the watchdog's
// timeout still ends a job that waits for ever). The beats go to every rank
// of another node (two datagrams a second each way per pair; meant for jobs
// of up to a few hundred ranks), to each of its addresses.
//
// The socket calls go through syscall(2) with the kernel's own structure
// layouts (Linux on x86-64 or aarch64; elsewhere there is no remote
// heartbeat): the C library's socket headers declare ::send and ::recv, which
// would make a user's unqualified whale::send and whale::recv ambiguous under
// `using namespace whale`.
#pragma once

#include <mpi.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/syscall.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "whale/comm/detail/watchdog.hpp"
#include "whale/comm/failure.hpp"

#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
#define WHALE_REMOTE_HEARTBEAT 1
#else
#define WHALE_REMOTE_HEARTBEAT 0
#endif

namespace whale::detail {

/// The kernel's socket ABI as remote_heartbeat uses it (Linux, 64-bit).
namespace net {
inline constexpr std::uint16_t af_inet = 2;
inline constexpr int sock_dgram = 2, sock_nonblock = 04000, sock_cloexec = 02000000, msg_dontwait = 0x40;
inline constexpr int sol_socket = 1, so_rcvbuf = 8;
inline constexpr int sol_ip = 0, ip_recverr = 11, msg_errqueue = 0x2000, econnrefused = 111;
inline constexpr std::uint8_t ee_origin_icmp = 2;
inline constexpr unsigned long siocgifconf = 0x8912, siocgifflags = 0x8913;
inline constexpr std::int16_t iff_up = 0x1, iff_loopback = 0x8;
/// struct sockaddr_in: family, port and address in network order, padding.
struct in4 {
  std::uint16_t family;
  std::uint16_t port;
  std::uint32_t addr;
  unsigned char zero[8];
};
/// struct ifreq: the interface's name, then a union (its address, or its flags).
struct ifreq {
  char name[16];
  unsigned char data[24];
};
/// struct ifconf: the buffer's length, then the buffer.
struct ifconf {
  int len;
  ifreq* req;
};
/// struct iovec, struct msghdr, struct cmsghdr and struct sock_extended_err.
struct iovec {
  void* base;
  std::size_t len;
};
struct msghdr {
  void* name;
  std::uint32_t namelen;
  iovec* iov;
  std::size_t iovlen;
  void* control;
  std::size_t controllen;
  int flags;
};
struct cmsghdr {
  std::size_t len;
  int level, type;
};
struct extended_err {
  std::uint32_t err;
  std::uint8_t origin, type, code, pad;
  std::uint32_t info, data;
};
static_assert(!WHALE_REMOTE_HEARTBEAT || (sizeof(in4) == 16 && sizeof(ifreq) == 40 && sizeof(ifconf) == 16 && sizeof(void*) == 8 &&
                                          sizeof(msghdr) == 56 && sizeof(cmsghdr) == 16 && sizeof(extended_err) == 16),
              "whale's remote heartbeat assumes Linux's 64-bit socket structures");
}  // namespace net

class remote_heartbeat {
 public:
  /// Never destroyed: the heartbeat thread may still beat while the process exits.
  static remote_heartbeat& instance() {
    static remote_heartbeat* r = new remote_heartbeat;
    return *r;
  }

  /// Collective over MPI_COMM_WORLD; the first call opens the socket and
  /// exchanges the addresses, later ones do nothing. A rank without a socket or
  /// an IPv4 address of its own is not watched (its peers skip it).
  void start() {
    if (started_ || !WHALE_REMOTE_HEARTBEAT) return;
    started_ = true;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    entry mine{};
    mine.pid = static_cast<std::int64_t>(::getpid());
    ::gethostname(mine.host, sizeof mine.host - 1);
    // the node: the world rank of its first rank
    MPI_Comm node = MPI_COMM_NULL;
    int leader = rank_;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
      MPI_Bcast(&leader, 1, MPI_INT, 0, node);
      MPI_Comm_free(&node);
    }
    mine.node = leader;
#if WHALE_REMOTE_HEARTBEAT
    fd_ = static_cast<int>(::syscall(SYS_socket, net::af_inet, net::sock_dgram | net::sock_nonblock | net::sock_cloexec, 0));
    if (fd_ >= 0) {
      const int room = 4 << 20;  // a tick's beats from every remote rank, with room to spare
      (void)::syscall(SYS_setsockopt, fd_, net::sol_socket, net::so_rcvbuf, &room, sizeof room);
      const int on = 1;  // "port unreachable" for a beat: a peer's process is gone
      (void)::syscall(SYS_setsockopt, fd_, net::sol_ip, net::ip_recverr, &on, sizeof on);
      net::in4 a{net::af_inet, 0, 0, {}};  // any address, a port the kernel picks
      std::uint32_t len = sizeof a;
      if (::syscall(SYS_bind, fd_, &a, sizeof a) == 0 && ::syscall(SYS_getsockname, fd_, &a, &len) == 0) {
        mine.port = a.port;
        own_ = own_addresses(fd_, max_addresses);
        for (std::uint32_t x : own_) mine.addr[mine.count++] = x;
      }
    }
#endif
    // one token a job: a datagram of another job (a port used again) is not a beat
    std::uint64_t token = (static_cast<std::uint64_t>(::getpid()) << 32) ^ static_cast<std::uint64_t>(monotonic_ms());
    MPI_Bcast(&token, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
    token_ = token;
    peers_.resize(static_cast<std::size_t>(size_));
    MPI_Allgather(&mine, sizeof(entry), MPI_BYTE, peers_.data(), sizeof(entry), MPI_BYTE, MPI_COMM_WORLD);
    heard_ = std::make_unique<std::atomic<std::int64_t>[]>(static_cast<std::size_t>(size_));
    refused_ = std::make_unique<std::atomic<std::int64_t>[]>(static_cast<std::size_t>(size_));
    heard_from_ = std::make_unique<std::atomic<std::uint32_t>[]>(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      heard_[static_cast<std::size_t>(r)].store(0, std::memory_order_relaxed);  // never heard: not watched yet
      refused_[static_cast<std::size_t>(r)].store(0, std::memory_order_relaxed);
      heard_from_[static_cast<std::size_t>(r)].store(0, std::memory_order_relaxed);
      const auto& p = peers_[static_cast<std::size_t>(r)];
      if (r != rank_ && p.node != mine.node && p.count > 0 && p.port != 0 && mine.count > 0) remote_.push_back(r);
    }
    watched_.assign(static_cast<std::size_t>(size_), 0);
    for (int r : remote_) watched_[static_cast<std::size_t>(r)] = 1;
    if (!remote_.empty()) heartbeat::instance().set_tick(&tick_hook);
  }

  /// Milliseconds since world rank `r` was last heard; -1 if it is not watched
  /// (this rank's node, no address on either side, or never heard from).
  std::int64_t silence_ms(int r) const {
    if (!watched(r)) return -1;
    const auto heard = heard_[static_cast<std::size_t>(r)].load(std::memory_order_relaxed);
    return heard > 0 ? monotonic_ms() - heard : -1;
  }
  /// Whether world rank `r`'s node refused a beat to its port after it was last
  /// heard (its socket lives as long as its process).
  bool refused(int r) const {
    if (!watched(r)) return false;
    const auto at = refused_[static_cast<std::size_t>(r)].load(std::memory_order_acquire);
    const auto heard = heard_[static_cast<std::size_t>(r)].load(std::memory_order_relaxed);
    return heard > 0 && at > heard;
  }
  /// Whether world rank `r`'s process is gone: refused, and silent for `ms`
  /// (default 1.2 s, over two beats and a late one: a live peer that a firewall
  /// refuses still beats; a peer that ends with this rank, on the same Ctrl-C,
  /// is not silent that long before this rank ends).
  bool gone(int r, std::int64_t ms = 1200) const { return refused(r) && silence_ms(r) > ms; }
  /// Of world ranks `among`, those gone (gone(w, ms)), with the other ranks of
  /// their nodes among `among`: "rank 1 (pid 5 on h1) has died (its node refused
  /// its heartbeat: the process is gone, seen from h0); the other ranks of its
  /// node: rank 3 (pid 6 on h1)". Empty if none is gone.
  std::string gone_report(const std::vector<int>& among, std::int64_t ms = 1200) const {
    auto dead = [&](int w) { return gone(w, ms); };
    std::string named_dead, beside;
    int dead_count = 0, beside_count = 0;
    std::vector<int> nodes;  // of the dead ones
    auto named = [&](int w) { return "rank " + std::to_string(w) + " (pid " + std::to_string(pid(w)) + " on " + host(w) + ")"; };
    for (int w : among)
      if (dead(w)) {
        named_dead += std::string(dead_count++ ? ", " : "") + named(w);
        nodes.push_back(peers_[static_cast<std::size_t>(w)].node);
      }
    if (dead_count == 0) return {};
    for (int w : among)
      if (!dead(w) && std::find(nodes.begin(), nodes.end(), peers_[static_cast<std::size_t>(w)].node) != nodes.end())
        beside += std::string(beside_count++ ? ", " : "") + named(w);
    char me[256] = "this node";
    ::gethostname(me, sizeof me - 1);
    const bool many = dead_count > 1;
    return named_dead + (many ? " have died (their nodes refused their heartbeats: the processes are gone"
                              : " has died (its node refused its heartbeat: the process is gone") +
           ", seen from " + me + ")" +
           (beside_count ? std::string("; the other ranks of ") + (many ? "their nodes" : "its node") + ": " + beside : std::string());
  }
  bool watched(int r) const { return r >= 0 && r < static_cast<int>(watched_.size()) && watched_[static_cast<std::size_t>(r)]; }
  /// World rank `r`'s host name and pid, as it said when the job started.
  std::string host(int r) const { return peers_.empty() ? std::string() : std::string(peers_[static_cast<std::size_t>(r)].host); }
  std::int64_t pid(int r) const { return peers_.empty() ? 0 : peers_[static_cast<std::size_t>(r)].pid; }

 private:
  static constexpr int max_addresses = 16;
  struct entry {
    std::uint32_t addr[max_addresses] = {};  // network order
    std::int32_t count = 0;                  // addresses; 0: not reachable
    std::uint16_t port = 0;                  // network order
    std::int32_t node = 0;                   // world rank of the node's first rank
    std::int64_t pid = 0;
    char host[64] = {};
  };
  struct beat {
    std::uint64_t token = 0;
    std::int32_t rank = 0, unused = 0;  // no padding: every byte sent is set
  };
  remote_heartbeat() = default;

  // This host's IPv4 addresses (network order) on interfaces that are up and not
  // loopback, at most `most` (SIOCGIFCONF, then SIOCGIFFLAGS per interface).
  static std::vector<std::uint32_t> own_addresses([[maybe_unused]] int fd, [[maybe_unused]] std::size_t most) {
    std::vector<std::uint32_t> out;
#if WHALE_REMOTE_HEARTBEAT
    net::ifreq reqs[128] = {};
    net::ifconf conf{};
    conf.len = static_cast<int>(sizeof reqs);
    conf.req = reqs;
    if (::syscall(SYS_ioctl, fd, net::siocgifconf, &conf) != 0) return out;
    const auto n = static_cast<std::size_t>(conf.len) / sizeof(net::ifreq);
    for (std::size_t i = 0; i < n && out.size() < most; ++i) {
      net::in4 a{};
      std::memcpy(&a, reqs[i].data, sizeof a);
      if (a.family != net::af_inet || a.addr == 0) continue;
      net::ifreq q = reqs[i];
      if (::syscall(SYS_ioctl, fd, net::siocgifflags, &q) != 0) continue;
      std::int16_t flags = 0;
      std::memcpy(&flags, q.data, sizeof flags);
      if ((flags & net::iff_up) && !(flags & net::iff_loopback)) out.push_back(a.addr);
    }
#endif
    return out;
  }
  static void tick_hook() { instance().tick(); }
  // From the heartbeat thread, twice a second: what arrived, then one beat to every remote rank.
  // A peer's every address gets the beat: those the network cannot carry are
  // dropped, and a beat that reaches another socket is not of this job or rank.
  void tick() {
#if WHALE_REMOTE_HEARTBEAT
    const auto now = monotonic_ms();
    for (int errors = 0; errors < 64;) {  // until nothing is left (64 errors at most); a datagram of another size or job is skipped
      beat b{};
      net::in4 from{};
      std::uint32_t len = sizeof from;
      const long got = ::syscall(SYS_recvfrom, fd_, &b, sizeof b, net::msg_dontwait, &from, &len);
      if (got < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        ++errors;  // a refusal also leaves an error pending (IP_RECVERR), which one call returns and clears; or EINTR
        continue;
      }
      if (got == static_cast<long>(sizeof b) && b.token == token_ && b.rank >= 0 && b.rank < size_) {
        heard_[static_cast<std::size_t>(b.rank)].store(now, std::memory_order_relaxed);
        heard_from_[static_cast<std::size_t>(b.rank)].store(from.addr, std::memory_order_relaxed);
      }
    }
    refusals(now);
    if (!(heartbeat_timeout() > 0)) return;  // WHALE_HEARTBEAT_S=0: no beats sent
    send_beats();
    // a dead peer's node answers within a moment: seen now, its death is named
    // before mpirun, which notices it in a second or two, ends this rank
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    refusals(monotonic_ms());
    note(monotonic_ms());
#endif
  }
  // For the line of a signal's handler, should mpirun end this rank first: the
  // peers refused and silent for a beat (0.5 s), as of when that was first so;
  // nothing once they are heard again.
  void note([[maybe_unused]] std::int64_t now) noexcept {
    try {
      auto m = gone_report(remote_, 500);
      if (!m.empty()) m = "heartbeat: " + m;
      if (m != note_) {
        note_ = m;
        set_peer_note(m, now);
      }
    } catch (...) {  // no memory for the note: the heartbeat's check still names them
    }
  }
  void send_beats() noexcept {  // one to every remote rank, each of its addresses
#if WHALE_REMOTE_HEARTBEAT
    beat me{};
    me.token = token_;
    me.rank = rank_;
    for (int r : remote_) {
      const auto& p = peers_[static_cast<std::size_t>(r)];
      // once heard, only the address its beats come from (the kernel limits the refusals
      // a host sends: those of addresses that lead elsewhere would use them up), if
      // that is one it announced (behind address translation it is not: then all)
      const auto from = heard_from_[static_cast<std::size_t>(r)].load(std::memory_order_relaxed);
      const bool known = from != 0 && std::find(p.addr, p.addr + p.count, from) != p.addr + p.count;
      auto send = [&](std::uint32_t addr) {
        if (std::find(own_.begin(), own_.end(), addr) != own_.end()) return;  // a private address every host has
        const net::in4 to{net::af_inet, p.port, addr, {}};
        // a pending error (an earlier refusal) fails one call and is cleared: send again
        for (int attempt = 0; attempt < 2; ++attempt)
          if (::syscall(SYS_sendto, fd_, &me, sizeof me, net::msg_dontwait, &to, sizeof to) >= 0 || errno == EAGAIN) break;
      };
      for (int k = 0; k < p.count; ++k)
        if (!known || p.addr[k] == from) send(p.addr[k]);
      if (from != 0 && !known) send(from);  // heard from an address it did not announce: that one too
    }
#endif
  }
  // The refusals that arrived (a beat met a closed port): each marks the peer
  // whose beats come from that address and port as gone.
  void refusals([[maybe_unused]] std::int64_t now) noexcept {
#if WHALE_REMOTE_HEARTBEAT
    for (;;) {  // the refusals: a beat that met a closed port
      net::in4 to{};
      char data[sizeof(beat)];
      alignas(8) unsigned char control[256];
      net::iovec io{data, sizeof data};
      net::msghdr m{&to, sizeof to, &io, 1, control, sizeof control, 0};
      if (::syscall(SYS_recvmsg, fd_, &m, net::msg_errqueue | net::msg_dontwait) < 0) break;
      for (std::size_t at = 0; at + sizeof(net::cmsghdr) <= m.controllen;) {
        net::cmsghdr h{};
        std::memcpy(&h, control + at, sizeof h);
        if (h.len < sizeof h || at + h.len > m.controllen) break;
        if (h.level == net::sol_ip && h.type == net::ip_recverr && h.len >= sizeof h + sizeof(net::extended_err) + sizeof(net::in4)) {
          net::extended_err e{};
          net::in4 by{};  // the address that sent the ICMP message
          std::memcpy(&e, control + at + sizeof h, sizeof e);
          std::memcpy(&by, control + at + sizeof h + sizeof e, sizeof by);
          // "port unreachable" (ICMP type 3, code 3) from the peer's own address: nothing listens there
          if (e.err == static_cast<std::uint32_t>(net::econnrefused) && e.origin == net::ee_origin_icmp && e.type == 3 && e.code == 3 &&
              by.addr == to.addr)
            for (int r : remote_)  // the peer whose beats come from that address and port
              if (heard_from_[static_cast<std::size_t>(r)].load(std::memory_order_relaxed) == to.addr &&
                  peers_[static_cast<std::size_t>(r)].port == to.port && !refused(r))
                refused_[static_cast<std::size_t>(r)].store(now, std::memory_order_release);  // the first since it was heard
        }
        at += (h.len + 7) & ~static_cast<std::size_t>(7);
      }
    }
#endif
  }

  bool started_ = false;
  int rank_ = 0, size_ = 1, fd_ = -1;
  std::uint64_t token_ = 0;
  std::vector<entry> peers_;
  std::vector<int> remote_;    // world ranks on other nodes, watched
  std::vector<char> watched_;  // by world rank: in remote_
  std::unique_ptr<std::atomic<std::int64_t>[]> heard_;
  std::unique_ptr<std::atomic<std::int64_t>[]> refused_;  // by world rank: when a beat to it met a closed port (0: never)
  std::unique_ptr<std::atomic<std::uint32_t>[]> heard_from_;  // by world rank: the address its beats came from
  std::vector<std::uint32_t> own_;                            // this host's addresses
  std::string note_;                                          // the last note written (heartbeat thread only)
};

}  // namespace whale::detail
