// The bytes a plan's step sends between the job's hosts, as the simulator
// predicts them (step_simulation::inter_node_bytes) for where the ranks really
// are: each rank's host name is gathered, ranks on one host are one node.
// scripts/multinode --bytes compares it with what the hosts' links counted.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/plan/device_text.hpp"
#include "whale/plan/simulate.hpp"

namespace bench {

/// Where the world's ranks are: the hosts, and each rank's device number as
/// simulate() takes it (node = device / ranks_per_node).
struct host_map {
  int hosts = 1, per_node = 1;
  std::vector<int> devices;
};

/// Collective over the world: every rank's host name, by its hash.
inline host_map gather_hosts(whale::context& ctx) {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) throw std::runtime_error("bench: gethostname failed");
  const auto mine = static_cast<std::int64_t>(std::hash<std::string>{}(name));
  std::vector<std::int64_t> all(static_cast<std::size_t>(ctx.size()));
  whale::all_gather(ctx.world(), whale::cview<std::int64_t>(&mine, {1}), whale::view<std::int64_t>(all.data(), {ctx.size()}));
  std::map<std::int64_t, int> node;  // host -> its number, in order of first rank
  std::vector<int> of(all.size()), slot(all.size());
  std::vector<int> count;
  for (std::size_t r = 0; r < all.size(); ++r) {
    const auto [it, fresh] = node.try_emplace(all[r], static_cast<int>(node.size()));
    if (fresh) count.push_back(0);
    of[r] = it->second;
    slot[r] = count[static_cast<std::size_t>(of[r])]++;
  }
  host_map m;
  m.hosts = static_cast<int>(node.size());
  m.per_node = *std::max_element(count.begin(), count.end());
  for (std::size_t r = 0; r < all.size(); ++r) m.devices.push_back(of[r] * m.per_node + slot[r]);
  return m;
}

/// The simulator's inter-node bytes of one step of `global` sequences of `seq`
/// tokens of `net` (an executor) with the ranks where they are. Only bytes are
/// read, so any link figures do: a flat profile stands in.
template <class Net> double predicted_inter_node_bytes(const Net& net, const host_map& hosts, whale::index_t global, whale::index_t seq) {
  std::ostringstream text;
  text << "device bytes-only\ngemm 64 64 64 0 0 100\nbandwidth 10\n";
  for (const char* level : {"node", "net"})
    for (const char* kind : {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p"})
      text << "link " << level << ' ' << kind << " 2 10 1\n";
  std::istringstream in(text.str());
  const auto dev = whale::device_profile::parse(in, "bytes-only");
  return whale::simulate(net.description(), net.step_programs(global, seq), dev, hosts.per_node, hosts.devices).inter_node_bytes;
}

/// The fields a plan's line carries on several hosts: the hosts, and the
/// predicted inter-node bytes of a step (nothing on one host). With a profile
/// (--simulate), on any number of hosts: the simulated step on it for the ranks
/// where they are (predicted_step_s), and the busiest rank's communication and
/// wait in it.
template <class Net> void add_inter_node_fields(json_line& j, const Net& net, const host_map& hosts, whale::index_t global,
                                                whale::index_t seq, const std::optional<whale::device_profile>& profile) {
  if (hosts.hosts >= 2) {
    j.add("hosts", static_cast<long long>(hosts.hosts));
    j.add("inter_node_bytes_predicted_per_step", predicted_inter_node_bytes(net, hosts, global, seq));
  }
  if (!profile) return;
  const auto sim = whale::simulate(net.description(), net.step_programs(global, seq), *profile, hosts.per_node, hosts.devices);
  double comm = 0, wait = 0;
  for (const auto& r : sim.ranks) comm = std::max(comm, r.comm_s), wait = std::max(wait, r.wait_s);
  j.add("profile", profile->name);
  j.add("predicted_step_s", sim.step_s).add("predicted_comm_s", comm).add("predicted_wait_s", wait);
}

}  // namespace bench
