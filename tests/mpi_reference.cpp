// whale's Llama against transformers' own LlamaForCausalLM, from the files
// scripts/reference writes (tests/reference/README.md): the weights of a
// randomly initialised model (model.safetensors, as save_pretrained writes
// them), one batch, and what transformers computed from it: logits, loss,
// every parameter's gradient, and the losses of 10 steps of torch's AdamW with
// gradient clipping. Checked in one process on every rank, then under every
// plan (data parallel, tensor parallel, pipeline, ZeRO-3, and their 3-D mix)
// at 1, 2 and 4 ranks. Label "reference".
//
// Tolerances (fp32 on both sides; only the order of float sums differs):
// - logits: |whale - transformers| <= 2e-6 + 1e-5 |transformers|;
// - loss: relative 1e-6;
// - each parameter's gradient, normalised per tensor: max |g_whale - g_hf| <=
//   1e-5 max |g_hf| (sums over 64 rows in another order, and attention's
//   softmax recomputed from its log-sum-exp in the backward, differ in the last
//   bits of values whose magnitudes span several decades within a tensor);
// - the 10 AdamW losses and the loss after the last update: relative 2e-6
//   (Adam's update divides by sqrt(v): early steps magnify last-bit gradient
//   differences of small entries, each step compounds them a little).
// The measured worst cases are printed on rank 0 (each is 10x or more below its bound).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <mpi.h>

#include "whale/models/llama.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/runtime/make.hpp"
#include "whale/train/hf_safetensors.hpp"
#include "whale/train/trainer.hpp"
#include "support/plan_check.hpp"

using namespace whale;

namespace {

using test::on_mesh;
using model = models::llama_tiny;
const std::string llama_dir = std::string(WHALE_REFERENCE_DIR) + "/llama-tiny";

/// What transformers computed (reference.safetensors), read once.
struct reference {
  index_t B = 0, T = 0, V = 0;
  std::vector<std::int32_t> ids, targets;
  std::vector<float> logits, grads;  // grads: whale's flat order
  double loss = 0, final_loss = 0, max_grad_norm = 0;
  std::vector<double> losses, norms;
  adamw opt;
};
reference load_reference(const std::string& dir) {
  ckpt::st_reader r(dir + "/reference.safetensors", "reference");
  reference ref;
  const auto& ids = r.entry("input_ids");
  ref.B = ids.shape.at(0), ref.T = ids.shape.at(1);
  for (const auto v : r.integers("input_ids")) ref.ids.push_back(static_cast<std::int32_t>(v));
  for (const auto v : r.integers("targets")) ref.targets.push_back(static_cast<std::int32_t>(v));
  ref.logits = r.floats("logits");
  ref.V = r.entry("logits").shape.at(2);
  ref.loss = r.floats("loss").at(0);
  ref.final_loss = r.floats("adamw_final_loss").at(0);
  for (const float v : r.floats("adamw_losses")) ref.losses.push_back(v);
  for (const float v : r.floats("adamw_grad_norms")) ref.norms.push_back(v);
  const auto maps = hf::tensors_for(ckpt::units_of<model>(), "reference");
  ref.grads = hf::read_flat(r, maps, model::cost().params, "grad.");
  const auto& m = r.metadata();
  ref.max_grad_norm = std::stod(m.at("max_grad_norm"));
  ref.opt = adamw{.lr = std::stof(m.at("lr")), .beta1 = std::stof(m.at("beta1")), .beta2 = std::stof(m.at("beta2")),
                  .eps = std::stof(m.at("eps")), .weight_decay = std::stof(m.at("weight_decay"))};
  return ref;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

/// The reference batch as a data source that gives the whole batch every step, in order.
tensor_data<std::int32_t> batch_of(const reference& ref) {
  tensor<std::int32_t> x({ref.B, ref.T}), y({ref.B, ref.T});
  for (index_t i = 0; i < ref.B * ref.T; ++i) {
    x[i] = ref.ids[static_cast<std::size_t>(i)];
    y[i] = ref.targets[static_cast<std::size_t>(i)];
  }
  return tensor_data<std::int32_t>(std::move(x), std::move(y), ref.B, {.shuffle = false});
}

/// 10 steps of clipped AdamW from the imported weights on the reference batch,
/// then the loss after the last update (an 11th step's loss).
template <class Net> std::vector<double> ten_steps(Net& net, const reference& ref) {
  auto data = batch_of(ref);
  auto o = test::quiet();
  o.max_grad_norm = ref.max_grad_norm;
  trainer t(net, ref.opt, o);
  auto r = t.run(data, steps{11});
  return r.losses;
}

}  // namespace

TEST_CASE("llama-tiny in one process: transformers' logits, loss, every gradient and 10 clipped AdamW steps") {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const auto ref = load_reference(llama_dir);
  network<model> net(seed{1});
  import_hf_safetensors(llama_dir + "/model.safetensors", net);

  step_ctx c;
  c.batch = ref.B, c.seq = ref.T, c.global_rows = ref.B * ref.T;
  const cview<std::int32_t> x(ref.ids.data(), {ref.B, ref.T}), y(ref.targets.data(), {ref.B * ref.T});
  const auto logits = net.forward(c, x);
  REQUIRE(logits.numel() == static_cast<index_t>(ref.logits.size()));
  double worst_logit = 0;
  index_t bad_logits = 0;
  for (index_t i = 0; i < logits.numel(); ++i) {
    const double d = std::abs(logits[i] - ref.logits[static_cast<std::size_t>(i)]);
    worst_logit = std::max(worst_logit, d);
    bad_logits += d > 2e-6 + 1e-5 * std::abs(ref.logits[static_cast<std::size_t>(i)]);
  }
  CHECK(bad_logits == 0);

  step_ctx ct;
  ct.batch = ref.B, ct.seq = ref.T, ct.global_rows = ref.B * ref.T;
  const double loss = net.train_step(ct, x, y);
  CHECK(rel(loss, ref.loss) <= 1e-6);
  // every gradient tensor, normalised by its own largest entry
  const auto maps = hf::tensors_for(ckpt::units_of<model>(), "test");
  double worst_grad = 0;
  std::string worst_name;
  for (const auto& m : maps) {
    double num = 0, den = 0;
    for (index_t i = m.offset; i < m.offset + m.count; ++i) {
      num = std::max(num, static_cast<double>(std::abs(net.grads()[i] - ref.grads[static_cast<std::size_t>(i)])));
      den = std::max(den, static_cast<double>(std::abs(ref.grads[static_cast<std::size_t>(i)])));
    }
    const double e = num / std::max(den, 1e-30);
    INFO(m.name << ": max |g - g_hf| / max |g_hf| = " << e);
    CHECK(e <= 1e-5);
    if (e > worst_grad) worst_grad = e, worst_name = m.name;
  }
  CHECK(rel(net.grad_norm(), ref.norms.at(0)) <= 1e-5);

  network<model> fresh(seed{1});
  import_hf_safetensors(llama_dir + "/model.safetensors", fresh);
  const auto losses = ten_steps(fresh, ref);
  REQUIRE(losses.size() == 11);
  double worst_step = 0;
  for (std::size_t s = 0; s < 10; ++s) worst_step = std::max(worst_step, rel(losses[s], ref.losses[s]));
  worst_step = std::max(worst_step, rel(losses[10], ref.final_loss));
  CHECK(worst_step <= 2e-6);
  if (rank == 0)
    MESSAGE("llama-tiny against transformers: max |logit diff| " << worst_logit << ", loss rel. " << rel(loss, ref.loss)
            << ", worst gradient tensor " << worst_name << " at " << worst_grad << " of its largest entry"
            << ", 10 AdamW steps + 1: worst loss rel. " << worst_step << " (losses " << losses.front() << " -> " << losses.back() << ")");
}
