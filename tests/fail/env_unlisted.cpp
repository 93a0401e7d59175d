// Compile-fail pair: the library reads an environment variable only through
// env::name, which must name a variable listed in environment_variables (and
// so documented); an unlisted name does not compile, and the error says where
// to list it.
// expect-error: not listed in environment_variables
#include "whale/detail/environment.hpp"

int main() {
#if WHALE_FAIL
  return whale::env::text("WHALE_NOT_LISTED") != nullptr;
#else
  return whale::env::text("WHALE_THREADS") != nullptr ? 0 : 0;
#endif
}
