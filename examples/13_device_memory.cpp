// 13: training in a device's memory. `network<M>` given a device backend
// keeps everything in that backend's memory -- parameters, gradients,
// optimizer state, activations and each step's inputs -- and the host reads
// only copies (the loss, the logits, a label check). On a GPU the backend is
// cuda_backend (in a .cu file compiled by nvcc: `backend_ref(gpu)`); here it
// is the guarded backend, the CPU computing in memory that host code may not
// touch, so this program runs anywhere and would crash with a message if any
// host code touched device memory. The result equals the CPU backend's to the
// bit: the example checks that, and that the trainer reading the losses once
// at the end (trainer_options::log_every) ends with the parameters of reading
// every step. No MPI.
//
//   ./build/examples/example_13_device_memory [--steps S]
//
// Legend: B sequences of T tokens; S steps.
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

using namespace whale;

// A small GPT: vocabulary 64, 16 positions, width 32, 4 heads, FFN 64, 2 blocks.
using model = models::gpt_model<64, 16, 32, 4, 64, 2>;
constexpr index_t B = 4, T = 16;

// Train S steps of AdamW with gradients clipped to norm 1 on `be`; returns the losses and the parameters (host copies).
std::pair<std::vector<double>, std::vector<float>> train(backend_ref be, int steps) {
  network<model> net(seed{42}, be);  // on a device: allocated and initialised there
  const adamw opt{.lr = 3e-3f};
  auto state = net.make_optimizer_state(opt);  // in the network's memory too
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    // Host data, as a data source gives it: train_step copies it to the device.
    std::vector<std::int32_t> tokens(B * T), labels(B * T);
    for (index_t i = 0; i < B * T; ++i) {
      tokens[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((i * 5 + s) % 64);
      labels[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((i * 5 + s + 1) % 64);  // the next token
    }
    step_ctx c;
    c.batch = B;
    c.seq = T;
    c.global_rows = B * T;
    losses.push_back(net.train_step(c, cview<std::int32_t>(tokens.data(), {B, T}),
                                    cview<std::int32_t>(labels.data(), {B * T})));
    // The norm is summed on the device; only the number comes back.
    net.apply_optimizer(opt, state, clip_coefficient(net.grad_norm(), 1.0));
  }
  return {losses, net.params_on_host()};  // net.params() would be device memory
}

// The same model trained by the trainer on `be`, which can leave each step's
// loss and gradient norm in device memory and read them once every `every`
// steps (trainer_options::log_every): no host wait inside those steps.
std::vector<float> train_by_trainer(backend_ref be, int steps, int every) {
  network<model> net(seed{42}, be);
  markov_data data(seed{7}, 64, T, B);
  trainer_options o;
  o.progress = false;
  o.max_grad_norm = 1.0;
  o.log_every = every;
  trainer t(net, adamw{.lr = 3e-3f}, o);
  t.run(data, whale::steps{steps});
  return net.params_on_host();
}

int main(int argc, char** argv) {
  try {
    int steps = 20;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--steps" && i + 1 < argc) steps = static_cast<int>(detail::parse_int(argv[++i], "--steps", 1, 100000));
      else throw std::invalid_argument("unknown argument '" + a + "' (have --steps S)");
    }
    const auto [cpu_losses, cpu_params] = train(backend_ref{}, steps);

    guarded_backend device;  // the stand-in for a GPU; on one: cuda_backend gpu; backend_ref(gpu)
    const auto [dev_losses, dev_params] = train(backend_ref(device), steps);

    std::printf("step   loss (cpu)   loss (device memory)\n");
    for (int s = 0; s < steps; s += steps > 10 ? steps / 10 : 1)
      std::printf("%4d   %.6f     %.6f\n", s, cpu_losses[static_cast<std::size_t>(s)],
                  dev_losses[static_cast<std::size_t>(s)]);
    // reading every step, and reading once at the end: the same parameters, to the bit
    const bool deferred_same = train_by_trainer(backend_ref(device), steps, 1) ==
                               train_by_trainer(backend_ref(device), steps, steps);
    std::printf("the trainer reading every step and reading once after %d steps: %s\n", steps,
                deferred_same ? "the same parameters to the bit" : "MISMATCH");
    const bool same = cpu_losses == dev_losses && cpu_params == dev_params && deferred_same;
    std::printf("device blocks from the allocator's upstream: %lld (reused every step after the first ones)\n",
                static_cast<long long>(device.allocator().upstream_allocations));
    std::printf("%s\n", same ? "the device run equals the CPU run to the bit"
                             : "MISMATCH: the device run differs from the CPU run");
    return same ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "example_13_device_memory: %s\n", e.what());
    return 1;
  }
}
