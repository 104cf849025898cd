// The [parallelism] section -> PlanSpec, and the checks of those keys
// that need the schedule table (config/ sits below pipeline/ and cannot
// make them). Header-only so the pure plan library stays free of the config
// library; include it where a JobConfig is at hand (the commands, the
// runtime). `model_fqns` is the model's ordered module list
// (model_module_fqns(job) in model/model.h).
#pragma once

#include <string>
#include <vector>

#include "config/job_config.h"
#include "core/check.h"
#include "pipeline/schedule/plan.h"
#include "pipeline/schedule/schedule.h"

namespace viaduct::pipeline {

// The schedule keys against the schedule table: an unknown
// parallelism.pipeline_parallel_schedule is refused with the closest valid
// name, and parallelism.pipeline_parallel_stages_per_rank outside what the
// schedule runs with the range it takes. A CSV schedule brings its own
// stages, so nothing is checked then. Throws ConfigError. Every command that
// takes a config runs it at load (apps/command.cpp), and so does
// plan_spec_from_config.
inline void validate_plan_config(const ParallelismSection& p) {
  if (!p.pipeline_parallel_schedule_csv.empty()) return;
  const auto type = schedule_type_from_name(p.pipeline_parallel_schedule);
  const auto& tr = schedule_traits(type);
  const auto& spr = p.pipeline_parallel_stages_per_rank;
  if (!spr) return;
  const bool ok = *spr >= tr.min_stages_per_rank &&
                  (tr.max_stages_per_rank == 0 || *spr <= tr.max_stages_per_rank);
  VIADUCT_CHECK_T(ConfigError, ok, "parallelism.pipeline_parallel_stages_per_rank = ", *spr,
                  " but schedule ", tr.name, " runs ",
                  tr.min_stages_per_rank == tr.max_stages_per_rank
                      ? str("exactly ", tr.min_stages_per_rank)
                      : str("at least ", tr.min_stages_per_rank),
                  " stage(s) per rank",
                  tr.single_stage ? "; for several use Interleaved1F1B" : "");
}

inline PlanSpec plan_spec_from_config(const ParallelismSection& p,
                                      const std::vector<std::string>& model_fqns) {
  validate_plan_config(p);
  PlanSpec spec;
  spec.split.model = model_layout_from_fqns(model_fqns);
  spec.split.pp = p.pipeline_parallel_degree;
  spec.split.first_stage_weight = p.pipeline_parallel_first_stage_less_layers;
  spec.split.last_stage_weight = p.pipeline_parallel_last_stage_less_layers;
  spec.split.layers_per_stage = p.pipeline_parallel_layers_per_stage;
  spec.split.stages_per_rank = p.pipeline_parallel_stages_per_rank;
  if (p.module_fqns_per_model_part) {
    spec.split.module_fqns_per_stage = *p.module_fqns_per_model_part;
  }
  spec.schedule = p.pipeline_parallel_schedule;
  spec.schedule_csv_path = p.pipeline_parallel_schedule_csv;
  spec.microbatches = p.pipeline_parallel_microbatches;
  spec.balance_flops = p.pipeline_parallel_balance == "flops";
  return spec;
}

}  // namespace viaduct::pipeline
