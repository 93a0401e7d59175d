// 14: a parallel plan in a device's memory. `plan_options::backend` puts each
// rank's parameters, gradients, optimizer state and activations in a device
// backend's memory, for every strategy: here tensor parallelism inside the
// stages of a 1F1B pipeline, replicated over the data axis, with ZeRO-1. The
// collectives over the data and model axes and the pipeline's messages run
// on the device's buffers through the device's own communicators (NCCL on
// GPUs; here MPI inside the guarded window). On GPUs the
// backend is each rank's cuda_backend (in a .cu file compiled by nvcc); here
// it is the guarded backend, the CPU computing in memory that host code may
// not touch, so this runs anywhere and would crash with a message if any host
// code touched device memory. The result equals the same plan on the CPU
// backend to the bit, on every rank: the example checks that. The trainer
// works on a device as on the CPU: `--precision bf16` makes the plan in bf16
// mixed precision (plan_options::precision), which the trainer trains in
// (rounded on the device), and `--save DIR` saves a checkpoint of
// the device run, which a fresh plan on the CPU then loads (checked: the
// same parameters).
//
//   ./build/examples/example_14_plans_on_device [--steps S] [--precision fp32|bf16] [--save DIR]
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

struct settings {
  int steps = 10;
  precision prec = precision::fp32;
  std::string save;  // a checkpoint directory for the device run (empty: none)
};
struct result {
  std::vector<double> losses;
  std::vector<float> params;  // the whole model, gathered on every rank (host memory)
  long long device_ops = 0;   // collectives on the device's own communicators
  std::string saved;          // the checkpoint's step directory, if one was saved
};

trainer_options options() {
  trainer_options t;
  t.progress = false;
  t.max_grad_norm = 1.0;
  return t;
}
plan_options on(backend_ref be, const settings& f) {
  plan_options o;
  o.backend = be;       // on a device: everything of this rank's plan lives there
  o.precision = f.prec;  // the plan's precision: checked, counted in its memory, trained in
  o.micro_batches = 4;  // per data replica
  return o;
}

result train(const context& ctx, backend_ref be, const settings& f, bool save) {
  auto p = make<plan>(ctx, seed{42}, on(be, f));
  trainer_options t = options();
  if (save) t.checkpoint_dir = f.save;  // checked (made, writable) here, before any step
  markov_data data(seed{7}, 64, T, B);
  trainer tr(p, adamw{.lr = 3e-3f}, t);
  result r;
  for (int s = 0; s < f.steps; ++s) r.losses.push_back(tr.step(data, s));
  if (save) r.saved = tr.save();  // from host copies of each rank's parameters and AdamW state
  const auto whole = p.full_params();  // copied through the backend, gathered over the mesh
  r.params.assign(whole.begin(), whole.end());
  r.device_ops = p.device_traffic().operations;  // zero on the CPU: its communicators take host memory
  return r;
}

// A fresh plan on the CPU loads the device run's checkpoint: its whole model, gathered.
std::vector<float> loaded_on_cpu(const context& ctx, const settings& f, const std::string& dir) {
  auto p = make<plan>(ctx, seed{1}, on(backend_ref{}, f));
  trainer tr(p, adamw{.lr = 3e-3f}, options());
  tr.load(dir);
  const auto whole = p.full_params();
  return {whole.begin(), whole.end()};
}

int main(int argc, char** argv) {
  try {
    auto ctx = context::init(argc, argv);  // takes --mesh
    settings f;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--steps" && i + 1 < argc) {
        f.steps = static_cast<int>(detail::parse_int(argv[++i], "--steps", 1, 100000));
      } else if (a == "--precision" && i + 1 < argc) {
        f.prec = parse_precision(argv[++i], "--precision");
      } else if (a == "--save" && i + 1 < argc) {
        f.save = argv[++i];
        if (f.save.empty()) throw std::invalid_argument("--save needs a directory (got an empty one)");
      } else {
        throw std::invalid_argument("unknown argument '" + a + "' (have --steps S, --precision fp32|bf16, --save DIR, --mesh SPEC)");
      }
    }
    result dev;  // first, so that --save is checked before any work
    {
      guarded_backend device;  // the stand-in for this rank's GPU
      dev = train(ctx, backend_ref(device), f, !f.save.empty());
    }
    const auto cpu = train(ctx, backend_ref{}, f, false);
    int same = cpu.losses == dev.losses && cpu.params == dev.params ? 1 : 0;
    int loads = 1;
    if (!dev.saved.empty()) loads = loaded_on_cpu(ctx, f, dev.saved) == dev.params ? 1 : 0;
    all_reduce(ctx.world(), view<int>(&same, {1}), reduce_op::min);  // on every rank
    all_reduce(ctx.world(), view<int>(&loads, {1}), reduce_op::min);
    if (ctx.rank() == 0) {
      std::printf("%s over %d rank(s), %s, %s\n", layer_name<plan>().c_str(), ctx.size(),
                  ctx.mesh().shape().spec().c_str(), f.prec == precision::bf16 ? "bf16 mixed precision" : "fp32");
      std::printf("step   loss (cpu)   loss (device memory)\n");
      for (int s = 0; s < f.steps; ++s)
        std::printf("%4d   %.6f     %.6f\n", s, cpu.losses[static_cast<std::size_t>(s)],
                    dev.losses[static_cast<std::size_t>(s)]);
      std::printf("collectives on the device's own communicators (rank 0): %lld\n", dev.device_ops);
      std::printf("%s\n", same ? "the device run equals the CPU run to the bit, on every rank"
                               : "MISMATCH: the device run differs from the CPU run on some rank");
      if (!dev.saved.empty())
        std::printf("%s\n", loads ? ("the device run's checkpoint " + dev.saved + " loads on the CPU: the same parameters").c_str()
                                   : ("MISMATCH: the device run's checkpoint " + dev.saved + " loads on the CPU with other parameters").c_str());
    }
    return same && loads ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "example_14_plans_on_device: %s\n", e.what());
    return 1;
  }
}
