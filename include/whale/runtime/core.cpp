// whale::core, the optional compiled core (detail/compiled.hpp): the one unit
// that compiles the model-independent runtime's larger functions
// (executor_core's, zero_engine's, mpi_comm's, the checkpoints' save and
// load, the trainer's start and core, lowering) and the library's CPU kernel loops (backend/cpu/instances.hpp) as
// ordinary functions. Programs that link whale::core see
// their declarations only and call these; header-only programs compile them
// in every unit. Built by CMake as the static library whale_core.
#define WHALE_CORE_LIBRARY 1
#include "whale/whale.hpp"
