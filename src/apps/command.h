// The `viaduct` command's subcommands. Each command file registers itself
// with a static VIADUCT_COMMAND(...) line; main.cpp dispatches by name.
#pragma once

#include <functional>
#include <string>

namespace viaduct::apps {

// argv[0] is the subcommand name; returns the process exit code.
using CommandFn = std::function<int(int argc, char** argv)>;

struct CommandRegistrar {
  CommandRegistrar(const std::string& name, const std::string& summary,
                   CommandFn fn);
};

}  // namespace viaduct::apps

#define VIADUCT_COMMAND_CAT2(a, b) a##b
#define VIADUCT_COMMAND_CAT(a, b) VIADUCT_COMMAND_CAT2(a, b)
#define VIADUCT_COMMAND(name, summary, fn)                         \
  static ::viaduct::apps::CommandRegistrar VIADUCT_COMMAND_CAT( \
      viaduct_command_, __LINE__)(name, summary, fn)
