// The device profile auto_plan prices with when none is given: the one cached
// by an earlier start of the same job shape on this host and build, or one
// measured now on every rank (plan/measure.hpp's quick measurement) and
// cached for the next start. No planning here; the measuring is plan/'s.
#pragma once

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <unistd.h>

#include "whale/backend/backend_ref.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/detail/environment.hpp"
#include "whale/detail/io.hpp"
#include "whale/plan/measure.hpp"
#include "whale/runtime/agree.hpp"

namespace whale {

/// The profile a job priced its plans with when none was given, and where it came from.
struct start_profile {
  device_profile profile;
  std::string path;     ///< the cache file ("" where no cache directory is set)
  bool loaded = false;  ///< read from the cache; else measured now
  /// measured now, and every rank finds it at the next start (each node's file
  /// written, every rank with a cache directory)
  bool cached = false;
  double seconds = 0;   ///< the measurement's (the slowest rank's); 0 when loaded
  std::string note;     ///< the line rank 0 printed; another rank's says what it found and could write itself
};

namespace detail {

inline std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}

/// This host's name ("host" where the system gives none).
inline std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || !host[0]) return "host";
  return host;
}

/// Where measured profiles are cached: WHALE_PROFILE_CACHE, else $XDG_CACHE_HOME/whale
/// (an absolute XDG_CACHE_HOME; a relative one is ignored, as XDG says), else
/// $HOME/.cache/whale; "" when none is set, with the reason in `why`.
inline std::string profile_cache_dir(std::string& why) {
  if (auto d = env::string("WHALE_PROFILE_CACHE")) return *d;
  if (auto x = env::string("XDG_CACHE_HOME"); x && x->front() == '/') return *x + "/whale";
  if (auto h = env::string("HOME")) return *h + "/.cache/whale";
  why = "no cache directory (set WHALE_PROFILE_CACHE, XDG_CACHE_HOME or HOME)";
  return {};
}

/// What a cached profile must have been measured with: the host, the job's ranks
/// and this node's, OpenBLAS threads a rank, the compute backend and the world's
/// communicator, the build (whale's version, the compiler, NDEBUG, optimisation,
/// instruction sets: build_id) and the quick measurement's version.
inline std::string profile_cache_key(const std::string& host, int ranks, int per_node, int threads, const std::string& backend) {
#ifdef WHALE_HAS_MPI
  const char* comm = "mpi";
#else
  const char* comm = "local";
#endif
  return "host " + host + "; ranks " + std::to_string(ranks) + ", " + std::to_string(per_node) + " on this node; threads " +
         std::to_string(threads) + "; backend " + backend + ", " + comm + "; quick measurement 1; " + build_id();
}

/// The cache file of `key`: profile-<host>-<ranks>r-<16 hex digits of the key's hash>.txt
/// (the host's name with anything but letters, digits, '.', '-' and '_' as '_').
inline std::string profile_cache_file(const std::string& host, int ranks, const std::string& key) {
  std::string h;
  for (char c : host.substr(0, 64)) h += std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_' ? c : '_';
  char hash[17];
  std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(fnv1a(key)));
  return "profile-" + h + "-" + std::to_string(ranks) + "r-" + hash + ".txt";
}

/// A cache file read: absent, read (its text and profile), or not usable (`why`).
struct cache_read {
  enum class state : std::uint8_t { absent, ok, bad } s = state::absent;
  std::string text, why;
  device_profile profile;
};

/// Reads the cache file at `path`, which must hold `key` on its second line and a
/// profile the planner can price `ranks` ranks with (collectives' figures on 2 or more).
inline cache_read read_profile_cache(const std::string& path, const std::string& key, int ranks) {
  cache_read r;
  std::error_code ec;
  if (path.empty() || !std::filesystem::exists(path, ec)) return r;
  r.s = cache_read::state::bad;
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    r.why = "it cannot be opened: " + system_reason(errno);
    return r;
  }
  r.text.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  if (f.bad()) {
    r.why = "it cannot be read: " + system_reason(errno);
    return r;
  }
  if (r.text.empty()) {
    r.why = "it is empty";
    return r;
  }
  std::istringstream lines(r.text);
  std::string first, second;
  std::getline(lines, first);
  std::getline(lines, second);
  if (second != "# key: " + key) {
    r.why = "its key line is not this job's (\"# key: " + key + "\")";
    return r;
  }
  try {
    std::istringstream in(r.text);
    r.profile = device_profile::parse(in, path);
    if (ranks > 1 && r.profile.links[static_cast<int>(link_level::node)][static_cast<int>(link_kind::all_reduce)].ranks == 0)
      throw std::invalid_argument("no collective figures ('link' lines) for a job of " + std::to_string(ranks) + " ranks");
  } catch (const std::exception& e) {
    r.why = e.what();
    return r;
  }
  r.s = cache_read::state::ok;
  return r;
}

}  // namespace detail

/// The profile to price `ctx`'s plans with when none was given (collective over the
/// world). Each rank reads the cache file of this host, job shape and build
/// (detail::profile_cache_key) in the cache directory (detail::profile_cache_dir);
/// where every rank read the same profile, that is it. Otherwise (a file missing on
/// any rank, unusable, or different between nodes) every rank measures a quick
/// profile at once (measure_profile, quick: a few seconds), the same on every rank,
/// and each node's first rank writes it to its cache file atomically. Rank 0 prints
/// one line to stderr saying which, with the file (and the seconds measured); a node's
/// first rank that found its file unusable, or could not write it, says why. A cache
/// that cannot be written is not an error: the profile is used uncached. Throws
/// std::invalid_argument on every rank where the plans compute on a device backend
/// (the measurement times the CPU): give such a job a profile of its device.
inline start_profile profile_at_start(const context& ctx, const backend_ref& be, const std::string& who) {
  auto& w = ctx.world();
  const int n = w.size(), me = w.rank();
  const std::string host = detail::host_name();
  // which ranks share this host: its count is in the key, and its first rank writes the file
  std::vector<std::int64_t> hosts(static_cast<std::size_t>(n), static_cast<std::int64_t>(detail::fnv1a(host) >> 1));
  if (n > 1) {
    std::int64_t mine = hosts[0];
    all_gather(w, view<std::int64_t>(&mine, {1}), view<std::int64_t>(hosts.data(), {static_cast<index_t>(n)}));
  }
  int per_node = 0, leader = -1;
  for (int r = 0; r < n; ++r)
    if (hosts[static_cast<std::size_t>(r)] == hosts[static_cast<std::size_t>(me)]) per_node += 1, leader = leader < 0 ? r : leader;
  start_profile sp;
  std::string no_dir;
  const std::string dir = detail::profile_cache_dir(no_dir);
  const std::string key = detail::profile_cache_key(host, n, per_node, ctx.threads(), be.name());
  if (!dir.empty()) sp.path = (std::filesystem::path(dir) / detail::profile_cache_file(host, n, key)).string();
  const auto found = detail::read_profile_cache(sp.path, key, n);
  // agreed before anything else: a device backend anywhere, and whether every rank read the same profile
  const bool device = !be.on_cpu();
  const std::int64_t h = found.s == detail::cache_read::state::ok ? static_cast<std::int64_t>(detail::fnv1a(found.text) >> 2) + 1 : 0;
  std::int64_t agree[3] = {device ? -1 : 0, h, -h};  // min: any device, the least hash, the greatest
  if (n > 1) all_reduce(w, view<std::int64_t>(agree, {3}), reduce_op::min);
  if (agree[0] < 0)
    throw std::invalid_argument(who + (device ? std::string("no device profile given, and the plans compute on the ") + be.name() +
                                                    " backend: measuring at start times the CPU only; give a profile of the device "
                                                    "(plan_options::profile, WHALE_PROFILE, --profile; bench/profiles/ has some)"
                                              : std::string("no device profile given, and another rank's plans compute on a device "
                                                            "backend (its message says why that needs a profile)")));
  if (agree[1] != 0 && agree[1] == -agree[2]) {
    sp.profile = found.profile;
    sp.loaded = true;
    sp.note = who + "no device profile given: using the one measured at an earlier start, " + sp.path +
              " (delete it, or point WHALE_PROFILE_CACHE elsewhere, to measure anew)";
    if (me == 0) std::cerr << sp.note << std::endl;
    return sp;
  }
  // why this rank measures although a file is there (said once a node: its first rank)
  std::string anew;
  if (found.s == detail::cache_read::state::bad) anew = "the cached profile " + sp.path + " is not usable (" + found.why + "); ";
  else if (found.s == detail::cache_read::state::ok)
    anew = "the cached profile " + sp.path + " is not every rank's (another rank has none, or another); ";
  if (me == leader && me != 0 && !anew.empty()) std::cerr << who << "rank " << me << ": " << anew << "measuring anew" << std::endl;
  const auto t0 = std::chrono::steady_clock::now();
  measure_options mo;
  mo.quick = true;
  mo.name = "measured-at-start";
  sp.profile = measure_profile(w, mo);
  std::string unwritten = sp.path.empty() ? no_dir : std::string();
  if (me == leader && !sp.path.empty()) {
    try {
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec) throw std::runtime_error("cannot create the directory '" + dir + "': " + ec.message());
      const std::string text = "# whale: a quick device profile, measured when auto_plan started without one "
                               "(runtime/profile_cache.hpp)\n# key: " + key + "\n" + profile_text(sp.profile);
      detail::write_file_atomically(sp.path, text, "the profile cache");
    } catch (const std::exception& e) {
      unwritten = e.what();
      if (me != 0) std::cerr << who << "rank " << me << ": the measured profile is not cached: " << unwritten << std::endl;
    }
  }
  // a later start loads it only where every rank has a cache directory and every node's file was written
  double done[2] = {std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), unwritten.empty() ? 0.0 : 1.0};
  if (n > 1) all_reduce(w, view<double>(done, {2}), reduce_op::max);
  sp.seconds = done[0];
  sp.cached = done[1] == 0;
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.1f", sp.seconds);
  std::string where = "cached in " + sp.path + " (later starts load it)";
  if (!unwritten.empty()) where = "not cached: " + unwritten;
  else if (!sp.cached)
    where = (me == leader ? "cached in " + sp.path + ", but not for every rank" : std::string("not cached for every rank")) +
            " (another rank has no cache directory, or its node's first rank could not write; a later start measures again)";
  sp.note = who + "no device profile given: " + anew + "measured a quick one in " + secs + " s on " + std::to_string(n) + " rank" +
            (n > 1 ? "s" : "") + "; " + where + "; whale_profile (scripts/profile) measures a full one";
  if (me == 0) std::cerr << sp.note << std::endl;
  return sp;
}

}  // namespace whale
