// The trainer's start (train/trainer_start.hpp), defined. Compiled once in
// whale::core under the compiled core (detail/compiled.hpp); inline, as the
// rest of the library, without it.
#pragma once

#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

#include "whale/detail/io.hpp"
#include "whale/plan/precision_rule.hpp"
#include "whale/train/checkpoint.hpp"
#include "whale/train/interrupt.hpp"
#include "whale/train/trainer_start.hpp"

#if !WHALE_CORE_DEFINITIONS
#error "whale/train/trainer_start_impl.hpp holds the compiled core's definitions: include whale/train/trainer_start.hpp, not this file"
#endif

namespace whale::detail {

WHALE_CORE_INLINE void start_trainer(const trainer_options& o, const trainer_facts& f, run_record& rec,
                                     tensor<float>& master, std::int64_t next) {
  check_trainer_options(o);
  const bool bf16 = f.precision == precision::bf16;
  if (bf16 && !f.has_params)
    throw std::invalid_argument("whale::trainer: bf16 mixed precision needs the network's params() (the weights it rounds); "
                                "this network type does not have it");
  // make<P> refused it already; a network made otherwise is checked here
  if (const auto why = precision_refusal(bf16, f.zero3 ? 3 : 0); !why.empty()) throw std::invalid_argument("whale::trainer: " + why);
  if (bf16) {  // the fp32 master weights, beside the parameters (on a device, in its memory) for the whole run
    std::string err = ckpt::catching([&] {
      const place_scope where(f.backend.memory());
      master.resize(f.params.shape());
    });
    if (!err.empty()) err = "whale::trainer: bf16 mixed precision keeps fp32 master weights beside the parameters (" +
                            std::to_string(f.params.bytes()) + " bytes): " + err;
    ckpt::agree(f.world, err);  // every rank fails alike
  }
  if (o.handle_signals) {
    install_interrupt_handlers(f.rank == 0);
    rec.note_progress(o, next);
  }
  check_checkpoint_options(o);
  if ((o.save_every > 0 || o.resume) && !f.checkpoints)
    throw std::invalid_argument("whale::trainer: save_every and resume need a Checkpointable network (network<M> or a plan "
                                "made by make<P>) and an optimizer whose state has vectors() (sgd, adamw)");
  if (!f.has_lr && o.lr_schedule)
    throw std::invalid_argument("whale::trainer: lr_schedule needs an optimizer with a member `lr`; " + f.optimizer + " has none");
  if (f.checkpoints && !o.checkpoint_dir.empty()) {  // made and checked before any work, on every rank
    std::string err;
    if (f.rank == 0) {
      std::error_code ec;
      std::filesystem::create_directories(o.checkpoint_dir, ec);
      if (ec) err = "cannot create it: " + ec.message();
      else err = output_path_problem(o.checkpoint_dir + "/.whale-probe");
      if (!err.empty()) err = "whale::trainer: the checkpoint directory (trainer_options::checkpoint_dir, --save) '" + o.checkpoint_dir + "': " + err + "; nothing was run";
      else if (err = ckpt::catching([&] { ckpt::hold_folder(o.checkpoint_dir, "whale::trainer"); }); !err.empty()) err += "; nothing was run";
    }
    ckpt::agree(f.world, err);
  }
  if (!o.log_path.empty()) {  // checked on every rank (collective when the network has a world)
    std::string err;
    if (f.rank == 0) err = rec.open_log(o);
    ckpt::agree(f.world, err);
  }
}

}  // namespace whale::detail
