// A test's environment variable set for one scope and restored after it
// (whale::test, the tests' support namespace, as support/plan_check.hpp).
#pragma once

#include <stdlib.h>

#include <cstdlib>
#include <optional>
#include <string>

namespace whale::test {

/// Sets variable `n` to `v` (nullptr: unsets it) until the end of the scope.
struct scoped_env {
  std::string name;
  std::optional<std::string> was;
  scoped_env(const char* n, const char* v) : name(n) {
    if (const char* e = std::getenv(n)) was = e;
    if (v) ::setenv(n, v, 1);
    else ::unsetenv(n);
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;
  ~scoped_env() {
    if (was) ::setenv(name.c_str(), was->c_str(), 1);
    else ::unsetenv(name.c_str());
  }
};

}  // namespace whale::test
