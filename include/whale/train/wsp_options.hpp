// Options and records of Wave Synchronous Parallel training (train/wsp_trainer.hpp),
// and their checks. Not a template.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "whale/train/trainer_options.hpp"

namespace whale {

/// Options of Wave Synchronous Parallel training.
struct wsp_options {
  /// D: a virtual worker may start wave c + 1 only when every rank has pushed
  /// wave c - D (D = 0: synchronous). HetPipe's staleness bound.
  int staleness = 0;
  /// N_m: minibatches (data steps) per wave; the update pushed is their sum.
  int wave = 1;
  /// Microseconds between two reads of the clocks while waiting.
  int poll_us = 200;
  /// HetPipe's pipelined minibatches: the N_m minibatches of a wave are in
  /// flight together in the worker's pipeline (no flush between them) and all
  /// run on the weights the wave began with; their N_m updates are applied in
  /// order when the last one's backward is done. Train with wave(), not step().
  /// false: each minibatch flushes and the next sees its update.
  bool in_flight = false;
  /// Clip each minibatch's gradients to this norm over its worker (0: no clipping).
  double max_grad_norm = 0;
  // (bf16 mixed precision is the plan's, plan_options::precision: each minibatch
  // (each wave in flight) then computes with the weights rounded to bf16 and the
  // layers store bf16 values; the update, the holders and the pushed waves keep fp32.)
};

/// What one minibatch ran on: data step `step` of wave `wave` (0-based), on
/// weights that held `local_version` of this worker's own minibatch updates
/// (all of its steps < local_version) and, from the other workers, every
/// update of their waves < `global_clock` (the smallest clock at the last pull).
/// Sequential waves: step - local_version = 0; in flight: the minibatch's
/// place in its wave (at most N_m - 1, HetPipe's local staleness).
struct minibatch_record {
  std::int64_t step = 0, wave = 0, local_version = 0, global_clock = 0;
};

/// What one wave of this rank saw: its clock after the push, the smallest
/// clock of any rank when it went on (the oldest wave every update of which it
/// then pulled), and how long it waited. wave - min_clock <= staleness for
/// every wave after which the worker went on (not `stopped`).
struct wave_record {
  std::int64_t wave = 0, min_clock = 0;
  double wait_s = 0;
  /// The wave ended on a stop request: the worker went no further (the wait
  /// for the others was cut short), so the bound does not apply to it.
  bool stopped = false;
};

namespace detail {
/// The options' ranges, and their agreement with the plan's (plan_options::
/// in_flight, whether it has memory caps): an error naming the option.
inline void check_wsp_options(const wsp_options& o, int plan_in_flight, bool plan_capped) {
  if (o.staleness < 0 || o.staleness > 1000000)
    throw std::invalid_argument("whale::wsp_trainer: the staleness bound D must be from 0 to 1000000 (got " +
                                std::to_string(o.staleness) + ")");
  if (o.wave < 1 || o.wave > 1000000)
    throw std::invalid_argument("whale::wsp_trainer: a wave must hold 1 to 1000000 minibatches (got " +
                                std::to_string(o.wave) + ")");
  if (o.poll_us < 1 || o.poll_us > 1000000)
    throw std::invalid_argument("whale::wsp_trainer: poll_us must be from 1 to 1000000");
  if (plan_in_flight != 0 && plan_in_flight != (o.in_flight ? o.wave : 0))
    throw std::invalid_argument("whale::wsp_trainer: the plan was made for " + std::to_string(plan_in_flight) +
                                " minibatches in flight (plan_options::in_flight), but this trainer runs " +
                                (o.in_flight ? std::to_string(o.wave) : std::string("none")) +
                                " (wsp_options::wave, in_flight); make them agree");
  if (o.in_flight && plan_capped && plan_in_flight != o.wave)
    throw std::invalid_argument("whale::wsp_trainer: with memory caps and minibatches in flight, make the plan with "
                                "plan_options::in_flight = " + std::to_string(o.wave) +
                                " so that its stage cut counts the activations of the minibatches in flight");
  if (!(o.max_grad_norm >= 0) || !std::isfinite(o.max_grad_norm))
    throw std::invalid_argument("whale::wsp_trainer: max_grad_norm must be a finite number >= 0 (0: no clipping)");
}
/// A worker's faulty minibatch, data step `step`: kind 1, its loss was not
/// finite; kind 2, the gradient norm clipping needs was not. Thrown on every
/// rank of the worker, before any update of the wave is pushed.
[[noreturn]] inline void throw_wsp_fault(std::int64_t step, int kind) {
  throw std::runtime_error("whale::wsp_trainer: data step " + std::to_string(step) +
                           (kind == 1 ? ": this worker's loss is NaN or infinite; check the data for NaN/Inf or lower the learning rate"
                                      : ": a minibatch's gradient norm is not finite; check the data or lower the learning rate") +
                           " (no update of that wave was pushed)");
}
}  // namespace detail

}  // namespace whale
