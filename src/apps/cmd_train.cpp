// `viaduct train --config F [--section.key=value ...] [--print-config]`.
#include <cstdio>

#include "apps/command.h"
#include "config/config.h"
#include "core/log.h"
#include "train/preemption.h"
#include "train/trainer.h"

namespace viaduct::apps {
namespace {

constexpr const char* kUsage =
    "usage: viaduct train --config FILE [--section.key=value ...] "
    "[--print-config]\n\n"
    "Trains the model the config describes. Any config key can be "
    "overridden\non the command line; --print-config prints the "
    "effective config and exits.\n\n"
    "SIGTERM, SIGINT or SIGUSR1 finish the current step, save a checkpoint\n"
    "(with checkpoint.enable = true) and exit with status 75 (128 + the\n"
    "signal without checkpoints); a second signal aborts at once (status\n"
    "128 + the signal).\n";

int run_train(int argc, char** argv) {
  const auto cmd = parse_config_command(argc, argv, "train", kUsage, {"--print-config"});
  if (!cmd) return 0;
  const auto& job = cmd->job;
  if (cmd->has("--print-config")) {
    std::printf("%s", job.to_toml().c_str());
    return 0;
  }
  install_stop_signal_handlers(job.checkpoint.enable);
  Trainer trainer(job.raw());
  const auto last = trainer.run();
  if (trainer.stopped_on_signal()) {
    // 75 promises a checkpoint to resume from; without one it is an
    // interruption like any other.
    return job.checkpoint.enable ? kExitSavedOnSignal : 128 + stop_signal();
  }
  if (last.step == 0) {
    log::info("nothing to do: the run is already at step ", trainer.step(),
              " (training.steps); raise training.steps to continue it");
  } else {
    log::info("done: ", trainer.step(), " steps, final loss ", last.loss);
  }
  return 0;
}

}  // namespace

VIADUCT_COMMAND("train", "train a model (single process or one pipeline rank)",
                run_train);

}  // namespace viaduct::apps
