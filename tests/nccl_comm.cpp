// nccl_comm on GPUs: every collective against host-computed values, one rank
// per GPU. Built whenever whale::cuda exists; without enough GPUs it says so and
// exits 77, which ctest reports as skipped; with no GPU at all it first checks
// that nccl_comm refuses with its own message on every rank (exit 1 if not).
// Registered in failure/CMakeLists.txt.
#include <cuda_runtime.h>

#include <cstdio>
#include <numeric>
#include <vector>

#include "whale/comm/collectives.hpp"
#include "whale/comm/mpi_comm.hpp"
#include "whale/comm/nccl_comm.hpp"

using namespace whale;

namespace {
int failures = 0;
void expect(bool ok, const char* what, int rank) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "nccl_comm test: rank %d: FAILED: %s\n", rank, what);
  }
}
template <class T> struct device_buffer {
  T* p = nullptr;
  index_t n = 0;
  explicit device_buffer(index_t count) : n(count) {
    if (cudaMalloc(reinterpret_cast<void**>(&p), static_cast<std::size_t>(count ? count : 1) * sizeof(T)) != cudaSuccess)
      throw std::runtime_error("cudaMalloc failed");
  }
  ~device_buffer() { cudaFree(p); }
  view<T, whale::cuda> v() const { return view<T, whale::cuda>(p, shape{n}); }
  void put(const std::vector<T>& h) { cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice); }
  std::vector<T> get() const {
    std::vector<T> h(static_cast<std::size_t>(n));
    cudaMemcpy(h.data(), p, h.size() * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
};

void run(mpi_comm& world) {
  const int r = world.rank(), p = world.size();
  nccl_comm c(world);
  expect(c.rank() == r && c.size() == p, "rank and size match MPI", r);

  device_buffer<float> a(100);
  std::vector<float> h(100);
  for (int i = 0; i < 100; ++i) h[static_cast<std::size_t>(i)] = float((r + 1) * (i + 1));
  a.put(h);
  all_reduce(c, a.v());
  auto got = a.get();
  expect(got[9] == float(10 * p * (p + 1) / 2), "all_reduce sum", r);
  a.put(h);
  iall_reduce(c, a.v(), reduce_op::max).wait();
  expect(a.get()[9] == float(10 * p), "iall_reduce max", r);
  a.put(h);
  all_reduce(c, a.v(), reduce_op::avg);
  expect(a.get()[0] == float(p + 1) / 2, "all_reduce avg", r);

  device_buffer<std::int32_t> in(3), out(3 * p);
  in.put({r, r, r});
  all_gather(c, in.v(), out.v());
  auto g = out.get();
  expect(g[static_cast<std::size_t>(3 * (p - 1))] == p - 1, "all_gather", r);

  device_buffer<double> rs(4 * p), mine(4);
  rs.put(std::vector<double>(static_cast<std::size_t>(4 * p), 1.0));
  reduce_scatter(c, rs.v(), mine.v());
  expect(mine.get()[3] == double(p), "reduce_scatter", r);
  rs.put(std::vector<double>(static_cast<std::size_t>(4 * p), 2.0));
  reduce_scatter(c, rs.v(), rs.v().rows(0, 4));
  expect(rs.get()[0] == 2.0 * p, "reduce_scatter in place", r);

  auto counts = block_counts(7, p);
  device_buffer<std::int64_t> gv_in(counts[static_cast<std::size_t>(r)]), gv_out(7);
  gv_in.put(std::vector<std::int64_t>(static_cast<std::size_t>(gv_in.n), r));
  all_gather_v(c, gv_in.v(), gv_out.v(), counts);
  expect(gv_out.get()[6] == p - 1 || p > 7, "all_gather_v", r);
  device_buffer<std::int64_t> sv_in(7), sv_out(counts[static_cast<std::size_t>(r)]);
  sv_in.put(std::vector<std::int64_t>(7, 1));
  reduce_scatter_v(c, sv_in.v(), sv_out.v(), counts);
  expect(sv_out.n == 0 || sv_out.get()[0] == p, "reduce_scatter_v", r);

  device_buffer<float> b(5);
  b.put(std::vector<float>(5, float(r == 0 ? 42 : -1)));
  broadcast(c, b.v(), 0);
  expect(b.get()[4] == 42.f, "broadcast", r);

  if (p > 1) {
    device_buffer<float> s(8), q(8);
    s.put(std::vector<float>(8, float(r)));
    auto rq = irecv(c, q.v(), (r + p - 1) % p);
    auto sq = isend(c, s.v(), (r + 1) % p);
    sq.wait();
    rq.wait();
    expect(q.get()[7] == float((r + p - 1) % p), "send/recv ring", r);
  }
  barrier(c);
  auto half = c.split(r % 2, r);
  device_buffer<std::int32_t> x(1);
  x.put({1});
  all_reduce(half, x.v());
  expect(x.get()[0] == (p + 1 - r % 2) / 2, "split", r);
}
}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  int ok = e == cudaSuccess && devices >= size ? 1 : 0, all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all) {
    if (e != cudaSuccess || devices == 0) {  // no device anywhere: nccl_comm must say so itself, on every rank
      std::string msg;
      {
        auto world = mpi_comm::world();
        try {
          nccl_comm n(world);
        } catch (const std::exception& x) {
          msg = x.what();
        }
      }
      const bool named = msg.find("no CUDA device was found on rank(s) 0") != std::string::npos;
      std::printf("nccl_comm: rank %d: without a device, nccl_comm said: %s\n", rank, msg.empty() ? "(nothing)" : msg.c_str());
      if (!named) {
        std::fprintf(stderr, "nccl_comm test: rank %d: FAILED: no clear no-device error\n", rank);
        MPI_Finalize();
        return 1;
      }
    }
    if (rank == 0)
      std::printf("nccl_comm: skipped: %s\n",
                  e != cudaSuccess ? (std::string("no CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(e) + ")").c_str()
                                   : (std::to_string(devices) + " CUDA device(s) for " + std::to_string(size) +
                                      " ranks; NCCL needs one GPU per rank").c_str());
    MPI_Finalize();
    return 77;
  }
  cudaSetDevice(rank % devices);
  {
    auto world = mpi_comm::world();
    try {
      run(world);
    } catch (const std::exception& x) {
      std::fprintf(stderr, "nccl_comm test: rank %d: %s\n", rank, x.what());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  int worst = 0;
  MPI_Allreduce(&failures, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0) std::printf("nccl_comm: %s\n", worst ? "FAILED" : "all checks passed");
  MPI_Finalize();
  return worst ? 1 : 0;
}
