// Workloads for judging plans on paper (docs/paper-clusters.md §1): the Whale
// paper's two headline models at their real sizes, a 13-billion-parameter
// GPT for the scaling case, and the GPU workloads (gpt-gpu and a 7B GPT).
// whale_plan lowers and simulates them; nothing here trains (ResNet-50 is a
// price, not a layer: whale has no convolutions).
#pragma once

#include "search.hpp"

namespace bench::paper {

using namespace whale;

/// BERT-Large's shape: 24 blocks of width 1024, 16 heads, FFN 4096, 512
/// positions, vocabulary 30,522 padded to 30,528 (a multiple of 64, as
/// Megatron pads it, so that the tensor-parallel forms divide it). whale's
/// blocks are causal decoder blocks; the FLOPs and bytes are an encoder's.
using bert_large = models::gpt_model<30528, 512, 1024, 16, 4096, 24>;
inline constexpr index_t bert_seq = 128;            // pre-training's first phase
inline constexpr index_t bert_batch_per_rank = 16;  // sequences per device

/// ResNet-50 without its classifier, priced from its published figures:
/// 23.5 M parameters, 4.1 G multiply-adds (8.2 GFLOP) forward per 224 x 224
/// image, backward twice that, about 100 MB of kept activations per image
/// (fp32 feature maps of the forward). All of it runs as GEMMs (implicit-GEMM
/// convolutions), so the simulator prices every FLOP at the GEMM rate.
struct resnet50_price {
  static constexpr index_t params = 23'508'032;
  static constexpr double fwd_flops = 8.2e9, bwd_flops = 16.4e9, act_bytes = 100e6;
};
/// The unit that stands for the backbone in the description; its layer and
/// its cost are replaced by resnet50_price's (priced()).
using backbone_slot = linear<2048, 2048>;
/// 100,000 classes padded to 100,032 (a multiple of 64, so that 8, 16, 32 and
/// 64 ranks divide them; the 32 extra classes are never labels).
using classifier_100k = sequential<linear<2048, 100032>, softmax_cross_entropy>;
inline constexpr index_t xc_batch_per_rank = 64;  // images per device

inline model_desc priced(model_desc d) {
  auto& u = d.units.front();
  if (u.name != layer_name<backbone_slot>())
    throw std::logic_error("bench::paper: the backbone slot is not the first unit (" + u.name + ")");
  d.full_params += resnet50_price::params - u.full_params;
  u.name = u.unsplit = "resnet50 (priced)";
  u.full_params = resnet50_price::params;
  u.cost.params = resnet50_price::params;
  u.cost.fwd_flops = resnet50_price::fwd_flops;
  u.cost.bwd_flops = resnet50_price::bwd_flops;
  u.cost.act_bytes = resnet50_price::act_bytes;
  u.cost.per_feature = false;
  u.cost.all_gemm = true;
  u.tensors = nullptr;
  u.kernels = nullptr;  // a price, not a layer: no GPU kernels to count
  return d;
}
inline model_desc resnet_xc(const search::plan_query& a) {
  return priced(search::classifier_plans<backbone_slot, classifier_100k>::of(a));
}

/// A GPT of 13 billion parameters in GPT-3's 13B shape: 40 blocks of width
/// 5120, 40 heads, FFN 20480, 2048 positions, vocabulary 50,304.
using gpt_13b = models::gpt_model<50304, 2048, 5120, 40, 20480, 40>;
inline constexpr index_t gpt_13b_batch = 1024;  // sequences of 2048 tokens per step (2 M tokens), at every scale

/// gpt-gpu (shared/workloads.md): 12 blocks of width 1024, 16 heads, FFN 4096,
/// 1,024 positions, vocabulary 32,768, untied head; 8 sequences per GPU, so
/// that N GPUs train N times one GPU's batch (the scaling goal compares them).
using gpt_gpu = models::gpt_model<32768, 1024, 1024, 16, 4096, 12>;
inline constexpr index_t gpt_gpu_batch_per_rank = 8;
/// A 7-billion-parameter GPT in GPT-3's 6.7B shape: 32 blocks of width 4096, 32
/// heads, FFN 16384, 2,048 positions, vocabulary 50,304 (6.9 B parameters with
/// the untied head). Too large for one H200 with AdamW and fp32 master weights
/// (16 bytes a parameter before activations).
using gpt_7b = models::gpt_model<50304, 2048, 4096, 32, 16384, 32>;
inline constexpr index_t gpt_7b_batch = 128;  // sequences of 2048 tokens per step (262,144 tokens), at every scale

/// Adds the five to the search's workloads (once).
inline void add_workloads() {
  static const bool added = [] {
    search::add_workload({"bert-large", &search::gpt_plans<bert_large>::of,
                          [](const mesh_shape& m) { return bert_batch_per_rank * m.size(); }, bert_seq, bert_large::max_seq,
                          true, false, true});
    search::add_workload({"resnet50-100k", &resnet_xc, [](const mesh_shape& m) { return xc_batch_per_rank * m.size(); }, 1, 1,
                          false, true});
    search::add_workload({"gpt-gpu", &search::gpt_plans<gpt_gpu>::of,
                          [](const mesh_shape& m) { return gpt_gpu_batch_per_rank * m.size(); }, 1024, gpt_gpu::max_seq, true,
                          false, false});
    search::add_workload({"gpt-7b", &search::gpt_plans<gpt_7b>::of, [](const mesh_shape&) { return gpt_7b_batch; }, 2048,
                          gpt_7b::max_seq, true, false, true});
    search::add_workload({"gpt-13b", &search::gpt_plans<gpt_13b>::of, [](const mesh_shape&) { return gpt_13b_batch; }, 2048,
                          gpt_13b::max_seq, true, false, true});
    return true;
  }();
  (void)added;
}

}  // namespace bench::paper
