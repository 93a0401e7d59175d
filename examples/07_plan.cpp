// 07: reading a plan before running it. A plan type is lowered, for one rank
// of a mesh, to that rank's program: what it holds (each layer's sharded form
// and parameters) and every operation of one training step — compute,
// collectives, point-to-point messages, the optimizer — with its bytes and
// FLOPs. Lowering is pure: no MPI, no model tensors, so a 1,024-rank mesh is
// inspected on a laptop; it ends with the memory the rank will need. This is a
// single-process program (no mpirun).
//
//   ./build/examples/example_07_plan [--mesh data=8,pipe=2,model=2] [--rank R]
//                                    [--simulate bench/profiles/datasheet-h200-8x-ib400.txt]
// With --simulate it also replays by symmetry (one rank per stage) and with the
// pipeline's stages placed across nodes.
//
// Legend of shape comments: B sequences, T tokens, C width (256), V vocabulary (8192).
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

using namespace whale;

// The reference gpt with tensor parallelism inside each layer (Megatron):
// (B, T) tokens -> vocabulary-split embedding -> (B*T, C) -> 4 x block with
// head-split attention and column/row FFN -> class-split head and loss.
using block = transformer_block<256, 4, 1024>;
using tp_gpt = sequential<split<embedding<8192, 256>>, position_embedding<128, 256>, repeat<4, split<block>>,
                          layer_norm<256>, split<sequential<linear<256, 8192>, softmax_cross_entropy>>>;
// ... cut into pipeline stages at run time, and replicated over the data axis: 3-D parallelism.
using plan = replicate<pipeline<one_f_one_b, tp_gpt>>;

int main(int argc, char** argv) {
  std::string spec = "data=8,pipe=2,model=2", profile;
  int rank = 0;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if ((a == "--mesh" || a == "--rank" || a == "--simulate") && i + 1 < argc) {
        if (a == "--mesh") spec = argv[++i];
        else if (a == "--simulate") profile = argv[++i];
        else rank = static_cast<int>(detail::parse_int(argv[++i], "--rank", 0, 1 << 20));
      } else {
        std::fprintf(stderr, "usage: example_07_plan [--mesh data=D,pipe=P,model=M] [--rank R] [--simulate PROFILE]\n");
        return 2;
      }
    }
    int world = 1;
    for (std::size_t at = 0; at < spec.size();) {
      const auto end = std::min(spec.find(',', at), spec.size());
      const auto item = spec.substr(at, end - at);
      world *= static_cast<int>(detail::parse_int(item.substr(item.find('=') + 1), "--mesh " + item, 1, 1 << 16));
      at = end + 1;
    }
    // 1. The mesh: data x pipe x model; every axis is given, so the world is their product.
    const auto mesh = mesh_shape::parse(spec, world, "--mesh");
    // 2. The run-time choices: the global batch (sequences), tokens per sequence, micro-batches.
    lower_options o;
    o.global_batch = 4 * mesh.size(axis::data);
    o.seq = 128;
    o.micro_batches = 4;
    // 3. Lower and print: holdings, then each operation of one step, then totals.
    const program p = lower<plan>(mesh, rank, o);
    std::cout << p;
    // 4. Totals are plain numbers: e.g. the bytes this rank moves over each axis.
    std::printf("bytes sent per step over data: %lld, pipe: %lld, model: %lld\n",
                static_cast<long long>(p.bytes_sent_over(axis::data)), static_cast<long long>(p.bytes_sent_over(axis::pipe)),
                static_cast<long long>(p.bytes_sent_over(axis::model)));
    // 5. The memory the rank needs for such a step (plan/memory.hpp): model state,
    // activations of the micro-batches the schedule keeps, communication buffers.
    std::cout << "predicted memory of this rank: " << predict_memory(describe<plan>(), p) << "\n";
    // 6. With a device profile (bench/profiles/*.txt, scripts/profile): every rank's
    // program replayed together, for the step time and where each rank spends it.
    if (!profile.empty()) {
      const auto d = describe<plan>();
      std::vector<program> all;
      for (int r = 0; r < mesh.size(); ++r) all.push_back(lower(d, mesh, r, o));
      const auto sim = simulate(d, all, device_profile::load(profile));
      const auto& me = sim.ranks[static_cast<std::size_t>(rank)];
      std::printf("simulated step: %.4f s; rank %d computes %.4f s, communicates %.4f s, waits %.4f s\n", sim.step_s, rank,
                  me.compute_s, me.comm_s, me.wait_s);
      // 7. Equal replicas and equal tensor-parallel shards behave alike, so one rank
      // per pipeline stage (data 0, model 0) stands for all: the same step, far fewer programs.
      std::vector<program> stages;
      for (const auto& q : all)
        if (q.coords[0] == 0 && q.coords[2] == 0) stages.push_back(q);
      const auto dev = device_profile::load(profile);
      std::printf("by symmetry, %zu of %d programs: %.4f s\n", stages.size(), mesh.size(), simulate(d, stages, dev).step_s);
      // 8. Placement: whale numbers ranks with model innermost, then pipe, then data, so
      // a node holds whole pipelines; Megatron's order puts the stages across nodes
      // (run a job so with ctx.with_rank_order(pipe_outer_devices(mesh))).
      std::printf("with the stages across nodes: %.4f s\n", simulate(d, stages, dev, 0, pipe_outer_devices(mesh)).step_s);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "example_07_plan: %s\n", e.what());
    return 2;
  }
  return 0;
}
