// The strict parsing layer (detail/parse.hpp) and the options that use it:
// whole-string numbers in range, booleans only as true/false/1/0/yes/no/on/off,
// every error naming the flag or variable and its value; plan_options from the
// environment and the command line; and a fuzz-style test: random strings for
// every flag are either a value that the strict grammar allows or a parse_error
// naming the flag, never a silent prefix, default or crash.
#include <doctest/doctest.h>

#include <cstdlib>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "whale/detail/parse.hpp"
#include "whale/runtime/agree.hpp"
#include "whale/runtime/options.hpp"
#include "whale/version.hpp"

using namespace whale;
using detail::parse_error;

TEST_CASE("numbers are whole strings, in range; booleans are words") {
  CHECK(detail::parse_int("12", "--steps", 1, 100) == 12);
  CHECK(detail::parse_int("+7", "--steps", 1, 100) == 7);
  for (const char* bad : {"2x", "", " 3", "abc", "1.5", "nan", "0x10", "3 "})
    CHECK_THROWS_WITH_AS(detail::parse_int(bad, "--steps", 1, 100), doctest::Contains("--steps"), parse_error);
  CHECK_THROWS_WITH_AS(detail::parse_int("-5", "--steps", 1, 100), doctest::Contains("out of range; allowed 1 to 100"),
                       parse_error);
  CHECK_THROWS_WITH_AS(detail::parse_int("99999999999999999999", "--steps", 1, 100), doctest::Contains("--steps"),
                       parse_error);
  CHECK(detail::parse_double("2.5", "--lr", 0, 10) == 2.5);
  CHECK(detail::parse_double("1e-3", "--lr", 0, 10) == doctest::Approx(1e-3));
  for (const char* bad : {"nan", "inf", "-inf", "1e999", "2.5x", "", "0x1p3", "abc", " 1"})
    CHECK_THROWS_WITH_AS(detail::parse_double(bad, "--bucket-mib", 0, 1e6, true), doctest::Contains("--bucket-mib"),
                         parse_error);
  CHECK_THROWS_WITH_AS(detail::parse_double("0", "--bucket-mib", 0, 1e6, true), doctest::Contains("out of range"),
                       parse_error);
  for (const char* t : {"1", "true", "yes", "on"}) CHECK(detail::parse_bool(t, "WHALE_DP_OVERLAP"));
  for (const char* f : {"0", "false", "no", "off"}) CHECK_FALSE(detail::parse_bool(f, "WHALE_DP_OVERLAP"));
  for (const char* bad : {"", "maybe", "TRUE", "2", "-1", "y"})
    CHECK_THROWS_WITH_AS(detail::parse_bool(bad, "WHALE_DP_BLOCKING"),
                         doctest::Contains("expected true/false, 1/0, yes/no or on/off"), parse_error);
}

TEST_CASE("plan_options: every variable and flag is parsed strictly, naming itself") {
  const std::vector<std::pair<const char*, const char*>> bad_env = {
      {"WHALE_MICRO_BATCHES", "4x"}, {"WHALE_MICRO_BATCHES", "-1"}, {"WHALE_STAGE_BLOCKS", "1,,3"},
      {"WHALE_STAGE_BLOCKS", "1;3"}, {"WHALE_BUCKET_MIB", "nan"},   {"WHALE_BUCKET_MIB", "0"},
      {"WHALE_DP_OVERLAP", "maybe"}, {"WHALE_DP_BLOCKING", "false!"}, {"WHALE_ZERO_PREFETCH", "2"},
      {"WHALE_CHECK_FINITE", "yes please"}};
  for (const auto& [var, value] : bad_env) {
    CAPTURE(var);
    CAPTURE(value);
    ::setenv(var, value, 1);
    CHECK_THROWS_WITH_AS(plan_options::from_env(), doctest::Contains(var), parse_error);
    ::unsetenv(var);
  }
  ::setenv("WHALE_DP_BLOCKING", "false", 1);
  ::setenv("WHALE_CHECK_FINITE", "on", 1);
  const auto o = plan_options::from_env();
  CHECK_FALSE(o.blocking);
  CHECK(o.check_finite);
  ::unsetenv("WHALE_DP_BLOCKING");
  ::unsetenv("WHALE_CHECK_FINITE");

  auto args = [](std::vector<std::string> a) {
    static std::vector<std::string> keep;
    static std::vector<char*> v;
    keep = std::move(a);
    v.clear();
    for (auto& s : keep) v.push_back(s.data());
    v.push_back(nullptr);
    return v.data();
  };
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--micro-batches", "2x"}, {"--micro-batches", "abc"}, {"--stage-blocks", "3,-1"}, {"--bucket-mib", "-5"},
           {"--bucket-mib", "nan"}}) {
    CAPTURE(flag);
    CAPTURE(value);
    char** argv = args({"prog", flag, value});
    int argc = 3;
    CHECK_THROWS_WITH_AS(plan_options::from_args(argc, argv), doctest::Contains(flag.c_str()), parse_error);
  }
  char** argv = args({"prog", "--micro-batches", "4", "--check-finite", "--other", "x"});
  int argc = 6;
  const auto p = plan_options::from_args(argc, argv);
  CHECK(p.micro_batches == 4);
  CHECK(p.check_finite);
  CHECK(argc == 3);  // the flags it took are removed; the rest stays
  CHECK(std::string(argv[1]) == "--other");
  char** missing = args({"prog", "--micro-batches"});
  int argc2 = 2;
  CHECK_THROWS_WITH_AS(plan_options::from_args(argc2, missing), doctest::Contains("--micro-batches needs a value"),
                       parse_error);
}

TEST_CASE("fuzz: random strings are a strictly valid value or an error naming the flag") {
  std::mt19937_64 gen(20261201);
  const std::string alphabet = "0123456789+-.eExXnaifINFtrueyso ,;_";
  const std::regex integer(R"([+-]?[0-9]+)");
  const std::regex decimal(R"([+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?)");
  const std::vector<std::string> words = {"nan", "inf", "true", "1e3", "0x1", "-0", "+", "", "1,2", "2x", "007"};
  int parsed = 0, refused = 0;
  for (int k = 0; k < 20000; ++k) {
    std::string s;
    if (k % 5 == 0) {
      s = words[gen() % words.size()] + (gen() % 2 ? words[gen() % words.size()] : "");
    } else {
      const int n = static_cast<int>(gen() % 7);
      for (int i = 0; i < n; ++i) s += alphabet[gen() % alphabet.size()];
    }
    CAPTURE(s);
    try {
      const auto v = detail::parse_int(s, "--steps", 1, 1000);
      CHECK(std::regex_match(s, integer));
      CHECK((v >= 1 && v <= 1000));
      ++parsed;
    } catch (const parse_error& e) {
      CHECK(std::string(e.what()).find("--steps '" + s + "'") == 0);
      ++refused;
    }
    try {
      const auto v = detail::parse_double(s, "--lr", 0, 10, true);
      CHECK(std::regex_match(s, decimal));
      CHECK((v > 0 && v <= 10));
      ++parsed;
    } catch (const parse_error& e) {
      CHECK(std::string(e.what()).find("--lr '" + s + "'") == 0);
      ++refused;
    }
    try {
      (void)detail::parse_bool(s, "WHALE_DP_OVERLAP");
      CHECK((s == "1" || s == "0" || s == "true" || s == "false" || s == "yes" || s == "no" || s == "on" || s == "off"));
    } catch (const parse_error& e) {
      CHECK(std::string(e.what()).find("WHALE_DP_OVERLAP '" + s + "'") == 0);
    }
    if (s.empty() || s.find_first_of(" ,;") != std::string::npos) continue;
    ::setenv("WHALE_MICRO_BATCHES", s.c_str(), 1);
    try {
      const auto o = plan_options::from_env();
      CHECK(std::regex_match(s, integer));
      CHECK((o.micro_batches >= 0 && o.micro_batches <= 16000));
    } catch (const parse_error& e) {
      CHECK(std::string(e.what()).find("WHALE_MICRO_BATCHES") != std::string::npos);
    }
    ::unsetenv("WHALE_MICRO_BATCHES");
  }
  MESSAGE("fuzz: " << parsed << " values parsed, " << refused << " refused");
  CHECK(parsed > 100);
  CHECK(refused > 100);
}

TEST_CASE("the build the ranks compare names whale's version and what changes the numbers") {
  const auto b = whale::detail::build_id();
  MESSAGE(b);
  CHECK(b.rfind(std::string("whale ") + whale::version + ", ", 0) == 0);
  CHECK(std::regex_search(b, std::regex(", (not optimised|optimised|optimised for size)(,|$)")));
  CHECK(std::regex_search(b, std::regex(", multiply-adds (fused|separate)")));
#if defined(__OPTIMIZE__) && !defined(__OPTIMIZE_SIZE__)
  CHECK(b.find(", optimised,") != std::string::npos);
#endif
  // a*b + c through the probe: one rounding or two, and the text says which
  const volatile float a = 1.f + 0x1p-12f, c = -(1.f + 0x1p-11f);
  const float r = whale::detail::multiply_add_probe(a, a, c);
  CHECK((r == 0.f || r == 0x1p-24f));
}
