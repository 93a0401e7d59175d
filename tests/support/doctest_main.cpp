// doctest's main for single-process tests: the program's own file's cases
// only, and a failure when none is left to run (support/own_file.hpp).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "own_file.hpp"

int main(int argc, char** argv) {
  doctest::Context ctx(argc, argv);
  whale::test::only_own_file(ctx);
  return whale::test::fail_if_none_ran(ctx.run());
}
