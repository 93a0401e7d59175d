// 11: kernel bodies and the Backend concept. A kernel is written once as a
// function object over an index space (here SiLU, x * sigmoid(x), forward and
// backward); `silu_layer_step` is written once against any Backend, and runs
// on the CPU backend here, by a loop with the widest vectors this processor
// has. In a .cu file compiled by nvcc the same code takes a cuda_backend and
// runs the same body on a CUDA grid (backend/cuda.hpp; tests/cuda_backend.cu
// compares the two). A row body (here RMS normalisation) is written against a
// team of lanes instead of an index: the team's sum is the reduction a GPU
// warp does by shuffles, which the CPU replays in the same order. No MPI.
//
//   ./build/examples/example_11_kernels [--n N]
//
// Legend: N elements; R rows of D features.
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

using namespace whale;

// 1. The bodies: plain arithmetic on pointers, WHALE_HD so that nvcc also compiles them for the GPU.
//    kernels::vexp is the library's exp, the same arithmetic on both sides.
struct silu_forward {
  const float* x;  // (N)
  float* y;        // (N)
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    const float s = 1.f / (1.f + kernels::vexp(-x[i]));
    y[i] = x[i] * s;
  }
};
struct silu_backward {
  const float* x;   // (N)
  const float* dy;  // (N)
  float* dx;        // (N)
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    const float s = 1.f / (1.f + kernels::vexp(-x[i]));
    dx[i] = dy[i] * s * (1.f + x[i] * (1.f - s));
  }
};

// A row body: body(team, r) for each row r. `t.sum` reduces across the team's
// lanes (a warp, or a block of 8 warps for rows of 4,096 and more, picked from
// width()); `t.for_each` writes the row, each element by the lane that read it.
struct rms_norm_forward {
  const float* x;  // (R, D)
  float* y;        // (R, D)
  index_t D;
  index_t width() const noexcept { return D; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t r) const noexcept {
    const float* xr = x + r * D;
    float* yr = y + r * D;
    const float ms = t.sum(D, [&](index_t j) { return xr[j] * xr[j]; }) / static_cast<float>(D);
    const float s = 1.f / std::sqrt(ms + 1e-6f);
    t.for_each(D, [&](index_t j) { yr[j] = xr[j] * s; });
  }
};

// 2. Code written once against the concept: buffers from the backend, bodies launched on its queue.
template <Backend B> void silu_layer_step(B& be, const float* x, const float* dy, float* y, float* dx, index_t n) {
  be.launch(n, silu_forward{x, y});
  be.launch(n, silu_backward{x, dy, dx});
  typename B::event_type done;
  be.record(done);  // on a GPU: the point later work (or a communication stream) waits for
  be.synchronize();
}

int main(int argc, char** argv) {
  try {
    index_t n = 1 << 22;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--n" && i + 1 < argc) n = detail::parse_int(argv[++i], "--n", 1, index_t{1} << 30);
      else throw std::invalid_argument("example_11: unknown argument " + a + " (have --n N)");
    }
    cpu_backend be;
    std::printf("backend %s, CPU kernels compiled for %s\n", cpu_backend::name(), cpu::isa_name(cpu::active_isa()));

    // 3. Buffers in the backend's space (here 64-byte aligned host memory; 2 MiB and huge pages when big).
    const auto bytes = static_cast<std::size_t>(n) * sizeof(float);
    auto* x = static_cast<float*>(be.allocate(bytes));
    auto* dy = static_cast<float*>(be.allocate(bytes));
    auto* y = static_cast<float*>(be.allocate(bytes));
    auto* dx = static_cast<float*>(be.allocate(bytes));
    for (index_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 2001) / 250.f - 4.f, dy[i] = 1.f;

    const auto t0 = std::chrono::steady_clock::now();
    silu_layer_step(be, x, dy, y, dx, n);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    // 4. Check against the formula in double, and against a central difference of it.
    double worst_y = 0, worst_d = 0;
    for (index_t i = 0; i < n; i += 7) {
      const double v = x[i], sig = 1 / (1 + std::exp(-v));
      const auto f = [](double t) { return t / (1 + std::exp(-t)); };
      worst_y = std::fmax(worst_y, std::fabs(y[i] - v * sig));
      worst_d = std::fmax(worst_d, std::fabs(dx[i] - (f(v + 1e-4) - f(v - 1e-4)) / 2e-4));
    }
    std::printf("%lld elements forward and backward in %.2f ms; max error %.1e (forward), %.1e (backward)\n",
                static_cast<long long>(n), s * 1e3, worst_y, worst_d);

    // 5. The row body over the same buffer seen as rows of 1,000 (one warp per row), checked in double.
    const index_t D = 1000, R = n / D;
    be.launch(R, rms_norm_forward{x, y, D});
    double worst_r = 0;
    for (index_t r = 0; r < R; ++r) {
      double ms = 0;
      for (index_t j = 0; j < D; ++j) ms += static_cast<double>(x[r * D + j]) * x[r * D + j] / D;
      for (index_t j = 0; j < D; j += 13) worst_r = std::fmax(worst_r, std::fabs(y[r * D + j] - x[r * D + j] / std::sqrt(ms + 1e-6)));
    }
    std::printf("RMS norm of %lld rows of %lld, one team per row: max error %.1e\n", static_cast<long long>(R),
                static_cast<long long>(D), worst_r);
    worst_y = std::fmax(worst_y, worst_r);
    for (auto* p : {x, dy, y, dx}) be.deallocate(p, bytes);
    if (worst_y > 1e-5 || worst_d > 1e-4) {
      std::fprintf(stderr, "example_11: the kernel's result is wrong\n");
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "example_11: %s\n", e.what());
    return 2;
  }
}
