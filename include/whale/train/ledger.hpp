// `steady_step_ledger(g, t, data)`: what one steady training step asks of a
// GPU, counted on the guarded backend `g` that trainer `t` runs on (a
// count-only one for shapes too large to compute here): a run of one step
// that allocates, then a run of two steps less a run of one, so that what
// every run does once (its read at the end) cancels. The trainer should keep
// its figures on the device between reads (trainer_options::log_every > 1).
#pragma once

#include "whale/backend/guarded.hpp"
#include "whale/train/trainer.hpp"

namespace whale {

template <class Trainer, class Data> device_ledger steady_step_ledger(guarded_backend& g, Trainer& t, Data& data) {
  t.run(data, steps{1});
  g.ledger().clear();
  t.run(data, steps{1});
  const auto one = g.ledger();
  g.ledger().clear();
  t.run(data, steps{2});
  return g.ledger().minus(one);
}

}  // namespace whale
