// The umbrella header: everything a user of whale needs. Backends that need
// optional dependencies are included only when their target is linked
// (whale::mpi defines WHALE_HAS_MPI, whale::cuda defines WHALE_HAS_CUDA).
#pragma once

#include "whale/fwd.hpp"

// tensor/
#include "whale/tensor/memory.hpp"
#include "whale/tensor/random.hpp"
#include "whale/tensor/tensor.hpp"

// backend/
#include "whale/backend/cpu.hpp"
#include "whale/backend/guarded.hpp"

// comm/
#include "whale/comm/collectives.hpp"
#include "whale/comm/communicator.hpp"
#include "whale/comm/context.hpp"
#include "whale/comm/failure.hpp"
#include "whale/comm/local_comm.hpp"
#include "whale/comm/mesh.hpp"
#ifdef WHALE_HAS_MPI
#include "whale/comm/mpi_comm.hpp"
#endif
#ifdef WHALE_HAS_CUDA
#include "whale/comm/nccl_comm.hpp"
#endif

// nn/
#include "whale/nn/causal_self_attention.hpp"
#include "whale/nn/embedding.hpp"
#include "whale/nn/gelu.hpp"
#include "whale/nn/layer.hpp"
#include "whale/nn/layer_norm.hpp"
#include "whale/nn/rms_norm.hpp"
#include "whale/nn/rotary_attention.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/network.hpp"
#include "whale/nn/recompute.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/residual.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/regression_loss.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/nn/swiglu_mlp.hpp"
#include "whale/nn/tied_head.hpp"
#include "whale/nn/transformer_block.hpp"

// optim/
#include "whale/optim/adamw.hpp"
#include "whale/optim/optimizer.hpp"
#include "whale/optim/sgd.hpp"

// strategy/
#include "whale/strategy/auto_plan.hpp"
#include "whale/strategy/layout.hpp"
#include "whale/strategy/pipeline.hpp"
#include "whale/strategy/schedule.hpp"
#include "whale/strategy/split.hpp"
#include "whale/strategy/split_layers.hpp"
#include "whale/strategy/replicate.hpp"
#include "whale/strategy/shard.hpp"

// plan/
#include "whale/plan/describe.hpp"
#include "whale/plan/device.hpp"
#include "whale/plan/lower.hpp"
#include "whale/plan/measure.hpp"
#include "whale/plan/memory.hpp"
#include "whale/plan/partition.hpp"
#include "whale/plan/program.hpp"
#include "whale/plan/simulate.hpp"

// runtime/
#include "whale/runtime/auto_plan.hpp"
#include "whale/runtime/executor.hpp"
#include "whale/runtime/make.hpp"
#include "whale/runtime/options.hpp"
#include "whale/runtime/profile_cache.hpp"

// train/
#include "whale/train/data.hpp"
#include "whale/train/progress.hpp"
#include "whale/comm/trace.hpp"
#include "whale/train/trainer.hpp"
#include "whale/train/checkpoint.hpp"
#include "whale/train/init.hpp"
#include "whale/train/data_source.hpp"
#include "whale/train/metrics.hpp"
#include "whale/train/safetensors.hpp"
#include "whale/train/run_flags.hpp"
#include "whale/optim/lr_schedule.hpp"
#ifdef WHALE_HAS_MPI
#include "whale/train/wsp_trainer.hpp"
#endif

// the reference workloads
#include "whale/models/deep_mlp.hpp"
#include "whale/models/gpt.hpp"
#include "whale/models/mlp.hpp"
#include "whale/models/xc.hpp"
