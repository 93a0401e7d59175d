// The memory check before training: what this node has free (the tightest of
// the cgroup limits above this process, v2 or v1, and MemAvailable; or
// WHALE_MEMORY_LIMIT_MIB), against what the ranks on the node are about to
// allocate (summed over the ranks that share the host). Every rank fails with
// the figures when they do not fit, instead of being OOM-killed with no word.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/communicator.hpp"
#include "whale/detail/environment.hpp"
#include "whale/detail/parse.hpp"

namespace whale::detail {

/// Free memory of this node as whale sees it, and where the figure comes from.
struct node_memory {
  std::int64_t available = std::numeric_limits<std::int64_t>::max();
  std::string source;  ///< "MemAvailable", "cgroup /a/b limit 4096 MiB, 1000 MiB in use", "WHALE_MEMORY_LIMIT_MIB"
};

/// "812 MiB", "3.4 MiB", "20.5 KiB", "96 B": enough digits to tell small figures apart.
inline std::string mib_text(std::int64_t bytes) {
  char b[48];
  const double v = static_cast<double>(bytes);
  if (bytes < 1024) std::snprintf(b, sizeof b, "%lld B", static_cast<long long>(bytes));
  else if (bytes < (std::int64_t{1} << 20)) std::snprintf(b, sizeof b, "%.1f KiB", v / 1024.0);
  else if (bytes < (std::int64_t{100} << 20)) std::snprintf(b, sizeof b, "%.1f MiB", v / 1048576.0);
  else std::snprintf(b, sizeof b, "%.0f MiB", v / 1048576.0);
  return b;
}

inline bool read_int64(const std::string& path, std::int64_t& v) {
  std::ifstream f(path);
  std::string s;
  if (!(f >> s) || s == "max") return false;
  char* end = nullptr;
  const long long x = std::strtoll(s.c_str(), &end, 10);
  if (end == s.c_str() || *end) return false;
  v = x;
  return true;
}
/// `key value` from a cgroup's memory.stat (0 if absent).
inline std::int64_t stat_field(const std::string& path, const std::string& key) {
  std::ifstream f(path);
  std::string k;
  long long v = 0;
  while (f >> k >> v)
    if (k == key) return v;
  return 0;
}

/// The tightest memory cgroup limit above this process: limit - (usage - reclaimable file cache).
inline void cgroup_memory(node_memory& m) {
  std::ifstream f("/proc/self/cgroup");
  std::string line;
  while (std::getline(f, line)) {
    // "0::/path" (v2) or "4:memory:/path" (v1)
    const auto a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string ctl = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1);
    const bool v2 = ctl.empty();
    if (!v2 && ctl.find("memory") == std::string::npos) continue;
    const std::string root = v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
    for (;;) {  // this cgroup and each parent: the limit may be set higher up
      const std::string dir = root + (path == "/" ? std::string() : path);
      std::int64_t limit = 0, used = 0;
      const bool has = v2 ? read_int64(dir + "/memory.max", limit) && read_int64(dir + "/memory.current", used)
                          : read_int64(dir + "/memory.limit_in_bytes", limit) && read_int64(dir + "/memory.usage_in_bytes", used);
      if (has && limit < (std::int64_t{1} << 60)) {
        const std::int64_t cache = stat_field(dir + "/memory.stat", v2 ? "inactive_file" : "total_inactive_file");
        const std::int64_t free = limit - std::max<std::int64_t>(0, used - cache);
        if (free < m.available) {
          m.available = std::max<std::int64_t>(0, free);
          m.source = "the cgroup " + path + " (limit " + mib_text(limit) + ", " + mib_text(used - cache) + " in use)";
        }
      }
      if (path.empty() || path == "/") break;
      const auto up = path.rfind('/');
      path = up == 0 || up == std::string::npos ? "/" : path.substr(0, up);
    }
  }
}

/// What this node has free now: WHALE_MEMORY_LIMIT_MIB if set, else the
/// smaller of MemAvailable and the cgroup limits' headroom.
inline node_memory free_node_memory() {
  node_memory m;
  if (const auto v = env::real("WHALE_MEMORY_LIMIT_MIB", 0, 1 << 30, true)) {
    m.available = static_cast<std::int64_t>(*v * 1048576.0);
    m.source = "WHALE_MEMORY_LIMIT_MIB";
    return m;
  }
  std::ifstream f("/proc/meminfo");
  std::string k;
  long long kb = 0;
  std::string unit;
  while (f >> k >> kb) {
    std::getline(f, unit);
    if (k == "MemAvailable:") {
      m.available = static_cast<std::int64_t>(kb) * 1024;
      m.source = "MemAvailable of /proc/meminfo";
      break;
    }
  }
  cgroup_memory(m);
  return m;
}

/// Whether the memory check runs (WHALE_MEMORY_CHECK, default on).
inline bool memory_check_enabled() {
  return env::boolean("WHALE_MEMORY_CHECK").value_or(true);
}

/// Collective over `w`: every rank says how many bytes it is about to allocate
/// (`need`, described by `what`); the ranks that share a host sum theirs, and
/// every rank throws std::runtime_error when any node lacks the memory, naming
/// the node's first rank, the figures, and (on the ranks that know them) what
/// the neediest rank allocates and where the free figure comes from. `who`
/// prefixes the message; `advice` ends it. On a device backend (`be` not the
/// CPU) each rank's device is its own: `need` against what it has free.
template <Communicator C>
void check_memory_fits(C& w, std::int64_t need, const std::string& what, const std::string& who, const std::string& advice,
                       const backend_ref& be = {}) {
  if (!memory_check_enabled()) return;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::uint64_t h = 1469598103934665603ULL;  // FNV-1a of the host name
  for (const char* c = host; *c; ++c) h = (h ^ static_cast<unsigned char>(*c)) * 1099511628211ULL;
  const bool device = !be.on_cpu();
  node_memory free;
  if (device) {  // a group of its own: the rank's number mixed in
    h = (h ^ static_cast<std::uint64_t>(w.rank() + 1)) * 1099511628211ULL;
    free.source = std::string("its ") + be.name() + " device";
    try {
      const std::int64_t f = be.memory_free();
      if (f >= 0) free.available = f;
    } catch (const std::exception& e) {  // taken as nothing free: every rank then fails alike, naming why here
      free.available = 0;
      free.source += " (its free memory could not be read: " + std::string(e.what()) + ")";
    }
  } else {
    free = free_node_memory();
  }
  const int n = w.size();
  std::int64_t mine[3] = {static_cast<std::int64_t>(h), need, free.available};
  std::vector<std::int64_t> all(static_cast<std::size_t>(3 * n));
  if (n > 1) all_gather(w, view<std::int64_t>(mine, {3}), view<std::int64_t>(all.data(), {3 * static_cast<index_t>(n)}));
  else all.assign(mine, mine + 3);
  // the first node (in rank order) that does not fit decides the message, the same on every rank
  for (int r = 0; r < n; ++r) {
    const auto host_r = all[static_cast<std::size_t>(3 * r)];
    bool first = true;
    for (int q = 0; q < r; ++q) first = first && all[static_cast<std::size_t>(3 * q)] != host_r;
    if (!first) continue;
    std::int64_t sum = 0, biggest = 0;
    int ranks = 0, worst = r;
    for (int q = 0; q < n; ++q)
      if (all[static_cast<std::size_t>(3 * q)] == host_r) {
        const auto b = all[static_cast<std::size_t>(3 * q + 1)];
        sum += b, ++ranks;
        if (b > biggest) biggest = b, worst = q;
      }
    const auto avail = all[static_cast<std::size_t>(3 * r + 2)];
    if (sum <= avail) continue;
    std::string m = who + "not enough memory: ";
    if (device)
      m += "the " + std::string(be.name()) + " device of rank " + std::to_string(r) + " needs " + mib_text(sum) + " more";
    else
      m += "the " + std::to_string(ranks) + " rank(s) on the node of rank " + std::to_string(r) + " need " +
           mib_text(sum) + " more (rank " + std::to_string(worst) + ": " + mib_text(biggest) + ")";
    if (w.rank() == worst || (host_r == static_cast<std::int64_t>(h) && ranks == 1)) m += " for " + what;
    m += ", but " + mib_text(avail) + " are free";
    if (host_r == static_cast<std::int64_t>(h)) m += " by " + free.source;
    m += "; " + advice + ". WHALE_MEMORY_CHECK=0 skips this check";
    throw std::runtime_error(m);
  }
}

}  // namespace whale::detail
