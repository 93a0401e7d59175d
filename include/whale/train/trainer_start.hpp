// The trainer's start, whatever its network and optimizer: the checks of its
// options, the bf16 master weights' buffer, the signal handlers, the
// checkpoint directory and the metrics log, made before any work on every
// rank (every rank fails alike). trainer<Net, Opt>'s constructor says what it
// needs of its types (`trainer_facts`) and calls it; compiled once in
// whale::core under the compiled core (detail/compiled.hpp).
#pragma once

#include <cstdint>
#include <string>

#include "whale/backend/backend_ref.hpp"
#include "whale/comm/communicator.hpp"
#include "whale/plan/precision_rule.hpp"
#include "whale/detail/compiled.hpp"
#include "whale/tensor/tensor.hpp"
#include "whale/train/run_record.hpp"
#include "whale/train/trainer_options.hpp"

namespace whale::detail {

/// What the trainer's start needs to know of its network and optimizer.
struct trainer_facts {
  int rank = 0;
  world_comm* world = nullptr;  ///< a Checkpointable network's world: errors are agreed over it (null: thrown here)
  bool has_params = false;      ///< the network exposes params() (the weights bf16 rounds)
  bool zero3 = false;           ///< the plan is ZeRO-3
  bool checkpoints = false;     ///< save and load work with this network and optimizer
  bool has_lr = false;          ///< the optimizer has a member `lr` (lr_schedule sets it)
  std::string optimizer;        ///< its name, for the message
  view<float> params;           ///< bf16: the parameters the master weights mirror; else empty
  backend_ref backend;          ///< where the parameters live
  whale::precision precision = whale::precision::fp32;  ///< the network's, which the trainer trains in
};

/// The trainer's checks and preparations before any work (std::invalid_argument
/// or std::runtime_error naming the problem, on every rank); `master` is sized
/// for bf16's fp32 master weights.
WHALE_CORE_INLINE void start_trainer(const trainer_options& o, const trainer_facts& f, run_record& rec,
                                     tensor<float>& master, std::int64_t next);

}  // namespace whale::detail

#if WHALE_CORE_DEFINITIONS  // header-only, or the compiled core's own unit (detail/compiled.hpp)
#include "whale/train/trainer_start_impl.hpp"
#endif
