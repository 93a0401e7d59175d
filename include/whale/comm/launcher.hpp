// Where this process sits on its node, as the launcher that started it says,
// and which GPU it therefore takes. Read in this one place, strictly parsed.
//
// Launchers, in the order they are believed (the first one whose local-rank
// variable is set):
//   Open MPI's mpirun     OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE
//   MPICH / Intel MPI     MPI_LOCALRANKID, MPI_LOCALNRANKS
//   torchrun-style        LOCAL_RANK, LOCAL_WORLD_SIZE
//   Slurm's srun          SLURM_LOCALID, and this node's task count from
//                         SLURM_STEP_TASKS_PER_NODE ("4(x2),3") at SLURM_NODEID
// Slurm comes last: inside an allocation its variables are also set for
// processes that another launcher (mpirun, torchrun) started, where they
// describe the batch step, not this process. None set: one process, local rank 0.
//
// The GPU: local rank r takes visible device r, so N ranks on a node need N
// visible GPUs (CUDA_VISIBLE_DEVICES is respected: it decides what is visible).
// A launcher that gives each rank its own GPU (srun --gpus-per-task=1, or a
// CUDA_VISIBLE_DEVICES per rank) leaves one visible device per rank: it is
// taken. Otherwise more local ranks than visible GPUs is an error on every
// rank of the node, naming both numbers.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

#include "whale/detail/environment.hpp"
#include "whale/detail/parse.hpp"

namespace whale {

/// This process's place on its node.
struct local_place {
  int rank = 0;  ///< among the processes of this node, from 0
  int size = 1;  ///< processes on this node; 0 where the launcher does not say
  /// What said so, e.g. "OMPI_COMM_WORLD_LOCAL_RANK=1, OMPI_COMM_WORLD_LOCAL_SIZE=4", or that nothing did.
  std::string source = "no launcher variable set: one process";
  bool launched = false;  ///< some launcher's local-rank variable was found
};

namespace detail {

/// Tasks on node `node` from Slurm's compressed list "4(x2),3" (nodes 0-1 run 4, node 2 runs 3); -1 if not there.
/// The whole list is checked, not only up to the node.
inline long long slurm_tasks_on_node(std::string_view list, long long node, std::string_view origin) {
  long long first = 0, found = -1;  // the first node of the current item
  std::size_t at = 0;
  if (list.empty() || list.back() == ',') throw parse_error(std::string(origin) + " " + quoted(list) + ": expected counts such as 4(x2),3");
  while (at < list.size()) {
    const std::size_t end = std::min(list.find(',', at), list.size());
    std::string_view item = list.substr(at, end - at);
    long long repeat = 1;
    if (const auto open = item.find('('); open != std::string_view::npos) {
      if (item.size() < open + 4 || item.substr(open, 2) != "(x" || item.back() != ')')
        throw parse_error(std::string(origin) + " " + quoted(list) + ": expected counts such as 4(x2),3");
      repeat = parse_int(item.substr(open + 2, item.size() - open - 3), origin, 1, INT_MAX);
      item = item.substr(0, open);
    }
    const long long tasks = parse_int(item, origin, 1, INT_MAX);
    if (found < 0 && node >= first && node < first + repeat) found = tasks;
    first += repeat;
    at = end + 1;
  }
  return found;
}

}  // namespace detail

/// The place a launcher's variables give, read through `get` (a name -> value
/// or null lookup: env::text_of in a job). Throws detail::parse_error (an
/// invalid_argument) naming the variable and its value when one is not a whole
/// number in range, or when the local rank is not below the local size.
template <class Get> local_place local_place_from(Get&& get) {
  struct launcher {
    const char* rank_var;
    const char* size_var;  // null: Slurm's own rule
  };
  static constexpr launcher launchers[] = {{"OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
                                           {"MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
                                           {"LOCAL_RANK", "LOCAL_WORLD_SIZE"},
                                           {"SLURM_LOCALID", nullptr}};
  for (const auto& l : launchers) {
    const char* r = get(l.rank_var);
    if (!r) continue;
    local_place p;
    p.launched = true;
    p.rank = static_cast<int>(detail::parse_int(r, l.rank_var, 0, INT_MAX));
    p.source = std::string(l.rank_var) + "=" + r;
    p.size = 0;
    if (l.size_var) {
      if (const char* s = get(l.size_var)) {
        p.size = static_cast<int>(detail::parse_int(s, l.size_var, 1, INT_MAX));
        p.source += std::string(", ") + l.size_var + "=" + s;
      }
    } else if (const char* list = get("SLURM_STEP_TASKS_PER_NODE")) {
      const char* node = get("SLURM_NODEID");
      const long long id = node ? detail::parse_int(node, "SLURM_NODEID", 0, INT_MAX) : 0;
      const long long n = detail::slurm_tasks_on_node(list, id, "SLURM_STEP_TASKS_PER_NODE");
      if (n < 0)
        throw detail::parse_error(std::string("SLURM_STEP_TASKS_PER_NODE ") + detail::quoted(list) + " has no count for SLURM_NODEID " +
                                  std::to_string(id));
      p.size = static_cast<int>(n);
      p.source += std::string(", SLURM_STEP_TASKS_PER_NODE=") + list + (node ? std::string(" at SLURM_NODEID=") + node : std::string());
    }  // (SLURM_NTASKS_PER_NODE is the job's request, not this step's: not read)
    if (p.size > 0 && p.rank >= p.size)
      throw detail::parse_error("local rank " + std::to_string(p.rank) + " is not below the node's " + std::to_string(p.size) +
                                " processes (" + p.source + ")");
    return p;
  }
  return {};
}

/// This process's place, from its environment.
inline local_place local_place_of_process() {
  return local_place_from([](const char* name) -> const char* { return env::text_of(name); });
}

/// The visible device this process takes: its local rank, or the one device
/// its launcher left it. `visible`: devices this process sees (cudaGetDeviceCount,
/// which follows CUDA_VISIBLE_DEVICES); `cuda_visible_devices`: that variable
/// (null if unset), for the message. Throws std::runtime_error when there is no
/// device, or when the node has more ranks than visible devices (naming both).
inline int device_for(const local_place& p, int visible, const char* cuda_visible_devices) {
  const std::string seen = cuda_visible_devices ? std::string(" (CUDA_VISIBLE_DEVICES=") + cuda_visible_devices + ")" : std::string();
  if (visible <= 0)
    throw std::runtime_error("no CUDA device is visible to this process" + seen + "; run on a machine with a GPU, or use the CPU backend");
  const int ranks = p.size > 0 ? p.size : p.rank + 1;  // at least this many on the node
  if (ranks <= visible) return p.rank;
  if (visible == 1 && cuda_visible_devices && *cuda_visible_devices) return 0;  // its own GPU, chosen by the launcher
  throw std::runtime_error(std::to_string(ranks) + (p.size > 0 ? "" : " or more") + " processes on this node (" + p.source +
                           ") but only " + std::to_string(visible) + " GPU(s) visible" + seen +
                           ": start at most " + std::to_string(visible) +
                           " ranks per node, or give each rank its own GPU (CUDA_VISIBLE_DEVICES per rank, srun --gpus-per-task=1)");
}

}  // namespace whale
