// The environment is read in one place (detail/environment.hpp): the library's
// headers call getenv nowhere else, every variable their messages name is in
// environment_variables, and docs/runtime.md lists each one. The readers parse
// strictly, and WHALE_THREADS falls back to OpenBLAS's own variable.
#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "whale/backend/cpu.hpp"
#include "whale/comm/failure.hpp"
#include "whale/detail/environment.hpp"
#include "whale/runtime/options.hpp"
#include "support/scoped_env.hpp"

using namespace whale;

namespace {
namespace fs = std::filesystem;

std::string read_all(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::vector<fs::path> headers() {
  std::vector<fs::path> r;
  for (const auto& e : fs::recursive_directory_iterator(fs::path(WHALE_SOURCE_DIR) / "include" / "whale"))
    if (e.is_regular_file()) r.push_back(e.path());
  REQUIRE(r.size() > 50);
  return r;
}

using test::scoped_env;
}  // namespace

TEST_CASE("getenv is called in detail/environment.hpp only") {
  const std::regex call(R"(\bgetenv\s*\()");
  int found = 0;
  for (const auto& p : headers()) {
    const std::string text = read_all(p);
    const bool here = p.filename() == "environment.hpp" && p.parent_path().filename() == "detail";
    const auto n = std::distance(std::sregex_iterator(text.begin(), text.end(), call), std::sregex_iterator());
    INFO(p.string());
    if (here) found += static_cast<int>(n);
    else CHECK(n == 0);
  }
  CHECK(found == 1);
}

TEST_CASE("every variable the headers name is listed, and documented") {
  // names inside string literals; those the preprocessor tests or defines are macros, not variables
  const std::regex literal(R"re("((?:[^"\\]|\\.)*)")re"), name(R"(\bWHALE_[A-Z0-9_]+\b)"), directive(R"(^\s*#.*\b(WHALE_[A-Z0-9_]+)\b)");
  std::set<std::string> named, macros;
  for (const auto& p : headers()) {
    std::istringstream in(read_all(p));
    for (std::string line; std::getline(in, line);) {
      std::smatch m;
      if (std::regex_search(line, m, directive)) {
        for (auto it = std::sregex_iterator(line.begin(), line.end(), name); it != std::sregex_iterator(); ++it)
          macros.insert(it->str());
        continue;
      }
      for (auto l = std::sregex_iterator(line.begin(), line.end(), literal); l != std::sregex_iterator(); ++l) {
        const std::string s = (*l)[1];
        for (auto it = std::sregex_iterator(s.begin(), s.end(), name); it != std::sregex_iterator(); ++it) named.insert(it->str());
      }
    }
  }
  CHECK(named.size() >= 20);
  for (const auto& n : named) {
    INFO(n << " is named in a header's text but is not in environment_variables");
    CHECK((is_environment_variable(n) || macros.count(n) > 0));
  }
  const std::string doc = read_all(fs::path(WHALE_SOURCE_DIR) / "docs" / "runtime.md");
  REQUIRE(!doc.empty());
  for (const auto& v : environment_variables) {
    INFO(v.name << " is not listed in docs/runtime.md");
    CHECK(doc.find("`" + std::string(v.name) + "`") != std::string::npos);
  }
}

TEST_CASE("the readers parse whole values in range and name the variable") {
  {
    scoped_env a("WHALE_BUCKET_MIB", "12.5");
    CHECK(env::real("WHALE_BUCKET_MIB", 0, 100, true) == 12.5);
    CHECK(plan_options::from_env().bucket_mib == 12.5);
  }
  {
    scoped_env a("WHALE_BUCKET_MIB", "12.5x");
    CHECK_THROWS_WITH_AS(plan_options::from_env(), doctest::Contains("WHALE_BUCKET_MIB '12.5x'"), detail::parse_error);
  }
  {
    scoped_env a("WHALE_MEMORY_CHECK", "maybe");
    CHECK_THROWS_WITH_AS(env::boolean("WHALE_MEMORY_CHECK"), doctest::Contains("WHALE_MEMORY_CHECK"), detail::parse_error);
  }
  {
    scoped_env a("WHALE_TRACE", "");
    CHECK(!env::string("WHALE_TRACE"));  // empty: unset
  }
  {
    scoped_env a("WHALE_WATCHDOG_S", nullptr);
    CHECK(env::watchdog_seconds() == 300.0);
  }
  {
    scoped_env a("WHALE_HEARTBEAT_S", "-1");
    CHECK_THROWS_WITH_AS(env::heartbeat_seconds(), doctest::Contains("WHALE_HEARTBEAT_S '-1'"), detail::parse_error);
  }
  CHECK_THROWS_AS(env::text_of("WHALE_NOT_A_VARIABLE"), std::logic_error);
}

TEST_CASE("heartbeat: a peer counts as frozen 2 s before the bound, after at least 1.5 s of silence") {
  static_assert(heartbeat_silence_limit(10) == 8);  // the job then ends within the 10 s
  CHECK(heartbeat_silence_limit(4) == 2);
  CHECK(heartbeat_silence_limit(3) == 1.5);  // a live peer's beat may be a second old
  CHECK(heartbeat_silence_limit(2) == 1.5);
  CHECK(heartbeat_silence_limit(1) == 1);  // never over the bound
  CHECK(heartbeat_silence_limit(3600) == 3598);
}

TEST_CASE("threads: WHALE_THREADS, else OPENBLAS_NUM_THREADS, else 1, each parsed whole") {
  scoped_env w("WHALE_THREADS", nullptr), b("OPENBLAS_NUM_THREADS", nullptr);
  CHECK(!env::threads());
  CHECK(cpu::default_threads() == 1);
  {
    scoped_env b2("OPENBLAS_NUM_THREADS", "3");
    CHECK(env::threads() == 3);
    scoped_env w2("WHALE_THREADS", "2");
    CHECK(env::threads() == 2);
  }
  for (const char* bad : {"0", "2x", "-1", "", "4097"}) {
    scoped_env w2("WHALE_THREADS", bad);
    CHECK_THROWS_WITH_AS(env::threads(), doctest::Contains("WHALE_THREADS"), detail::parse_error);
  }
}
