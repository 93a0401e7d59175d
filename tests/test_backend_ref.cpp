// backend_ref: the CPU by default, and a GPU backend's GEMMs, copies and
// fills routed to it. A recording device (a Backend whose space is `cuda`,
// computing on the host) stands in for cuda_backend, which needs a GPU; kernel
// bodies on it need nvcc, and from this file their launch is the error that
// says so. The layers' CPU path through backend_ref is what every other test
// runs.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/nn/layer.hpp"
#include "whale/nn/linear.hpp"
#include "whale/optim/sgd.hpp"

using namespace whale;

namespace {
struct recording_device {
  using space = cuda;
  struct event_type {};
  std::vector<std::string>* log;
  static constexpr const char* name() noexcept { return "recording"; }
  void* compute_stream() const noexcept { return nullptr; }
  void gemm(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A, index_t lda,
            const float* B, index_t ldb, float beta, float* C, index_t ldc) {
    log->push_back("gemm " + std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K));
    cpu::gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void gemm_strided_batched(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A,
                            index_t lda, index_t sA, const float* B, index_t ldb, index_t sB, float beta, float* C,
                            index_t ldc, index_t sC, index_t count) {
    log->push_back("batched " + std::to_string(count));
    cpu::gemm_strided_batched(ta, tb, M, N, K, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC, count);
  }
  template <kernels::KernelBody K> void launch(index_t n, const K& body) { cpu::launch(n, body); }
  void* allocate(std::size_t bytes) { return ::operator new(bytes); }
  void deallocate(void* p, std::size_t) { ::operator delete(p); }
  void copy(void* dst, const void* src, std::size_t bytes) {
    log->push_back("copy " + std::to_string(bytes));
    std::memcpy(dst, src, bytes);
  }
  void fill_zero(void* p, std::size_t bytes) {
    log->push_back("fill " + std::to_string(bytes));
    std::memset(p, 0, bytes);
  }
  void record(event_type&) {}
  void wait(event_type&) {}
  void synchronize() { log->push_back("sync"); }
  // its memory is the host's: tensors placed on it stay host tensors
  const memory_place* memory() const noexcept { return nullptr; }
};
static_assert(Backend<recording_device>);

// An update rule written before backends: no backend overload.
struct host_only_rule {
  struct state {};
  state make_state(index_t) const { return {}; }
  void update(state&, view<float> p, cview<float> g) const {
    for (index_t i = 0; i < p.numel(); ++i) p[i] -= g[i];
  }
};
}  // namespace

TEST_CASE("backend_ref: the CPU by default, in every step context and weight task") {
  const backend_ref be;
  CHECK(be.on_cpu());
  CHECK(std::string(be.name()) == "cpu");
  step_ctx c;
  CHECK(c.be.on_cpu());
  weight_task t;
  CHECK(t.be.on_cpu());
  // a GEMM through it is OpenBLAS's: the CPU's GEMM log sees it
  std::vector<cpu::gemm_call> calls;
  cpu::set_gemm_log(&calls);
  const float a[4] = {1, 2, 3, 4}, b[4] = {1, 0, 0, 1};
  float out[4] = {};
  be.gemm(trans::no, trans::no, 2, 2, 2, 1.f, a, b, 0.f, out);
  cpu::set_gemm_log(nullptr);
  CHECK(calls.size() == 1);
  CHECK(out[3] == 4.f);
}

TEST_CASE("backend_ref on a device: GEMMs, copies, fills and waits go to it; bodies need nvcc") {
  std::vector<std::string> log;
  recording_device dev{&log};
  const backend_ref be(dev);
  CHECK_FALSE(be.on_cpu());
  CHECK(std::string(be.name()) == "recording");  // the backend's own name

  // a linear layer's weight-gradient GEMM (dW = dy^T x) through it goes to the device
  cpu::set_gemm_log(nullptr);
  const index_t R = 3, in = 4, out = 2;
  std::vector<float> dy(R * out, 1.f), x(R * in, 2.f), dw(out * in, 0.f), db(out, 0.f);
  be.gemm(trans::yes, trans::no, out, in, R, 1.f, dy.data(), x.data(), 0.f, dw.data());
  CHECK(dw[0] == 6.f);
  // two 1x1 products: buf[4] = 2*2, buf[5] = 3*3; then buf[0..1] = buf[4..5]; buf[6..7] = 0
  float buf[8] = {2, 3, 0, 0, 0, 0, 7, 8};
  be.gemm_strided_batched(trans::no, trans::no, 1, 1, 1, 1.f, buf, 1, 1, buf, 1, 1, 0.f, buf + 4, 1, 1, 2);
  be.copy(buf, buf + 4, 2 * sizeof(float));
  be.fill_zero(buf + 6, 2 * sizeof(float));
  be.synchronize();
  CHECK(log == std::vector<std::string>{"gemm 2x4x3", "batched 2", "copy 8", "fill 8", "sync"});
  CHECK(buf[0] == 4.f);
  CHECK(buf[1] == 9.f);
  CHECK(buf[6] == 0.f);
  CHECK(buf[7] == 0.f);

  // a body on a device from a file g++ compiled: the error names nvcc, and nothing runs
  float y[2] = {1, 1};
  try {
    be.launch(2, kernels::scale{y, 3.f});
    FAIL("launch on a device from a non-nvcc translation unit must throw");
  } catch (const std::logic_error& e) {
    CHECK(std::string(e.what()).find("not compiled by nvcc") != std::string::npos);
  }
  CHECK(y[0] == 1.f);

  // a layer on it gets as far as its first body, then says why it cannot go on
  linear<4, 2> l;
  std::vector<float> params(linear<4, 2>::param_count()), grads(params.size());
  param_binder pb(params.data(), grads.data(), static_cast<index_t>(params.size()));
  l.bind(pb);
  step_ctx c;
  c.be = be;
  c.batch = R;
  CHECK_THROWS_WITH_AS(l.forward(c, cview<float>(x.data(), {R, in})), doctest::Contains("not compiled by nvcc"),
                       std::logic_error);
}

TEST_CASE("update_on: a rule without a backend overload runs on the CPU only, and says so elsewhere") {
  std::vector<float> p{1.f, 2.f}, g{0.5f, 0.5f};
  host_only_rule rule;
  auto s = rule.make_state(2);
  update_on(backend_ref{}, rule, s, view<float>(p.data(), {2}), cview<float>(g.data(), {2}));
  CHECK(p[0] == 0.5f);

  std::vector<std::string> log;
  recording_device dev{&log};
  try {
    update_on(backend_ref(dev), rule, s, view<float>(p.data(), {2}), cview<float>(g.data(), {2}));
    FAIL("a host-only rule on a device must throw");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("runs on the CPU only") != std::string::npos);
    CHECK(std::string(e.what()).find("on recording") != std::string::npos);
  }
  CHECK(p[0] == 0.5f);  // untouched

  // sgd takes the backend: on the CPU, its body runs there
  sgd opt{.lr = 0.1f};
  auto st = opt.make_state(2);
  update_on(backend_ref{}, opt, st, view<float>(p.data(), {2}), cview<float>(g.data(), {2}));
  CHECK(p[0] == doctest::Approx(0.45f));
}
