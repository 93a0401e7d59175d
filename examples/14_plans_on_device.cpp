// 14: a parallel plan in a device's memory. `plan_options::backend` puts each
// rank's parameters, gradients, optimizer state and activations in a device
// backend's memory, for every strategy: here tensor parallelism inside the
// stages of a 1F1B pipeline, replicated over the data axis, with ZeRO-1. The
// collectives over the data and model axes run on the device's buffers
// through the device's own communicator (NCCL on GPUs; here MPI inside the
// guarded window), and pipeline messages through host copies. On GPUs the
// backend is each rank's cuda_backend (in a .cu file compiled by nvcc); here
// it is the guarded backend, the CPU computing in memory that host code may
// not touch, so this runs anywhere and would crash with a message if any host
// code touched device memory. The result equals the same plan on the CPU
// backend to the bit, on every rank: the example checks that.
//
//   ./build/examples/example_14_plans_on_device [--steps S]
//   mpirun -np 4 ./build/examples/example_14_plans_on_device --mesh pipe=2,model=2
//   mpirun -np 8 ./build/examples/example_14_plans_on_device --mesh data=2,pipe=2,model=2
//
// Legend: B sequences of T tokens; S steps.
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

using namespace whale;

// A small GPT split by hand for tensor parallelism: vocabulary 64, 16 positions,
// width 32, 4 heads, FFN 64, 4 blocks; the embedding, each block and the head split over the model axis.
using block = transformer_block<32, 4, 64>;
using tp_gpt = sequential<split<embedding<64, 32>>, position_embedding<16, 32>, repeat<4, split<block>>, layer_norm<32>,
                          split<linear<32, 64>>, softmax_cross_entropy>;
using plan = shard<replicate<pipeline<one_f_one_b, tp_gpt>>, 1>;
constexpr index_t B = 8, T = 16;

struct result {
  std::vector<double> losses;
  std::vector<float> params;  // the whole model, gathered on every rank (host memory)
  long long device_ops = 0;   // collectives on the device's own communicators
};

result train(const context& ctx, backend_ref be, int steps) {
  plan_options o;
  o.backend = be;       // on a device: everything of this rank's plan lives there
  o.micro_batches = 4;  // per data replica
  auto p = make<plan>(ctx, seed{42}, o);
  trainer_options t;
  t.progress = false;
  t.max_grad_norm = 1.0;
  markov_data data(seed{7}, 64, T, B);
  trainer tr(p, adamw{.lr = 3e-3f}, t);
  result r;
  for (int s = 0; s < steps; ++s) r.losses.push_back(tr.step(data, s));
  const auto whole = p.full_params();  // copied through the backend, gathered over the mesh
  r.params.assign(whole.begin(), whole.end());
  r.device_ops = p.device_traffic().operations;  // zero on the CPU: its communicators take host memory
  return r;
}

int main(int argc, char** argv) {
  try {
    auto ctx = context::init(argc, argv);  // takes --mesh
    int steps = 10;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--steps" && i + 1 < argc) steps = static_cast<int>(detail::parse_int(argv[++i], "--steps", 1, 100000));
      else throw std::invalid_argument("unknown argument '" + a + "' (have --steps S, --mesh SPEC)");
    }
    const auto cpu = train(ctx, backend_ref{}, steps);
    guarded_backend device;  // the stand-in for this rank's GPU
    const auto dev = train(ctx, backend_ref(device), steps);
    int same = cpu.losses == dev.losses && cpu.params == dev.params ? 1 : 0;
    all_reduce(ctx.world(), view<int>(&same, {1}), reduce_op::min);  // on every rank
    if (ctx.rank() == 0) {
      std::printf("%s over %d rank(s), %s\n", layer_name<plan>().c_str(), ctx.size(),
                  ctx.mesh().shape().spec().c_str());
      std::printf("step   loss (cpu)   loss (device memory)\n");
      for (int s = 0; s < steps; ++s)
        std::printf("%4d   %.6f     %.6f\n", s, cpu.losses[static_cast<std::size_t>(s)],
                    dev.losses[static_cast<std::size_t>(s)]);
      std::printf("collectives on the device's own communicators (rank 0): %lld\n", dev.device_ops);
      std::printf("%s\n", same ? "the device run equals the CPU run to the bit, on every rank"
                               : "MISMATCH: the device run differs from the CPU run on some rank");
    }
    return same ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "example_14_plans_on_device: %s\n", e.what());
    return 1;
  }
}
