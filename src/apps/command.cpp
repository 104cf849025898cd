// The shared front ends of the commands (command.h): the config-taking
// commands' and the standalone commands' options of one value.
#include <algorithm>
#include <cstdio>

#include "apps/command.h"
#include "core/check.h"
#include "model/family.h"
#include "model/model.h"
#include "train/plan_spec.h"

namespace viaduct::apps {

std::optional<ConfigCommand> parse_config_command(
    int argc, char** argv, const std::string& name, const char* usage,
    const std::vector<std::string>& allowed_flags,
    const std::vector<std::string>& valued_options) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(usage, stdout);
      return std::nullopt;
    }
  }
  auto args = parse_command_line(argc, argv, 1, valued_options);
  ConfigCommand out;
  for (const auto& f : args.flags) {
    bool known = false;
    for (const auto& ok : allowed_flags) known = known || f == ok;
    VIADUCT_CHECK_T(ConfigError, known, name, ": unknown option ", f, "\n", usage);
    out.flags.insert(f);
  }
  VIADUCT_CHECK_T(ConfigError, args.positional.empty(), name,
                  ": unexpected argument '",
                  args.positional.empty() ? "" : args.positional[0], "'\n", usage);
  out.options = args.options;
  out.job = JobConfig::load(args.config_path, args.overrides);
  // What config/ cannot check alone, at load as for every other key: the
  // family and its flavor (the model registry), the schedule keys (the
  // schedule table).
  const auto& family = model_family(out.job);
  validate_plan_config(out.job.parallelism);
  // What the split's parts need of the model (tied embeddings in one part),
  // so that every command refuses what `train` would.
  if (family.check_part) {
    const auto plan = plan_for(out.job);
    for (const auto& modules : plan.split.stage_modules) family.check_part(out.job, modules);
  }
  return out;
}

pipeline::PipelinePlan plan_for(const JobConfig& job) {
  auto spec = plan_spec_from_config(job.parallelism, model_module_fqns(job));
  spec.module_flops = describe_model(job).module_flops;
  return pipeline::make_pipeline_plan(spec);
}

std::optional<ValuedOption> valued_option(int argc, char** argv, int& i,
                                          const std::vector<std::string>& valued,
                                          const std::string& command, const char* usage) {
  const std::string arg = argv[i];
  ValuedOption o{arg, ""};
  bool has_value = false;
  if (auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
    o.name = arg.substr(0, eq);
    o.value = arg.substr(eq + 1);
    has_value = true;
  }
  if (std::find(valued.begin(), valued.end(), o.name) == valued.end()) {
    std::fprintf(stderr, "viaduct %s: unknown argument '%s'\n\n%s", command.c_str(), arg.c_str(),
                 usage);
    return std::nullopt;
  }
  if (!has_value) {
    VIADUCT_CHECK_T(ConfigError, i + 1 < argc, o.name, " needs a value");
    o.value = argv[++i];
  }
  return o;
}

}  // namespace viaduct::apps
