// `viaduct train --config F [--section.key=value ...] [--print-config]`.
#include <cstdio>

#include "apps/command.h"
#include "config/config.h"
#include "core/log.h"
#include "train/trainer.h"

namespace viaduct::apps {
namespace {

int run_train(int argc, char** argv) {
  auto args = parse_command_line(argc, argv, 1, {});
  for (const auto& f : args.flags) {
    if (f == "--help" || f == "-h") {
      std::printf(
          "usage: viaduct train --config FILE [--section.key=value ...] "
          "[--print-config]\n\n"
          "Trains the model the config describes. Any config key can be "
          "overridden\non the command line; --print-config prints the "
          "effective config and exits.\n");
      return 0;
    }
    VIADUCT_CHECK_T(ConfigError, f == "--print-config", "unknown option ", f,
                    " (see viaduct train --help)");
  }
  VIADUCT_CHECK_T(ConfigError, args.positional.empty(), "unexpected argument '",
                  args.positional.empty() ? "" : args.positional[0], "'");
  auto cfg = Config::load(args.config_path, args.overrides);
  if (!args.flags.empty()) {
    std::printf("%s", cfg.to_toml().c_str());
    return 0;
  }
  Trainer trainer(cfg);
  const auto last = trainer.run();
  log::info("done: ", trainer.step(), " steps, final loss ", last.loss);
  return 0;
}

}  // namespace

VIADUCT_COMMAND("train", "train a model (single process or one pipeline rank)",
                run_train);

}  // namespace viaduct::apps
