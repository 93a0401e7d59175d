// doctest's main for single-process tests. A test program runs the cases of
// its own test file only (whale_test_file, written by tests/CMakeLists.txt):
// with WHALE_TEST_GROUPS a group's files are compiled into one object, which
// every program of the group links.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <string>

extern const char* const whale_test_file;

int main(int argc, char** argv) {
  doctest::Context ctx(argc, argv);
  ctx.addFilter("source-file", ("*" + std::string(whale_test_file)).c_str());
  return ctx.run();
}
