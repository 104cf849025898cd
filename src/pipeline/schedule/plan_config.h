// The [parallelism] config keys -> PlanSpec. Header-only so the pure plan
// library stays free of the config library; include it where a Config is at
// hand (the commands, the runtime). `model_fqns` is the model's ordered
// module list (model_module_fqns(cfg) in model/model.h).
#pragma once

#include <string>
#include <vector>

#include "config/config.h"
#include "pipeline/schedule/plan.h"

namespace viaduct::pipeline {

inline PlanSpec plan_spec_from_config(const Config& cfg,
                                      const std::vector<std::string>& model_fqns) {
  PlanSpec spec;
  spec.split.model = model_layout_from_fqns(model_fqns);
  spec.split.pp = cfg.get_int("parallelism.pipeline_parallel_degree");
  spec.split.first_stage_weight =
      cfg.get_int("parallelism.pipeline_parallel_first_stage_less_layers");
  spec.split.last_stage_weight =
      cfg.get_int("parallelism.pipeline_parallel_last_stage_less_layers");
  spec.split.layers_per_stage =
      cfg.get_int_opt("parallelism.pipeline_parallel_layers_per_stage");
  spec.split.stages_per_rank =
      cfg.get_int_opt("parallelism.pipeline_parallel_stages_per_rank");
  if (cfg.is_set("parallelism.module_fqns_per_model_part")) {
    spec.split.module_fqns_per_stage =
        cfg.get_string_list_list("parallelism.module_fqns_per_model_part");
  }
  spec.schedule = cfg.get_string("parallelism.pipeline_parallel_schedule");
  spec.schedule_csv_path =
      cfg.get_string("parallelism.pipeline_parallel_schedule_csv");
  spec.microbatches =
      cfg.get_int_opt("parallelism.pipeline_parallel_microbatches");
  spec.balance_flops = cfg.get_string("parallelism.pipeline_parallel_balance") == "flops";
  return spec;
}

}  // namespace viaduct::pipeline
