// `viaduct launch`: starts this node's ranks of a command with the torchrun
// environment and supervises them (dist/launcher.h does the work).
#include <cstdio>
#include <string>

#include "apps/command.h"
#include "distributed/launcher.h"

namespace viaduct::apps {
namespace {

int launch_main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;
    if (a == "--help" || a == "-h") {
      std::fputs(distributed::launch_usage().c_str(), stdout);
      return 0;
    }
  }
  distributed::LaunchOptions options = distributed::parse_launch_args(argc, argv);
  distributed::LaunchResult result = distributed::launch(options);
  if (result.exit_code != 0) {
    std::fprintf(stderr, "viaduct launch: failed: %s (exit %d)\n",
                 result.message.c_str(), result.exit_code);
  }
  return result.exit_code;
}

}  // namespace

VIADUCT_COMMAND("launch",
                "start N local ranks of a command (torchrun-style environment)",
                launch_main);

}  // namespace viaduct::apps
