// 10: heterogeneous devices (HetPipe). The `deep-mlp` reference workload on
// virtual workers: the data axis holds the workers, each a 1F1B pipeline over
// the pipe axis (pipe=1: one rank a worker). Ranks are made slower by
// --speeds (emulation: a rank of factor f sleeps (f - 1) times each layer's
// compute). Two ways to train on unequal ranks:
//   --mode sync  synchronous data parallelism, each worker's share of the batch
//                in proportion to its speed (--balance), equal to one process;
//   --mode wsp   Wave Synchronous Parallel: no all-reduce; each worker pushes its
//                update every --wave minibatches and runs at most --staleness D
//                waves ahead of the slowest (D = 0 with SGD: exactly synchronous;
//                this example uses Adam, which deep-mlp needs to learn quickly);
//                --in-flight puts a wave's minibatches in the worker's pipeline
//                together (HetPipe's pipelined minibatches, no flush between
//                them), all on the weights the wave began with.
//
// --worker-cuts cuts each worker's pipeline for its own ranks' speeds (HetPipe
// partitions every virtual worker for its devices).
// --guarded puts every rank's part in a device's memory: the guarded backend,
// which runs the GPU's code path on the CPU (a program compiled by nvcc would
// give each rank its cuda_backend the same way). Inside a wave nothing is read
// back; at each wave's end one copy brings the update to the host holders.
// --policy np|ed|hd groups the launched ranks into workers (HetPipe's policies):
// np keeps the launch order, ed puts one rank of each speed in every worker,
// hd balances the workers' total speed; --speeds are given in launch order.
//
//   mpirun -np 4 ./build/examples/example_10_hetpipe --mesh data=2,pipe=2 --speeds 1,1,2,4 --policy ed --mode wsp --staleness 2 [--steps N]
//
// Legend of shape comments: B the global batch (128), B_w the rows of worker w.
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>

#include <chrono>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

using namespace whale;

int main(int argc, char** argv) {
  // 1. Start: MPI and the mesh (--mesh data=D,pipe=P; default: every rank a worker).
  auto ctx = context::init(argc, argv);
  return ctx.guard([&] {
    plan_options o = plan_options::from_args(argc, argv);  // --speeds, --balance, --micro-batches, ...
    std::string mode = "wsp", policy = "np";
    bool guarded = false;
    wsp_options w;
    long n = 200;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument("example_10: " + a + " needs a value");
        return argv[++i];
      };
      if (a == "--mode") mode = value();
      else if (a == "--policy") policy = value();
      else if (a == "--staleness") w.staleness = static_cast<int>(detail::parse_int(value(), "--staleness", 0, 1000000));
      else if (a == "--wave") w.wave = static_cast<int>(detail::parse_int(value(), "--wave", 1, 1000000));
      else if (a == "--in-flight") w.in_flight = true;
      else if (a == "--guarded") guarded = true;
      else if (a == "--steps") n = static_cast<long>(detail::parse_int(value(), "--steps", 1, 10000000));
      else throw std::invalid_argument("example_10: unknown argument " + a +
                                       " (have --mode sync|wsp, --policy np|ed|hd, --staleness D, --wave N, --in-flight, --worker-cuts, --guarded, --steps N, --speeds, --balance, "
                                       "--micro-batches M, --mesh, --threads)");
    }
    if (mode != "sync" && mode != "wsp") throw std::invalid_argument("example_10: --mode must be sync or wsp (got '" + mode + "')");

    if (policy != "np" && policy != "ed" && policy != "hd")
      throw std::invalid_argument("example_10: --policy must be np, ed or hd (got '" + policy + "')");

    // 2. Group the ranks into workers: rank i of `run` is the launched rank order[i].
    std::vector<int> order(static_cast<std::size_t>(ctx.size()));
    for (int i = 0; i < ctx.size(); ++i) order[static_cast<std::size_t>(i)] = i;
    if (!o.speeds.empty() && policy != "np") {
      o.speed_of(0, ctx.size());  // one factor per rank, or a clear error
      order = detail::worker_order(o.speeds, ctx.mesh().shape().size(axis::data),
                                   policy == "ed" ? detail::worker_policy::ed : detail::worker_policy::hd);
      const auto launched = o.speeds;
      for (std::size_t i = 0; i < order.size(); ++i) o.speeds[i] = launched[static_cast<std::size_t>(order[i])];
    }
    auto run = ctx.with_rank_order(order);

    // 3. The plan: every worker a pipeline of deep-mlp's 8 blocks, workers replicated.
    //    (B_w, 512) -> 8 x [linear 512->512, GELU] -> (B_w, 16) logits -> loss
    using model = replicate<pipeline<one_f_one_b, models::deep_mlp>>;
    if (w.in_flight) o.in_flight = w.wave;  // the plan's memory checks count the minibatches in flight
    std::optional<guarded_backend> device;  // this rank's stand-in GPU (declared before the plan: it outlives it)
    if (guarded) o.backend = backend_ref(device.emplace());
    auto net = make<model>(run, seed{42}, o);
    auto data = models::deep_mlp_data(seed{7});  // 128 samples per global batch
    const auto opt = adamw{.lr = 1e-3f, .weight_decay = 0.f};
    const auto [begin, rows] = net.local_batch(data.global_batch());
    std::printf("rank %d: worker %d, rows [%lld, %lld) of each batch, emulated slowness %.2f\n", run.rank(),
                run.mesh().coord(axis::data), static_cast<long long>(begin), static_cast<long long>(begin + rows),
                o.speed_of(run.rank(), run.size()));

    // 4. Train n steps.
    const auto t0 = std::chrono::steady_clock::now();
    double loss = 0;
    if (mode == "sync") {
      trainer_options to;
      to.progress = run.rank() == 0;
      to.total_steps = n;
      trainer t(net, opt, to);
      for (long s = 0; s < n; ++s) loss = t.step(data, s);
    } else {
      wsp_trainer t(run, net, opt, w);
      if (w.in_flight) {  // a wave at a time: its minibatches run through the pipeline together
        if (n % w.wave != 0) throw std::invalid_argument("example_10: with --in-flight, --steps must be a multiple of --wave");
        for (long s = 0; s < n; s += w.wave) loss = t.wave(data, s).back();
      } else {
        for (long s = 0; s < n; ++s) loss = t.step(data, s);  // this worker's loss (last stage)
      }
      t.finish();  // every worker pulls the final global weights
      std::int64_t lead = 0;
      for (const auto& r : t.waves())
        if (!r.stopped) lead = std::max(lead, r.wave - r.min_clock);
      std::printf("rank %d: %lld waves, largest lead over the slowest rank %lld (bound %d)\n", run.rank(),
                  static_cast<long long>(t.clock()), static_cast<long long>(lead), w.staleness);
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    // 5. The final weights' loss on held-out batches, the same on every rank.
    trainer_options quiet;
    quiet.progress = false;
    trainer e(net, opt, quiet);
    const double held_out = e.evaluate(data, steps{4}, 1000000);
    if (run.rank() == 0)
      std::printf("%s: %ld steps in %.2f s; last loss on this rank %.4f (0 unless it computes the loss); held-out loss %.4f\n", mode.c_str(), n, secs, loss,
                  held_out);
    print_params_checksum(net);  // collective
    return 0;
  });
}
