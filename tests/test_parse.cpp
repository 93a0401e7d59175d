// The strict parsing layer (detail/parse.hpp) and the options that use it:
// whole-string numbers in range, booleans only as true/false/1/0/yes/no/on/off,
// every error naming the flag or variable and its value; plan_options from the
// environment and the command line; and a fuzz-style test: random strings for
// every flag are either a value that the strict grammar allows or a parse_error
// naming the flag, never a silent prefix, default or crash. Also every
// launcher's local-rank variables (comm/launcher.hpp) and the GPU they give.
#include <doctest/doctest.h>

#include <cstdlib>
#include <map>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "whale/comm/launcher.hpp"
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
      {"WHALE_CHECK_FINITE", "yes please"}, {"WHALE_PRECISION", "fp16"}, {"WHALE_PRECISION", "BF16"}};
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
  CHECK(o.blocking == false);
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
           {"--bucket-mib", "nan"}, {"--precision", "bf8"}, {"--precision", "bf16 "}}) {
    CAPTURE(flag);
    CAPTURE(value);
    char** argv = args({"prog", flag, value});
    int argc = 3;
    CHECK_THROWS_WITH_AS(plan_options::from_args(argc, argv), doctest::Contains(flag.c_str()), parse_error);
  }
  ::setenv("WHALE_PRECISION", "bf16", 1);
  CHECK(plan_options::from_env().precision == precision::bf16);
  ::unsetenv("WHALE_PRECISION");
  CHECK(plan_options::from_env().precision == precision::fp32);  // the default
  char** argv = args({"prog", "--micro-batches", "4", "--check-finite", "--precision", "bf16", "--other", "x"});
  int argc = 8;
  const auto p = plan_options::from_args(argc, argv);
  CHECK(p.micro_batches == 4);
  CHECK(p.check_finite);
  CHECK(p.precision == precision::bf16);
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

namespace {
using env = std::map<std::string, std::string>;
local_place place_in(const env& e) {
  return local_place_from([&](const char* name) -> const char* {
    const auto it = e.find(name);
    return it == e.end() ? nullptr : it->second.c_str();
  });
}
}  // namespace

TEST_CASE("launchers: each one's local rank and node size, in order of belief") {
  const auto none = place_in({});
  CHECK(!none.launched);
  CHECK(none.rank == 0);
  CHECK(none.size == 1);
  const auto ompi = place_in({{"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  CHECK((ompi.launched && ompi.rank == 3 && ompi.size == 4));
  CHECK(ompi.source == "OMPI_COMM_WORLD_LOCAL_RANK=3, OMPI_COMM_WORLD_LOCAL_SIZE=4");
  const auto mpich = place_in({{"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}});
  CHECK((mpich.rank == 1 && mpich.size == 2));
  const auto torchrun = place_in({{"LOCAL_RANK", "5"}, {"LOCAL_WORLD_SIZE", "8"}});
  CHECK((torchrun.rank == 5 && torchrun.size == 8));
  const auto unsized = place_in({{"LOCAL_RANK", "2"}});
  CHECK((unsized.rank == 2 && unsized.size == 0));  // the launcher does not say
  // Slurm: this node's count from the step's compressed list at SLURM_NODEID
  const auto slurm = place_in({{"SLURM_LOCALID", "2"}, {"SLURM_STEP_TASKS_PER_NODE", "4(x2),3"}, {"SLURM_NODEID", "2"}});
  CHECK((slurm.rank == 2 && slurm.size == 3));
  CHECK(place_in({{"SLURM_LOCALID", "0"}, {"SLURM_STEP_TASKS_PER_NODE", "4(x2),3"}, {"SLURM_NODEID", "1"}}).size == 4);
  CHECK(place_in({{"SLURM_LOCALID", "0"}, {"SLURM_STEP_TASKS_PER_NODE", "8"}}).size == 8);
  CHECK(place_in({{"SLURM_LOCALID", "1"}, {"SLURM_NTASKS_PER_NODE", "2"}}).size == 0);  // the job's request: not this step's
  // mpirun or torchrun inside a Slurm allocation: the inner launcher is believed
  const auto inner = place_in({{"SLURM_LOCALID", "0"}, {"SLURM_NTASKS_PER_NODE", "1"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                               {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  CHECK((inner.rank == 1 && inner.size == 2));
  CHECK(place_in({{"SLURM_LOCALID", "0"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "4"}}).rank == 3);
}

TEST_CASE("launchers: a malformed or inconsistent variable is an error naming it and its value") {
  for (const char* bad : {"1x", "-1", "", " 1", "99999999999"})
    for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "LOCAL_RANK", "SLURM_LOCALID"})
      CHECK_THROWS_WITH_AS(place_in({{var, bad}}), doctest::Contains((std::string(var) + " '" + bad + "'").c_str()), parse_error);
  CHECK_THROWS_WITH_AS(place_in({{"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "0"}}),
                       doctest::Contains("OMPI_COMM_WORLD_LOCAL_SIZE '0'"), parse_error);
  CHECK_THROWS_WITH_AS(place_in({{"LOCAL_RANK", "4"}, {"LOCAL_WORLD_SIZE", "4"}}),
                       doctest::Contains("local rank 4 is not below the node's 4 processes"), parse_error);
  for (const char* bad : {"4(x", "4(2)", "x", "4(x0)", "4,,2", "4(x2)3", "4,", ""})
    CHECK_THROWS_WITH_AS(place_in({{"SLURM_LOCALID", "0"}, {"SLURM_STEP_TASKS_PER_NODE", bad}}),
                         doctest::Contains("SLURM_STEP_TASKS_PER_NODE"), parse_error);
  CHECK_THROWS_WITH_AS(place_in({{"SLURM_LOCALID", "0"}, {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"}, {"SLURM_NODEID", "2"}}),
                       doctest::Contains("has no count for SLURM_NODEID 2"), parse_error);
  CHECK_THROWS_WITH_AS(place_in({{"SLURM_LOCALID", "0"}, {"SLURM_STEP_TASKS_PER_NODE", "4"}, {"SLURM_NODEID", "a"}}),
                       doctest::Contains("SLURM_NODEID 'a'"), parse_error);
}

TEST_CASE("launchers: local rank r takes visible GPU r; more ranks than GPUs is an error naming both") {
  local_place p = place_in({{"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  CHECK(device_for(p, 8, nullptr) == 3);
  CHECK(device_for(p, 4, "0,1,2,3") == 3);
  // every rank of the node fails, not only those above the count: local rank 0 of 4 on 2 GPUs
  p.rank = 0;
  CHECK_THROWS_WITH_AS(device_for(p, 2, "4,5"), doctest::Contains("4 processes on this node"), std::runtime_error);
  CHECK_THROWS_WITH_AS(device_for(p, 2, "4,5"), doctest::Contains("only 2 GPU(s) visible (CUDA_VISIBLE_DEVICES=4,5)"),
                       std::runtime_error);
  // a launcher that gave each rank its own GPU: one visible device, taken
  p.rank = 2;
  CHECK(device_for(p, 1, "6") == 0);
  CHECK_THROWS_WITH_AS(device_for(p, 1, nullptr), doctest::Contains("only 1 GPU(s) visible"), std::runtime_error);
  CHECK_THROWS_AS(device_for(p, 1, ""), std::runtime_error);
  // a launcher that does not say the node's size: at least local rank + 1 processes
  const auto unsized = place_in({{"LOCAL_RANK", "2"}});
  CHECK(device_for(unsized, 3, nullptr) == 2);
  CHECK_THROWS_WITH_AS(device_for(unsized, 2, nullptr), doctest::Contains("3 or more processes on this node (LOCAL_RANK=2)"),
                       std::runtime_error);
  CHECK_THROWS_WITH_AS(device_for(place_in({}), 0, nullptr), doctest::Contains("no CUDA device is visible"), std::runtime_error);
  CHECK(device_for(place_in({}), 2, nullptr) == 0);
}
