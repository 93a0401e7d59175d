// The `Layer` concept and what every layer shares: the per-pass context
// (`step_ctx`), parameter binding into one flat buffer (`param_binder`),
// per-micro-batch activation slots and constexpr cost metadata
// (nn/context.hpp); the concepts, hooks and parameter descriptions
// (nn/layer_concept.hpp); how a layer's pass runs (nn/layer_run.hpp).
// Concrete layers live in their own headers beside this one.
#pragma once

#include "whale/nn/context.hpp"
#include "whale/nn/layer_concept.hpp"
#include "whale/nn/layer_run.hpp"
