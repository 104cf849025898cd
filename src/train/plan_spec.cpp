// The [parallelism] section -> PlanSpec (see plan_spec.h).
#include "train/plan_spec.h"

#include "core/check.h"
#include "pipeline/schedule/schedule.h"

namespace viaduct {

void validate_plan_config(const ParallelismSection& p) {
  if (!p.pipeline_parallel_schedule_csv.empty()) return;
  const auto type = pipeline::schedule_type_from_name(p.pipeline_parallel_schedule);
  const auto& tr = pipeline::schedule_traits(type);
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

pipeline::PlanSpec plan_spec_from_config(const ParallelismSection& p,
                                         const std::vector<std::string>& model_fqns) {
  validate_plan_config(p);
  pipeline::PlanSpec spec;
  spec.split.model = pipeline::model_layout_from_fqns(model_fqns);
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

}  // namespace viaduct
