// make_pipeline_plan: the split and the schedule of a job (see plan.h).
#include "pipeline/schedule/plan.h"

#include "core/check.h"
#include "pipeline/schedule/csv.h"

namespace viaduct::pipeline {

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
  } else {
    const ScheduleType type = schedule_type_from_name(spec.schedule);
    split.rule = stages_per_rank_rule(type);
    split.placement = schedule_traits(type).placement;
    plan.split = make_split(split);
    const int64_t m =
        spec.microbatches.value_or(split.pp * plan.split.stages_per_rank);
    plan.compute =
        generate_schedule(type, split.pp, plan.split.stages_per_rank, m);
    plan.lowered = lower_schedule(plan.compute);
  }
  plan.simulation = simulate(plan.lowered);
  if (!spec.module_flops.empty()) {
    double total = 0;
    for (const auto& modules : plan.split.stage_modules) {
      double f = 0;
      for (const auto& fqn : modules) {
        if (auto it = spec.module_flops.find(fqn); it != spec.module_flops.end()) f += it->second;
      }
      plan.stage_flops.push_back(f);
      total += f;
    }
    if (total > 0) {
      CostModel costs;
      const double mean = total / static_cast<double>(plan.stage_flops.size());
      for (double f : plan.stage_flops) costs.stage_scale.push_back(f / mean);
      plan.simulation_flops = simulate(plan.lowered, costs);
    }
  }
  return plan;
}

}  // namespace viaduct::pipeline
