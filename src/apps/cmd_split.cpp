// `viaduct split`: the pipeline split a config gives — per stage its id, its
// rank and its top-level modules — without building the model.
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "apps/command.h"
#include "config/job_config.h"
#include "core/check.h"
#include "model/model.h"

namespace viaduct::apps {
namespace {

constexpr const char* kUsage =
    "usage: viaduct split --config FILE [--section.key=value ...] [--json]\n"
    "\n"
    "Prints the pipeline split: per stage its id, rank, layers and modules.\n"
    "The layer count comes from the config (--model.n_layers=33 overrides it).\n"
    "  --json   {\"stages\":[{\"stage\":0,\"rank\":0,\"modules\":[...]},...]}\n";

std::string layers_text(const std::pair<int64_t, int64_t>& range) {
  if (range.first == range.second) return "-";
  if (range.second - range.first == 1) return std::to_string(range.first);
  return str(range.first, "..", range.second - 1);
}

int split_main(int argc, char** argv) {
  const auto cmd = parse_config_command(argc, argv, "split", kUsage, {"--json"});
  if (!cmd) return 0;
  const bool json = cmd->has("--json");
  const auto plan = plan_for(cmd->job);
  const auto& sp = plan.split;
  if (json) {
    nlohmann::json stages = nlohmann::json::array();
    for (int64_t s = 0; s < sp.num_stages; ++s) {
      nlohmann::json j;
      j["stage"] = s;
      j["rank"] = sp.stage_to_rank[s];
      j["modules"] = sp.stage_modules[s];
      j["layers"] = {sp.stage_layers[s].first, sp.stage_layers[s].second};
      stages.push_back(j);
    }
    nlohmann::json out;
    out["stages"] = stages;
    out["pp"] = sp.pp;
    out["num_stages"] = sp.num_stages;
    out["stages_per_rank"] = sp.stages_per_rank;
    out["placement"] = pipeline::placement_name(sp.placement);
    out["n_layers"] = sp.n_layers;
    out["layer_to_stage"] = sp.layer_to_stage;
    out["schedule"] = plan.compute.name;
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  std::printf("%lld layers, %lld stages on %lld ranks (%lld per rank, %s placement), schedule %s\n",
              static_cast<long long>(sp.n_layers), static_cast<long long>(sp.num_stages),
              static_cast<long long>(sp.pp), static_cast<long long>(sp.stages_per_rank),
              pipeline::placement_name(sp.placement), plan.compute.name.c_str());
  std::printf("  stage  rank  layers      modules\n");
  for (int64_t s = 0; s < sp.num_stages; ++s) {
    std::string mods;
    for (const auto& m : sp.stage_modules[s]) mods += (mods.empty() ? "" : " ") + m;
    std::printf("  %5lld  %4lld  %-10s  %s\n", static_cast<long long>(s),
                static_cast<long long>(sp.stage_to_rank[s]),
                layers_text(sp.stage_layers[s]).c_str(), mods.c_str());
  }
  return 0;
}

}  // namespace

VIADUCT_COMMAND("split", "the pipeline split: modules per stage and stage -> rank",
                split_main);

}  // namespace viaduct::apps
