// make_pipeline_plan: the split and the schedule of a job (see plan.h).
#include "pipeline/schedule/plan.h"

#include <numeric>

#include "core/check.h"
#include "core/strings.h"
#include "pipeline/schedule/csv.h"

namespace viaduct::pipeline {

namespace {

// The stages' FLOPs per token and the simulation with costs in proportion
// to them (see Note [Bubble weighted by FLOPs]): a stage of `unit` FLOPs costs
// F 1, B 2 (default unit: the stages' mean). Splits compared by makespan
// share one unit, as their stage counts may differ.
void weigh_by_flops(PipelinePlan& plan, const std::map<std::string, double>& module_flops,
                    double unit = 0) {
  plan.stage_flops.clear();
  double total = 0;
  for (const auto& modules : plan.split.stage_modules) {
    double f = 0;
    for (const auto& fqn : modules) {
      if (auto it = module_flops.find(fqn); it != module_flops.end()) f += it->second;
    }
    plan.stage_flops.push_back(f);
    total += f;
  }
  if (total <= 0) return;
  CostModel costs;
  if (unit <= 0) unit = total / static_cast<double>(plan.stage_flops.size());
  for (double f : plan.stage_flops) costs.stage_scale.push_back(f / unit);
  plan.simulation_flops = simulate(plan.lowered, costs);
}

PipelinePlan rule_based_plan(const PlanSpec& spec, SplitSpec split, double unit = 0) {
  PipelinePlan plan;
  const ScheduleType type = schedule_type_from_name(spec.schedule);
  split.rule = stages_per_rank_rule(type);
  split.placement = schedule_traits(type).placement;
  plan.split = make_split(split);
  const int64_t m = spec.microbatches.value_or(split.pp * plan.split.stages_per_rank);
  plan.compute = generate_schedule(type, split.pp, plan.split.stages_per_rank, m);
  plan.lowered = lower_schedule(plan.compute);
  plan.simulation = simulate(plan.lowered);
  if (!spec.module_flops.empty()) weigh_by_flops(plan, spec.module_flops, unit);
  return plan;
}

// Note [Split balanced by FLOPs]
// Torchtitan's rule counts the embedding and
// the head as `first/last_stage_weight` layers each; where a vocabulary is
// large the head's stage is then the slowest, and the bubble is several
// times what unit costs predict. Every
// pair of weights in 0..4 that makes a valid split is simulated with stage
// costs by FLOPs; the smallest makespan wins, and on a tie the configured
// weights, then the pair found first (smaller weights first). Every
// candidate's costs use one FLOP unit (the configured split's mean stage),
// so makespans compare even where the stage count changes with the weights
// (pipeline_parallel_layers_per_stage).
std::optional<std::pair<std::pair<int64_t, int64_t>, PipelinePlan>> best_balanced(
    const PlanSpec& spec, double unit) {
  std::optional<std::pair<std::pair<int64_t, int64_t>, PipelinePlan>> best;
  std::vector<std::pair<int64_t, int64_t>> order{
      {spec.split.first_stage_weight, spec.split.last_stage_weight}};
  for (int64_t first = 0; first <= 4; ++first) {
    for (int64_t last = 0; last <= 4; ++last) order.emplace_back(first, last);
  }
  for (const auto& [first, last] : order) {
    SplitSpec split = spec.split;
    split.first_stage_weight = first;
    split.last_stage_weight = last;
    PipelinePlan plan;
    try {
      plan = rule_based_plan(spec, split, unit);
    } catch (const Error&) {
      continue;  // no valid split or schedule with these weights
    }
    if (!plan.simulation_flops) return std::nullopt;
    if (!best || plan.simulation_flops->makespan <
                     best->second.simulation_flops->makespan * (1 - 1e-12)) {
      best.emplace(std::make_pair(first, last), std::move(plan));
    }
  }
  return best;
}

}  // namespace

PipelinePlan make_pipeline_plan(const PlanSpec& spec) {
  PipelinePlan plan;
  SplitSpec split = spec.split;
  if (!spec.schedule_csv_path.empty()) {
    Schedule sch = load_schedule_csv(spec.schedule_csv_path, split.pp, 0,
                                     spec.microbatches.value_or(0));
    const int64_t S = sch.num_stages;
    VIADUCT_CHECK_T(ConfigError, S % split.pp == 0, spec.schedule_csv_path,
                    " runs ", S, " stages, not a multiple of ",
                    "parallelism.pipeline_parallel_degree = ", split.pp);
    const int64_t v = S / split.pp;
    split.rule = {"csv", v, 1, 0};
    if (sch.stage_to_rank == stage_to_rank_map(Placement::kLoop, split.pp, S)) {
      split.placement = Placement::kLoop;
    } else if (v == 2 &&
               sch.stage_to_rank == stage_to_rank_map(Placement::kV, split.pp, S)) {
      split.placement = Placement::kV;
    } else {
      split.placement = Placement::kCustom;
      split.custom_stage_to_rank = sch.stage_to_rank;
    }
    plan.split = make_split(split);
    VIADUCT_CHECK_T(ConfigError, plan.split.num_stages == S,
                    spec.schedule_csv_path, " runs ", S,
                    " stages but the split gives ", plan.split.num_stages,
                    "; drop the stage-count key or make them agree");
    if (sch.with_comms) {
      plan.lowered = sch;
      plan.compute = compute_only(sch);
    } else {
      plan.compute = sch;
      plan.lowered = lower_schedule(sch);
    }
    plan.simulation = simulate(plan.lowered);
    if (!spec.module_flops.empty()) weigh_by_flops(plan, spec.module_flops);
    VIADUCT_CHECK_T(ConfigError, !spec.balance_flops,
                    "parallelism.pipeline_parallel_balance = \"flops\" chooses a rule-based "
                    "split; a CSV schedule (", spec.schedule_csv_path, ") fixes its own");
    return plan;
  }
  const bool rule_based = !split.module_fqns_per_stage.has_value();
  VIADUCT_CHECK_T(ConfigError, !spec.balance_flops || rule_based,
                  "parallelism.pipeline_parallel_balance = \"flops\" chooses the split; "
                  "parallelism.module_fqns_per_model_part already fixes it");
  VIADUCT_CHECK_T(ConfigError, !spec.balance_flops || !spec.module_flops.empty(),
                  "parallelism.pipeline_parallel_balance = \"flops\" needs the model's "
                  "per-module FLOPs, which this model family does not give");
  plan = rule_based_plan(spec, split);
  if (rule_based && !spec.module_flops.empty() && plan.simulation_flops) {
    const double unit =
        std::accumulate(plan.stage_flops.begin(), plan.stage_flops.end(), 0.0) /
        static_cast<double>(plan.stage_flops.size());
    if (auto best = best_balanced(spec, unit)) {
      if (spec.balance_flops) {
        auto chosen = std::move(best->second);
        chosen.balanced_weights = best->first;
        chosen.balanced_bubble_flops = chosen.simulation_flops->bubble_fraction;
        chosen.balanced = true;
        return chosen;
      }
      plan.balanced_weights = best->first;
      plan.balanced_bubble_flops = best->second.simulation_flops->bubble_fraction;
    }
  }
  return plan;
}

std::string timeline_title(const PipelinePlan& plan) {
  return str(plan.compute.name, ": pp ", plan.split.pp, ", ",
             count_of(plan.split.stages_per_rank, "stage"), " per rank, ",
             count_of(plan.compute.microbatches, "micro-batch", "micro-batches"));
}

}  // namespace viaduct::pipeline
