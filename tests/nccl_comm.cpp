// nccl_comm on GPUs: every collective against host-computed values, one rank
// per GPU. Built whenever whale::cuda exists; without enough GPUs it says so and
// exits 77, which ctest reports as skipped; with no GPU at all it first checks
// that nccl_comm refuses with its own message on every rank (exit 1 if not).
// Buffers are filled on a producer stream of the test's own (async copies from
// pinned memory) that the communicator waits for: the ordering is explicit.
// Registered in failure/CMakeLists.txt.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/cuda.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/device_comm.hpp"
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
void cuda_check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(call) + " failed: " + cudaGetErrorString(e));
}
// The stream that writes every buffer (set as the communicators' producer stream).
struct stream_holder {
  cudaStream_t s = nullptr;
  stream_holder() { cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); }
  stream_holder(const stream_holder&) = delete;
  stream_holder& operator=(const stream_holder&) = delete;
  ~stream_holder() { cudaStreamDestroy(s); }
};
// A device buffer with a pinned host twin: put() copies asynchronously on the
// producer stream (the communicator must wait for it), get() copies back and syncs.
template <class T> struct device_buffer {
  T* p = nullptr;
  T* host = nullptr;  // pinned: cudaMemcpyAsync from it is truly asynchronous
  index_t n = 0;
  cudaStream_t s;
  device_buffer(index_t count, cudaStream_t producer) : n(count), s(producer) {
    const auto bytes = static_cast<std::size_t>(count ? count : 1) * sizeof(T);
    cuda_check(cudaMalloc(reinterpret_cast<void**>(&p), bytes), "cudaMalloc");
    cuda_check(cudaMallocHost(reinterpret_cast<void**>(&host), bytes), "cudaMallocHost");
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() {
    cudaStreamSynchronize(s);  // a copy may still read `host`
    cudaFreeHost(host);
    cudaFree(p);
  }
  view<T, whale::cuda> v() const { return view<T, whale::cuda>(p, shape{n}); }
  void put(const std::vector<T>& h) {
    if (static_cast<index_t>(h.size()) > n) throw std::logic_error("device_buffer::put: too many values");
    cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize");  // the previous put may still read `host`
    std::copy(h.begin(), h.end(), host);
    cuda_check(cudaMemcpyAsync(p, host, h.size() * sizeof(T), cudaMemcpyHostToDevice, s), "cudaMemcpyAsync");
  }
  std::vector<T> get() const {
    cuda_check(cudaMemcpyAsync(host, p, static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyDeviceToHost, s),
               "cudaMemcpyAsync");
    cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    return std::vector<T>(host, host + n);
  }
};

// select_device_by_local_rank parses OMPI_COMM_WORLD_LOCAL_RANK strictly and
// names the variable and the value; runs with or without a GPU. Restores the
// variable. (Every launcher's variables: tests/test_parse.cpp.)
void check_local_rank_parsing(int rank) {
  const char* var = "OMPI_COMM_WORLD_LOCAL_RANK";
  const char* was = std::getenv(var);
  const std::string saved = was ? was : "";
  auto message = [&](const char* value) {
    if (value) setenv(var, value, 1);
    else unsetenv(var);
    try {
      nccl_comm::select_device_by_local_rank();
    } catch (const std::invalid_argument& x) {
      return std::string("invalid_argument: ") + x.what();
    } catch (const std::exception& x) {
      return std::string("other: ") + x.what();
    }
    return std::string("(no error)");
  };
  for (const char* bad : {"1x", "-1", "", " 1", "99999999999"}) {
    const auto m = message(bad);
    const bool ok = m.rfind("invalid_argument: ", 0) == 0 &&
                    m.find(std::string("OMPI_COMM_WORLD_LOCAL_RANK '") + bad + "'") != std::string::npos;
    if (!ok) std::fprintf(stderr, "nccl_comm test: rank %d: for %s='%s' got: %s\n", rank, var, bad, m.c_str());
    expect(ok, "select_device_by_local_rank refuses a malformed OMPI_COMM_WORLD_LOCAL_RANK, naming it", rank);
  }
  // unset (no other launcher's variable under mpirun): one process, local rank 0, GPU 0 if there is one
  const auto unset = message(nullptr);
  expect(unset == "(no error)" || unset.find("no CUDA device") != std::string::npos,
         "select_device_by_local_rank takes local rank 0 without a launcher variable", rank);
  if (was) setenv(var, saved.c_str(), 1);
}

void run(mpi_comm& world) {
  const int r = world.rank(), p = world.size();
  const int device = nccl_comm::select_device_by_local_rank();
  int current = -1;
  cudaGetDevice(&current);
  expect(current == device, "select_device_by_local_rank sets the device it returns", r);
  stream_holder producer;  // after the device is selected: a stream belongs to one device
  nccl_comm c(world);
  expect(c.rank() == r && c.size() == p, "rank and size match MPI", r);
  expect(c.producer_stream() == cudaStreamLegacy, "the producer stream defaults to the legacy default stream", r);
  c.set_producer_stream(producer.s);
  const cudaStream_t ps = producer.s;

  device_buffer<float> a(100, ps);
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

  device_buffer<std::int32_t> in(3, ps), out(3 * p, ps);
  in.put({r, r, r});
  all_gather(c, in.v(), out.v());
  auto g = out.get();
  expect(g[static_cast<std::size_t>(3 * (p - 1))] == p - 1, "all_gather", r);

  device_buffer<double> rs(4 * p, ps), mine(4, ps);
  rs.put(std::vector<double>(static_cast<std::size_t>(4 * p), 1.0));
  reduce_scatter(c, rs.v(), mine.v());
  expect(mine.get()[3] == double(p), "reduce_scatter", r);
  rs.put(std::vector<double>(static_cast<std::size_t>(4 * p), 2.0));
  reduce_scatter(c, rs.v(), rs.v().rows(0, 4));
  expect(rs.get()[0] == 2.0 * p, "reduce_scatter in place", r);

  auto counts = block_counts(7, p);
  device_buffer<std::int64_t> gv_in(counts[static_cast<std::size_t>(r)], ps), gv_out(7, ps);
  gv_in.put(std::vector<std::int64_t>(static_cast<std::size_t>(gv_in.n), r));
  all_gather_v(c, gv_in.v(), gv_out.v(), counts);
  expect(gv_out.get()[6] == p - 1 || p > 7, "all_gather_v", r);
  device_buffer<std::int64_t> sv_in(7, ps), sv_out(counts[static_cast<std::size_t>(r)], ps);
  sv_in.put(std::vector<std::int64_t>(7, 1));
  reduce_scatter_v(c, sv_in.v(), sv_out.v(), counts);
  expect(sv_out.n == 0 || sv_out.get()[0] == p, "reduce_scatter_v", r);

  device_buffer<float> b(5, ps);
  b.put(std::vector<float>(5, float(r == 0 ? 42 : -1)));
  broadcast(c, b.v(), 0);
  expect(b.get()[4] == 42.f, "broadcast", r);

  if (p > 1) {
    // A ring exchange: every rank sends and receives at once, so the two must be
    // one NCCL group (alone, each rank's send would wait for a receive never posted).
    const int next = (r + 1) % p, prev = (r + p - 1) % p;
    device_buffer<float> s(8, ps), q(8, ps);
    s.put(std::vector<float>(8, float(r)));
    c.isendrecv(s.p, 8, next, q.p, 8, prev, dtype::f32).wait();
    expect(q.get()[7] == float(prev), "sendrecv ring", r);

    // The same through a group guard, the receive first; its requests are
    // recorded when the group ends, and waiting before that is refused.
    s.put(std::vector<float>(8, float(10 + r)));
    {
      auto g = c.group();
      auto rq = irecv(c, q.v(), prev);
      auto sq = isend(c, s.v(), next);
      bool refused = false;
      try {
        rq.test();
      } catch (const std::logic_error&) {
        refused = true;
      }
      expect(refused, "waiting for a request inside an open group is refused", r);
      g.end();
      sq.wait();
      rq.wait();
    }
    expect(q.get()[7] == float(10 + prev), "send/recv ring in a group", r);
  }
  barrier(c);
  auto half = c.split(r % 2, r);
  expect(half.producer_stream() == ps, "split keeps the producer stream", r);
  device_buffer<std::int32_t> x(1, ps);
  x.put({1});
  all_reduce(half, x.v());
  expect(x.get()[0] == (p + 1 - r % 2) / 2, "split", r);
}

// make_device_comm on a GPU backend: NCCL, its producer stream the backend's
// compute stream (buffers written there), through the type-erased device_comm
// the plans use: a blocking all-reduce, a non-blocking reduce-scatter, counted.
void run_device_comm(mpi_comm& world) {
  const int r = world.rank(), p = world.size();
  cuda_backend gpu;
  const backend_ref be(gpu);
  auto dc = make_device_comm(world, be);
  expect(dc && dc->valid() && dc->size() == p && dc->rank() == r, "make_device_comm gives a communicator of the world", r);
  const auto stream = static_cast<cudaStream_t>(be.compute_stream());
  device_buffer<float> b(6, stream);
  b.put(std::vector<float>(6, float(r + 1)));
  all_reduce(*dc, view<float>(b.p, {6}));
  expect(b.get()[5] == float(p * (p + 1) / 2), "device_comm all_reduce", r);
  device_buffer<float> in(2 * p, stream), out(2, stream);
  std::vector<float> v(static_cast<std::size_t>(2 * p));
  std::iota(v.begin(), v.end(), 0.f);
  in.put(v);
  dc->ireduce_scatter(in.p, out.p, 2, dtype::f32, reduce_op::sum).wait();
  expect(out.get()[1] == float(p * (2 * r + 1)), "device_comm ireduce_scatter", r);
  expect(dc->stats().operations == 2, "device_comm counts its operations", r);
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
  check_local_rank_parsing(rank);
  if (!all) {
    if (e != cudaSuccess || devices == 0) {  // no device anywhere: nccl_comm must say so itself, on every rank
      if (std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")) {
        std::string said;
        try {
          nccl_comm::select_device_by_local_rank();
        } catch (const std::runtime_error& x) {
          said = x.what();
        }
        expect(said.find("select_device_by_local_rank: no CUDA device") != std::string::npos,
               "select_device_by_local_rank says there is no CUDA device", rank);
      }
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
      if (!named) std::fprintf(stderr, "nccl_comm test: rank %d: FAILED: no clear no-device error\n", rank);
      if (!named) {
        MPI_Finalize();
        return 1;
      }
    }
    if (failures) {  // the checks above that need no GPU
      MPI_Finalize();
      return 1;
    }
    if (rank == 0)
      std::printf("nccl_comm: skipped: %s\n",
                  e != cudaSuccess ? (std::string("no CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(e) + ")").c_str()
                                   : (std::to_string(devices) + " CUDA device(s) for " + std::to_string(size) +
                                      " ranks; NCCL needs one GPU per rank").c_str());
    MPI_Finalize();
    return 77;
  }
  {  // run() selects the device by local rank (select_device_by_local_rank)
    auto world = mpi_comm::world();
    try {
      run(world);
      run_device_comm(world);
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
