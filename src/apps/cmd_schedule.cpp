// `viaduct schedule`: the pipeline schedule a config gives — per rank its
// compute actions in order — with the simulator's makespan, bubble and peak
// activations; as text, JSON, torch's CSV, or an SVG timeline.
#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "apps/command.h"
#include "config/job_config.h"
#include "core/check.h"
#include "model/model.h"
#include "pipeline/schedule/csv.h"
#include "pipeline/schedule/timeline_svg.h"

namespace viaduct::apps {
namespace {

constexpr const char* kUsage =
    "usage: viaduct schedule --config FILE [--section.key=value ...]\n"
    "                        [--json | --csv | --lowered | --svg FILE]\n"
    "\n"
    "Prints each rank's compute actions in order (torch's text form: 2F0 =\n"
    "stage 2 forward of micro-batch 0) and the simulated makespan, bubble and\n"
    "peak live activations (unit costs: F = I = W = 1, B = 2).\n"
    "  --json      {\"ranks\":[[\"0F0\",...],...],\"bubble\":...,...}\n"
    "  --csv       torch's schedule CSV (one row per rank, compute only)\n"
    "  --lowered   also print the sends and receives\n"
    "  --svg FILE  write the timeline picture to FILE\n";

int schedule_main(int argc, char** argv) {
  const auto cmd = parse_config_command(argc, argv, "schedule", kUsage,
                                        {"--json", "--csv", "--lowered"}, {"--svg"});
  if (!cmd) return 0;
  const bool json = cmd->has("--json"), csv = cmd->has("--csv"),
             lowered = cmd->has("--lowered");
  VIADUCT_CHECK_T(ConfigError, !(json && csv), "schedule: --json and --csv exclude each other");
  const auto plan = plan_for(cmd->job);
  const auto& sim = plan.simulation;
  const auto& shown = lowered ? plan.lowered : plan.compute;

  if (auto it = cmd->options.find("--svg"); it != cmd->options.end()) {
    const std::string title = pipeline::timeline_title(plan);
    std::ofstream out(it->second, std::ios::binary);
    VIADUCT_CHECK_T(FileError, out.good(), "cannot write '", it->second, "'");
    out << pipeline::timeline_svg(plan.lowered, sim, title);
    out.close();
    VIADUCT_CHECK_T(FileError, out.good(), "failed writing '", it->second, "'");
    if (!json && !csv) {
      std::printf("wrote %s (bubble %.1f%%)\n", it->second.c_str(),
                  100.0 * sim.bubble_fraction);
      return 0;
    }
  }
  if (csv) {
    std::fputs(pipeline::schedule_to_csv(shown).c_str(), stdout);
    return 0;
  }
  if (json) {
    nlohmann::json ranks = nlohmann::json::array();
    for (const auto& r : shown.ranks) {
      nlohmann::json row = nlohmann::json::array();
      for (const auto& a : r) row.push_back(pipeline::to_string(a));
      ranks.push_back(row);
    }
    nlohmann::json out;
    out["schedule"] = plan.compute.name;
    out["pp"] = plan.split.pp;
    out["num_stages"] = plan.split.num_stages;
    out["microbatches"] = plan.compute.microbatches;
    out["stage_to_rank"] = plan.split.stage_to_rank;
    out["ranks"] = ranks;
    out["bubble"] = sim.bubble_fraction;
    if (plan.simulation_flops) {
      out["bubble_flops"] = plan.simulation_flops->bubble_fraction;
      out["stage_flops_per_token"] = plan.stage_flops;
    }
    if (plan.balanced_weights) {
      out["balanced_weights"] = {plan.balanced_weights->first, plan.balanced_weights->second};
      out["balanced_bubble_flops"] = plan.balanced_bubble_flops;
    }
    out["makespan"] = sim.makespan;
    out["peak_activations"] = sim.peak_activations;
    out["messages"] = sim.messages;
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  std::printf("%s: pp %lld, %lld stages (%lld per rank), %lld micro-batches\n",
              plan.compute.name.c_str(), static_cast<long long>(plan.split.pp),
              static_cast<long long>(plan.split.num_stages),
              static_cast<long long>(plan.split.stages_per_rank),
              static_cast<long long>(plan.compute.microbatches));
  std::fputs(pipeline::schedule_to_text(shown).c_str(), stdout);
  std::printf("makespan %.1f, bubble %.2f%%, %lld messages, peak activations per rank:",
              sim.makespan, 100.0 * sim.bubble_fraction,
              static_cast<long long>(sim.messages));
  for (auto p : sim.peak_activations) std::printf(" %lld", static_cast<long long>(p));
  std::printf("\n");
  if (plan.simulation_flops) {
    // See Note [Bubble weighted by FLOPs]
    std::printf("with stage costs in proportion to their FLOPs: bubble %.2f%% (stage GFLOP per "
                "token:",
                100.0 * plan.simulation_flops->bubble_fraction);
    for (double f : plan.stage_flops) std::printf(" %.3g", f / 1e9);
    std::printf(")\n");
  }
  if (plan.balanced_weights) {
    // See Note [Split balanced by FLOPs]
    std::printf("%s: the embedding counts %lld layer(s), the head %lld; bubble by FLOPs %.2f%%\n",
                plan.balanced ? "split balanced by FLOPs"
                        : "with parallelism.pipeline_parallel_balance = \"flops\"",
                static_cast<long long>(plan.balanced_weights->first),
                static_cast<long long>(plan.balanced_weights->second),
                100.0 * plan.balanced_bubble_flops);
  }
  return 0;
}

}  // namespace

VIADUCT_COMMAND("schedule", "the pipeline schedule: per-rank actions, bubble, SVG timeline",
                schedule_main);

}  // namespace viaduct::apps
