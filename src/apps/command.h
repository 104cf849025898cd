// The `viaduct` command's subcommands. Each command file registers itself
// with a static VIADUCT_COMMAND(...) line; main.cpp dispatches by name.
#pragma once

#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "config/config.h"
#include "config/job_config.h"
#include "pipeline/schedule/plan.h"

namespace viaduct::apps {

// The front end shared by the commands that take a job config:
// `--config F`, `--section.key=value` overrides, and the command's own flags
// (no value) and options (one value).
struct ConfigCommand {
  JobConfig job;  // the loaded config's sections; job.raw() is the store
  std::set<std::string> flags;                 // given flags, e.g. "--json"
  std::map<std::string, std::string> options;  // e.g. "--svg" -> FILE
  bool has(const std::string& flag) const { return flags.count(flag) != 0; }
};

// Prints `usage` and returns nullopt for --help / -h. An unknown flag or a
// stray argument is a ConfigError naming it, followed by `usage`. The config
// is loaded and checked as a whole: its keys (config/), its model family
// and flavor (model/family.h) and its schedule (train/plan_spec.h), then
// parsed once into the JobConfig the command hands down.
std::optional<ConfigCommand> parse_config_command(
    int argc, char** argv, const std::string& name, const char* usage,
    const std::vector<std::string>& allowed_flags,
    const std::vector<std::string>& valued_options = {});

// A standalone command's option of one value at argv[i]: `--name=value`, or
// `--name value` (i then moves past the value). nullopt where the name is
// not among `valued`, after "viaduct <command>: unknown argument 'ARG'" and
// `usage` went to stderr (the caller exits 2); a ConfigError naming the
// option where its value is missing.
struct ValuedOption {
  std::string name, value;
};
std::optional<ValuedOption> valued_option(int argc, char** argv, int& i,
                                          const std::vector<std::string>& valued,
                                          const std::string& command, const char* usage);

// The job's pipeline plan as the trainer makes it, with the model's module
// FLOPs (see Note [Bubble weighted by FLOPs]).
pipeline::PipelinePlan plan_for(const JobConfig& job);

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
