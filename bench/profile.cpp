// whale_profile (scripts/profile; installed with whale's package): measures this
// machine for the planner's cost model and writes a device profile
// (plan/device.hpp, docs/planning.md). The measurement is the library's
// (whale::measure_profile, plan/measure.hpp), the full one: every rank measures
// at once, as they run in training (ranks share cores and memory bandwidth):
// GEMM rates at shapes from 64 to 2048 with the transposes backward uses, thin
// products against square ones (16 to 512 rows through a 1024 x 4096 layer, 16 to
// 256 through a 1024 x 32768 one, 16 and 64 through a 2048 x 100,000 one),
// attention's per-head products as the layer runs them, a linear layer's backward
// rate against its forward by how wide it is, elementwise bandwidth, and — when
// launched on 2 or more ranks — latency and bandwidth of all-reduce, all-gather,
// reduce-scatter and messages, fitted by least squares over sizes from 4 KiB to 32
// MiB (the measured points kept beside the fit), and the cores the ranks shared.
// The slowest rank's figures are written (by rank 0, atomically).
//
//   mpirun -np 4 ./whale_profile --out bench/profiles/this-machine-4.txt [--name NAME] [--runs N]
#include <whale/whale.hpp>
#include <whale/detail/io.hpp>
#include <whale/plan/measure.hpp>

#include <iostream>
#include <stdexcept>
#include <string>

using namespace whale;

int main(int argc, char** argv) {
  auto ctx = context::init(argc, argv);
  return ctx.guard([&] {
    std::string out;
    measure_options mo;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument("whale_profile: " + a + " needs a value");
        return argv[++i];
      };
      if (a == "--out") out = value();
      else if (a == "--name") mo.name = value();
      else if (a == "--thin") throw std::invalid_argument("whale_profile: --thin is gone: thin products are always measured (since 2026-12-04)");
      else if (a == "--runs") mo.runs = static_cast<int>(detail::parse_int(value(), "whale_profile: --runs", 1, 9));
      else throw std::invalid_argument("whale_profile: unknown argument " + a + " (have --out FILE, --name NAME, --runs N)");
    }
    if (out.empty()) throw std::invalid_argument("whale_profile: --out FILE is required");
    check_output_path(ctx.world(), out, "whale_profile: the profile (--out)");
    const std::string text = profile_text(measure_profile(ctx.world(), mo));  // the same on every rank
    if (ctx.rank() == 0) {
      detail::write_file_atomically(out, text, "whale_profile");
      std::cout << text;
    }
    return 0;
  });
}
