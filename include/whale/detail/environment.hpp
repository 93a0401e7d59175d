// The one place whale reads its environment. `environment_variables` lists
// every variable the library reads: whale's own, then those of other programs
// that it respects (OpenBLAS, CUDA, the launchers). A read names its variable
// through `env::name`, which is checked against the table when the program is
// compiled, so a variable cannot be read without being listed (and documented:
// tests/test_environment.cpp checks that docs/runtime.md names each one).
// Values are parsed strictly (detail/parse.hpp): an error names the variable,
// its value and what is allowed. The readers are called where a job starts
// (context::init, make, from_env, a backend's constructor); the internals take
// the values they return.
#pragma once

#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "whale/detail/parse.hpp"

namespace whale {

/// One variable the library reads: its name, the values it takes, and what it sets.
struct environment_variable {
  std::string_view name;
  std::string_view values;
  std::string_view sets;
};

/// Every variable the library reads (docs/runtime.md, "Environment variables").
inline constexpr environment_variable environment_variables[] = {
    // ---- the job (context::init) ----
    {"WHALE_MESH", "a mesh, e.g. data=2,model=2", "the mesh's axes (--mesh overrides)"},
    {"WHALE_THREADS", "a whole number from 1 to 4096", "OpenBLAS threads a process (--threads overrides; default 1)"},
    {"WHALE_WATCHDOG_S", "seconds from 0 to 604800 (0: off)", "how long a rank may wait in one communication call (default 300)"},
    {"WHALE_HEARTBEAT_S", "seconds from 0 to 3600 (0: off)", "the bound within which a job whose rank froze, died on another node, or was cut off ends (default 10)"},
    {"WHALE_CPU_ISA", "baseline, avx2 or avx512", "caps the CPU kernels' instruction set"},
    {"WHALE_MEMORY_CHECK", "a boolean", "the check that a plan fits the node's memory before it allocates (default on)"},
    {"WHALE_MEMORY_LIMIT_MIB", "MiB above 0", "the node's free memory the check assumes (default: what the node has)"},
    // ---- plans (plan_options::from_env; each flag of from_args overrides) ----
    {"WHALE_PRECISION", "fp32 or bf16", "the number format of a plan's steps (--precision; default fp32)"},
    {"WHALE_MICRO_BATCHES", "a whole number from 0 to 16000", "micro-batches a step (--micro-batches)"},
    {"WHALE_STAGE_BLOCKS", "counts, e.g. 1,3", "blocks of the repeat on each pipeline stage (--stage-blocks)"},
    {"WHALE_TRACE", "a path", "write the merged Chrome trace there (--trace)"},
    {"WHALE_BUCKET_MIB", "MiB above 0", "the gradient bucket size (--bucket-mib; default 25)"},
    {"WHALE_DP_OVERLAP", "a boolean", "reduce buckets during backward (default on)"},
    {"WHALE_DP_BLOCKING", "a boolean", "each bucket in one blocking all-reduce (default: by backend)"},
    {"WHALE_BF16_REDUCE", "a boolean", "sum gradients in bf16 (--bf16-reduce)"},
    {"WHALE_ZERO_PREFETCH", "a boolean", "ZeRO-3 gathers the next leaf ahead (default on)"},
    {"WHALE_CHECK_FINITE", "a boolean", "check every layer's output and gradient for NaN/Inf (--check-finite)"},
    {"WHALE_SPEEDS", "factors from 1 to 1000, one a rank, e.g. 1,1,2,4", "emulated slowness of each rank (--speeds)"},
    {"WHALE_BALANCE", "a boolean", "split the batch over replicas by speed (--balance)"},
    {"WHALE_MEMORY_CAPS", "MiB, one a rank", "emulated memory of each rank (--memory-caps)"},
    {"WHALE_WORKER_CUTS", "a boolean", "each WSP worker cuts its own pipeline (--worker-cuts)"},
    {"WHALE_PROFILE", "a path", "the device profile auto_plan prices plans with (--profile)"},
    {"WHALE_PROFILE_CACHE", "a directory", "where auto_plan caches the profile it measures at start when none is given (default $XDG_CACHE_HOME/whale)"},
    // ---- other programs' variables, respected ----
    {"XDG_CACHE_HOME", "an absolute directory", "the user's cache directory: auto_plan's measured profiles in its whale/ when WHALE_PROFILE_CACHE is unset"},
    {"HOME", "a directory", "auto_plan's measured profiles in $HOME/.cache/whale when neither WHALE_PROFILE_CACHE nor XDG_CACHE_HOME is set"},
    {"OPENBLAS_NUM_THREADS", "a whole number from 1 to 4096", "OpenBLAS threads a process when WHALE_THREADS is unset"},
    {"CUDA_VISIBLE_DEVICES", "CUDA's device list", "the GPUs a process sees (named in errors)"},
    {"OMPI_COMM_WORLD_LOCAL_RANK", "a whole number", "Open MPI: this process's rank on its node"},
    {"OMPI_COMM_WORLD_LOCAL_SIZE", "a whole number", "Open MPI: processes on this node"},
    {"MPI_LOCALRANKID", "a whole number", "MPICH / Intel MPI: this process's rank on its node"},
    {"MPI_LOCALNRANKS", "a whole number", "MPICH / Intel MPI: processes on this node"},
    {"LOCAL_RANK", "a whole number", "torchrun-style launchers: this process's rank on its node"},
    {"LOCAL_WORLD_SIZE", "a whole number", "torchrun-style launchers: processes on this node"},
    {"SLURM_LOCALID", "a whole number", "Slurm: this process's rank on its node"},
    {"SLURM_STEP_TASKS_PER_NODE", "Slurm's counts, e.g. 4(x2),3", "Slurm: processes on each node of the step"},
    {"SLURM_NODEID", "a whole number", "Slurm: this node's place in the step"},
};

/// Whether `n` is in environment_variables.
constexpr bool is_environment_variable(std::string_view n) {
  for (const auto& v : environment_variables)
    if (v.name == n) return true;
  return false;
}

namespace env {

/// A variable's name, checked against environment_variables when compiled:
/// naming a variable that is not listed there does not compile.
class name {
 public:
  consteval name(const char* n) : n_(n) {
    if (!is_environment_variable(n))
      throw "whale::env::name: this variable is not listed in environment_variables (whale/detail/environment.hpp); "
            "list it there with its values and what it sets";
  }
  constexpr const char* c_str() const noexcept { return n_; }

 private:
  const char* n_;
};

namespace detail {
inline const char* read(const char* n) noexcept { return std::getenv(n); }
}  // namespace detail

/// The text of `n`, or null when it is unset.
inline const char* text(name n) noexcept { return detail::read(n.c_str()); }

/// The text of a variable named at run time (a launcher's table). Throws
/// std::logic_error when it is not in environment_variables.
inline const char* text_of(std::string_view n) {
  if (!is_environment_variable(n))
    throw std::logic_error("whale::env::text_of: " + std::string(n) + " is not listed in environment_variables");
  return detail::read(std::string(n).c_str());
}

/// A path or spec: the text, when set and not empty.
inline std::optional<std::string> string(name n) {
  const char* e = text(n);
  if (!e || !*e) return std::nullopt;
  return std::string(e);
}

/// A whole number in [lo, hi], when set. Throws whale::detail::parse_error naming the variable.
inline std::optional<long long> integer(name n, long long lo, long long hi) {
  const char* e = text(n);
  if (!e) return std::nullopt;
  return whale::detail::parse_int(e, n.c_str(), lo, hi);
}

/// A finite number in [lo, hi] (`open_lo`: above lo), when set. Throws whale::detail::parse_error naming the variable.
inline std::optional<double> real(name n, double lo, double hi, bool open_lo = false) {
  const char* e = text(n);
  if (!e) return std::nullopt;
  return whale::detail::parse_double(e, n.c_str(), lo, hi, open_lo);
}

/// true/false, 1/0, yes/no, on/off, when set. Throws whale::detail::parse_error naming the variable.
inline std::optional<bool> boolean(name n) {
  const char* e = text(n);
  if (!e) return std::nullopt;
  return whale::detail::parse_bool(e, n.c_str());
}

/// OpenBLAS threads a process: WHALE_THREADS, else OPENBLAS_NUM_THREADS
/// (OpenBLAS's own), else none (the caller's default: 1). "2x", "0", "-1" are errors.
inline std::optional<int> threads() {
  if (auto t = integer("WHALE_THREADS", 1, 4096)) return static_cast<int>(*t);
  if (auto t = integer("OPENBLAS_NUM_THREADS", 1, 4096)) return static_cast<int>(*t);
  return std::nullopt;
}

/// The watchdog's seconds (WHALE_WATCHDOG_S; default 300, 0: off).
inline double watchdog_seconds() { return real("WHALE_WATCHDOG_S", 0, 604800).value_or(300.0); }

/// The heartbeat's seconds (WHALE_HEARTBEAT_S; default 10, 0: off).
inline double heartbeat_seconds() { return real("WHALE_HEARTBEAT_S", 0, 3600).value_or(10.0); }

}  // namespace env
}  // namespace whale
