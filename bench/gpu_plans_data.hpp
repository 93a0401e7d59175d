// gpu_plans: the plans over the data and model axes without a pipeline --
// data parallelism (dp; tensor parallelism, tp, is the same type on a model
// axis), Whale's class-split classifier, and virtual workers under Wave
// Synchronous Parallel. See gpu_plans.hpp; compiled in gpu_plans.cu.
#pragma once

#include "gpu_plans.hpp"

namespace gpu_plans {
namespace detail_data {

// The class-split classifier: a replicated backbone, the classes split over the data axis.
#if WHALE_GPU_PLANS_SHAPE == 2
inline constexpr index_t xc_in = 64, xc_hidden = 128, xc_classes = 1000;
#elif WHALE_GPU_PLANS_SHAPE == 1
inline constexpr index_t xc_in = 128, xc_hidden = 512, xc_classes = 8192;
#else
inline constexpr index_t xc_in = 512, xc_hidden = 2048, xc_classes = 100000;  // workloads.md's xc
#endif
inline constexpr index_t xc_rows_per_replica = 64;
using xc_backbone = sequential<linear<xc_in, xc_hidden>, relu>;
using xc_head = sequential<linear<xc_hidden, xc_classes>, softmax_cross_entropy>;
using class_split = sequential<replicate<xc_backbone>, split<xc_head, axis::data>>;

outcome train_class_split(context& ctx, const backend_ref& be, const settings& s, bool timed, const device_backend* dev) {
  auto p = make<class_split>(ctx, seed{42}, options_for(be, s));
  const index_t global = s.sequences > 0 ? s.sequences : xc_rows_per_replica * data_replicas(ctx);
  teacher_data data(seed{7}, xc_in, xc_classes, global);
  trainer t(p, adamw{.lr = 1e-3f}, trainer_for(s.steps));
  return drive(ctx, t, data, s, timed, dev, [&] { return p.device_traffic(); }, [&] { return p.device_host_waits(); });
}
double xc_flops(index_t samples, index_t) {
  return 6.0 * static_cast<double>(class_split::cost().params) * static_cast<double>(samples);
}

// Virtual workers under WSP: each data replica a worker; D = 0 trains as synchronous data parallelism.
outcome train_wsp(context& ctx, const backend_ref& be, const settings& s, bool timed, const device_backend* dev) {
  auto p = make<replicate<tp_gpt>>(ctx, seed{42}, options_for(be, s));
  markov_data data(seed{7}, V, seq_of(s), global_sequences(ctx, s));
  wsp_options w;
  w.staleness = s.staleness;
  wsp_trainer t(ctx, p, adamw{.lr = 1e-4f}, w);
  outcome r;
  auto steps = [&](int from, int n) {
    for (int i = from; i < from + n; ++i) r.losses.push_back(t.step(data, i));
  };
  if (!timed) {
    steps(0, s.steps);
    return r;
  }
  steps(0, 2);
  if (dev) dev->synchronize();
  barrier(ctx.world());
  const auto host0 = ctx.world().stats();
  const auto dev0 = p.device_traffic();
  const std::int64_t waits0 = dev ? dev->host_waits() + p.device_host_waits() : -1;
  const auto t0 = std::chrono::steady_clock::now();
  r.losses.clear();
  steps(2, s.steps);
  if (dev) dev->synchronize();
  r.step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / s.steps;
  r.losses = {r.losses.front(), r.losses.back()};
  auto d = p.device_traffic(), h = ctx.world().stats();
  r.device = {(d.bytes_sent - dev0.bytes_sent) / s.steps, (d.bytes_received - dev0.bytes_received) / s.steps,
              (d.operations - dev0.operations) / s.steps};
  r.host = {(h.bytes_sent - host0.bytes_sent) / s.steps, (h.bytes_received - host0.bytes_received) / s.steps,
            (h.operations - host0.operations) / s.steps};
  if (dev && waits0 >= 0) r.host_waits = (dev->host_waits() + p.device_host_waits() - waits0) / s.steps;
  return r;
}

}  // namespace detail_data
using namespace detail_data;

inline std::vector<entry> data_entries() {
  return {
      {"dp", "data parallel: replicate<tp_gpt> with every rank on the data axis (gradient buckets overlap backward)",
       on_data, train_gpt<replicate<tp_gpt>>, gpt_flops},
      {"tp", "tensor parallel (Megatron): the same type with every rank on the model axis", on_model,
       train_gpt<replicate<tp_gpt>>, gpt_flops},
      {"class-split", "Whale's classifier: sequential<replicate<backbone>, split<classifier, axis::data>> (xc's shape)",
       on_data, train_class_split, xc_flops, false},
      {"wsp", "virtual workers under Wave Synchronous Parallel (wsp_trainer over replicate<tp_gpt>; --staleness D, 0: synchronous)",
       on_data, train_wsp, gpt_flops},
  };
}

}  // namespace gpu_plans
