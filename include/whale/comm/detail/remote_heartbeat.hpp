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

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
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
static_assert(!WHALE_REMOTE_HEARTBEAT || (sizeof(in4) == 16 && sizeof(ifreq) == 40 && sizeof(ifconf) == 16 && sizeof(void*) == 8),
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
      net::in4 a{net::af_inet, 0, 0, {}};  // any address, a port the kernel picks
      std::uint32_t len = sizeof a;
      if (::syscall(SYS_bind, fd_, &a, sizeof a) == 0 && ::syscall(SYS_getsockname, fd_, &a, &len) == 0) {
        mine.port = a.port;
        const auto own = own_addresses(fd_, max_addresses);
        for (std::uint32_t x : own) mine.addr[mine.count++] = x;
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
    for (int r = 0; r < size_; ++r) {
      heard_[static_cast<std::size_t>(r)].store(0, std::memory_order_relaxed);  // never heard: not watched yet
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
    for (;;) {  // until nothing is left; a datagram of another size or job is skipped
      beat b{};
      const long got = ::syscall(SYS_recvfrom, fd_, &b, sizeof b, net::msg_dontwait, nullptr, nullptr);
      if (got < 0) break;
      if (got == static_cast<long>(sizeof b) && b.token == token_ && b.rank >= 0 && b.rank < size_)
        heard_[static_cast<std::size_t>(b.rank)].store(now, std::memory_order_relaxed);
    }
    if (!(heartbeat_timeout() > 0)) return;  // WHALE_HEARTBEAT_S=0: no beats sent
    beat me{};
    me.token = token_;
    me.rank = rank_;
    for (int r : remote_) {
      const auto& p = peers_[static_cast<std::size_t>(r)];
      for (int k = 0; k < p.count; ++k) {
        const net::in4 to{net::af_inet, p.port, p.addr[k], {}};
        (void)::syscall(SYS_sendto, fd_, &me, sizeof me, net::msg_dontwait, &to, sizeof to);
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
};

}  // namespace whale::detail
