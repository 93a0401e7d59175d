// Header-only by default; optionally a compiled core, as fmt offers. The
// model-independent runtime's larger functions (executor_core's, in
// runtime/executor_core_impl.hpp, runtime/executor_memory_impl.hpp and
// runtime/pass.hpp; zero_engine's, in runtime/zero_impl.hpp; mpi_comm's, in
// comm/mpi_comm_impl.hpp; the checkpoints' save and load, in
// train/checkpoint_impl.hpp; the trainer's start and its core, in
// train/trainer_start_impl.hpp and train/trainer_core_impl.hpp; lower() and pass_order_of, in
// plan/lower_impl.hpp and plan/lower_pass.hpp) are marked WHALE_CORE_INLINE and their
// definitions sit behind WHALE_CORE_DEFINITIONS:
// - by default both say "inline, here": every translation unit that uses them
//   compiles them, as with any header-only library;
// - with WHALE_COMPILED_CORE defined (CMake: link whale::core) a translation
//   unit sees their declarations only, and the library whale_core, compiled
//   once, defines them (include/whale/runtime/core.cpp defines
//   WHALE_CORE_LIBRARY, which makes them ordinary, emitted functions).
// Every unit of one program must agree: link whale::core to all or to none.
// The *_impl.hpp files refuse to be included directly under WHALE_COMPILED_CORE.
#pragma once

#if defined(WHALE_COMPILED_CORE) && (defined(__CUDACC__) || defined(WHALE_HAS_CUDA))
#error "whale::core (WHALE_COMPILED_CORE) is the CPU build's compiled core; a CUDA unit or program (whale::cuda) links whale::mpi, header-only"
#endif
#if defined(WHALE_COMPILED_CORE) && !defined(WHALE_HAS_MPI)
#error "whale::core (WHALE_COMPILED_CORE) is compiled with MPI (WHALE_HAS_MPI); link the target whale::core, which brings whale::mpi"
#endif

#if defined(WHALE_CORE_LIBRARY)
#define WHALE_CORE_INLINE
#define WHALE_CORE_DEFINITIONS 1
#elif defined(WHALE_COMPILED_CORE)
#define WHALE_CORE_INLINE
#define WHALE_CORE_DEFINITIONS 0
#else
#define WHALE_CORE_INLINE inline
#define WHALE_CORE_DEFINITIONS 1
#endif
