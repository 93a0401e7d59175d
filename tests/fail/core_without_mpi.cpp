// Compile-fail pair: the compiled core (WHALE_COMPILED_CORE, what linking
// whale::core defines) is built with MPI; a unit that asks for it without MPI
// does not compile, and the error says to link the target whale::core.
// expect-error: whale::core \(WHALE_COMPILED_CORE\) is compiled with MPI
#if WHALE_FAIL
#define WHALE_COMPILED_CORE 1
#endif
#include "whale/runtime/zero.hpp"

int main() { return 0; }
