// auto_plan without a device profile (runtime/profile_cache.hpp): the first start
// measures a quick profile on every rank, chooses a plan and caches the profile in
// WHALE_PROFILE_CACHE (here a fresh directory); the next start loads it, says so, and
// chooses the same plan with the same predictions; a corrupt cache file is named as
// unusable and replaced by a new measurement. Ranks that disagree about the cache
// (rank 0 finds it, the others have no cache directory) all measure, none waits alone,
// and without a cache directory the profile is used uncached. On a device backend a
// missing profile is refused (the measurement times the CPU). At 1 and 2 ranks.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "whale/backend/guarded.hpp"
#include "whale/comm/context.hpp"
#include "whale/nn/gelu.hpp"
#include "whale/runtime/make.hpp"
#include "support/scoped_env.hpp"

using namespace whale;

namespace {
namespace fs = std::filesystem;
using mlp = sequential<linear<16, 256>, gelu, linear<256, 256>, gelu, linear<256, 8>, softmax_cross_entropy>;
constexpr plan_space plain{.recompute = false};
using auto_mlp = auto_plan<mlp, plain>;

plan_options no_profile() {
  plan_options o;
  o.plan_batch = 64;
  return o;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

using test::scoped_env;

// A directory name, the same on every rank (rank 0's process id), not yet made.
std::string fresh_dir(const context& ctx) {
  long id = static_cast<long>(::getpid());
  broadcast(ctx.world(), view<long>(&id, {1}), 0);
  return (fs::temp_directory_path() / ("whale-profile-cache-" + std::to_string(id)) / "nested").string();
}

std::vector<fs::path> files_in(const std::string& dir) {
  std::vector<fs::path> r;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) r.push_back(e.path());
  return r;
}

std::string second_line(const fs::path& p) {
  std::ifstream f(p);
  std::string a, b;
  std::getline(f, a);
  std::getline(f, b);
  return b;
}
}  // namespace

TEST_CASE("auto_plan without a profile measures one, caches it, loads it at the next start, and replaces a corrupt one") {
  auto ctx = context::init();
  const std::string dir = fresh_dir(ctx);
  scoped_env cache("WHALE_PROFILE_CACHE", dir.c_str());

  // 1. nothing cached: measured on every rank, a plan chosen, the profile cached
  auto first = make<auto_mlp>(ctx, seed{1}, no_profile());
  if (ctx.rank() == 0) MESSAGE(ctx.size() << " ranks: chose " << first.choice().label << " (its line above: the seconds measured)");
  CHECK(has(first.profile_origin(), "no device profile given: measured a quick one in "));
  CHECK(has(first.profile_origin(), "; cached in " + dir + "/profile-"));
  barrier(ctx.world());
  const auto files = files_in(dir);
  CHECK(files.size() == 1);  // one node: its first rank wrote it
  const std::string path = files.empty() ? std::string() : files.front().string();
  CHECK(has(path, "-" + std::to_string(ctx.size()) + "r-"));
  CHECK(has(first.profile_origin(), path));
  CHECK(has(second_line(path), "# key: host "));
  // the cached file is the profile the first start priced with: the same ranking from it
  std::optional<device_profile> dev;
  CHECK_NOTHROW(dev = device_profile::load(path));
  if (dev) {
    CHECK(dev->gemm.size() == 15);
    CHECK(dev->thin.size() == 2);
    CHECK(dev->attention.size() == 2);
    CHECK(dev->backward.size() == 2);
    CHECK(dev->bandwidth_bps > 0);
    for (int k = 0; k < link_kinds; ++k) {  // collectives over every rank, messages between two; none on one rank
      const int want = ctx.size() == 1 ? 0 : k == static_cast<int>(link_kind::p2p) ? 2 : ctx.size();
      CHECK(dev->links[static_cast<int>(link_level::node)][static_cast<std::size_t>(k)].ranks == want);
    }
    const auto again = rank_auto_plans<mlp, plain>(ctx.mesh().shape(), no_profile(), *dev);
    REQUIRE(again.size() == first.ranking().size());
    for (std::size_t i = 0; i < again.size(); ++i) {
      CHECK(again[i].label == first.ranking()[i].label);
      CHECK(again[i].step_s == first.ranking()[i].step_s);
    }
  }

  // 2. cached: loaded, said so, the same choice and predictions
  auto second = make<auto_mlp>(ctx, seed{1}, no_profile());
  CHECK(has(second.profile_origin(), "no device profile given: using the one measured at an earlier start, " + path));
  CHECK(second.choice().label == first.choice().label);
  CHECK(second.choice().step_s == first.choice().step_s);
  CHECK(second.choice().memory_mib == first.choice().memory_mib);

  // 3. a corrupt file (this job's key line, then garbage): named as unusable, measured
  // anew, and replaced by a profile that loads
  barrier(ctx.world());
  if (ctx.rank() == 0) {
    const std::string key = second_line(path);
    std::ofstream(path) << "# whale: a quick device profile\n" << key << "\ngemm 1 2\n";
  }
  barrier(ctx.world());
  auto third = make<auto_mlp>(ctx, seed{1}, no_profile());
  CHECK(has(third.profile_origin(), "the cached profile " + path + " is not usable (" + path + ":3: 'gemm' takes M N K TA TB GFLOPS)"));
  CHECK(has(third.profile_origin(), "measured a quick one in "));
  barrier(ctx.world());
  CHECK(has(second_line(path), "# key: host "));
  CHECK_NOTHROW(device_profile::load(path));

  // 4. rank 0 finds the cache, the others have no cache directory: every rank measures
  // (none waits alone in a collective), and where there is no directory it is not cached
  {
    const bool none = ctx.rank() > 0 || ctx.size() == 1;
    std::optional<scoped_env> c, x, h;
    if (none) c.emplace("WHALE_PROFILE_CACHE", nullptr), x.emplace("XDG_CACHE_HOME", nullptr), h.emplace("HOME", nullptr);
    auto fourth = make<auto_mlp>(ctx, seed{1}, no_profile());
    INFO(fourth.profile_origin());
    CHECK(has(fourth.profile_origin(), "measured a quick one in "));
    if (none) CHECK(has(fourth.profile_origin(), "not cached: no cache directory (set WHALE_PROFILE_CACHE, XDG_CACHE_HOME or HOME)"));
    else {
      CHECK(has(fourth.profile_origin(), "the cached profile " + path + " is not every rank's"));
      CHECK(has(fourth.profile_origin(), "cached in " + path + ", but not for every rank (another rank has no cache directory"));
    }
  }
  barrier(ctx.world());
  if (ctx.rank() == 0) fs::remove_all(fs::path(dir).parent_path());
}

TEST_CASE("on a device backend, auto_plan without a profile is refused on every rank, naming the backend") {
  auto ctx = context::init();
  guarded_backend g;  // a device's memory rules on the CPU: the measurement would time the wrong device
  auto o = no_profile();
  o.backend = backend_ref(g);
  CHECK_THROWS_WITH_AS(make<auto_mlp>(ctx, seed{1}, o),
                       doctest::Contains("no device profile given, and the plans compute on the guarded backend: measuring "
                                         "at start times the CPU only; give a profile of the device"),
                       std::invalid_argument);
}

TEST_CASE("the cache key names the host, the ranks, this node's ranks, the threads, the backend and the build") {
  const auto key = detail::profile_cache_key("node-a", 4, 2, 1, "cpu");
  CHECK(has(key, "host node-a; ranks 4, 2 on this node; threads 1; backend cpu"));
  CHECK(has(key, detail::build_id()));
  const auto file = detail::profile_cache_file("node-a", 4, key);
  CHECK(file.rfind("profile-node-a-4r-", 0) == 0);
  for (const auto& other : {detail::profile_cache_key("node-b", 4, 2, 1, "cpu"), detail::profile_cache_key("node-a", 2, 2, 1, "cpu"),
                            detail::profile_cache_key("node-a", 4, 4, 1, "cpu"), detail::profile_cache_key("node-a", 4, 2, 2, "cpu"),
                            detail::profile_cache_key("node-a", 4, 2, 1, "cuda")})
    CHECK(detail::profile_cache_file("node-a", 4, other) != file);
  CHECK(detail::profile_cache_file("a b/c", 1, key).rfind("profile-a_b_c-1r-", 0) == 0);  // the host's name made a file name
}
