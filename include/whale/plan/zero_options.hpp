// ZeRO's run-time choices: how a sharded plan gathers parameters and scatters
// gradients. They change its buffers, not its program, so the memory model
// (plan/memory.hpp) reads them as the runtime does; plan_options has them as
// one of its groups (runtime/option_groups.hpp).
#pragma once

#include "whale/detail/environment.hpp"

namespace whale {

/// ZeRO: how a sharded plan gathers parameters and scatters gradients.
struct zero_options {
  bool prefetch = true;  ///< level 3: gather the next leaf while the current one runs
  int max_pending = 2;   ///< levels 2–3: leaves whose reduce-scatters may be in flight

  /// WHALE_ZERO_PREFETCH.
  void read_env() {
    if (auto v = env::boolean("WHALE_ZERO_PREFETCH")) prefetch = *v;
  }
};

}  // namespace whale
