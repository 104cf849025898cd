// The [parallelism] config keys -> PlanSpec, and the checks of those keys
// that need the schedule table (config/ sits below pipeline/ and cannot
// make them). Header-only so the pure plan library stays free of the config
// library; include it where a Config is at hand (the commands, the runtime).
// `model_fqns` is the model's ordered module list (model_module_fqns(cfg) in
// model/model.h).
#pragma once

#include <string>
#include <vector>

#include "config/config.h"
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
inline void validate_plan_config(const Config& cfg) {
  if (!cfg.get_string("parallelism.pipeline_parallel_schedule_csv").empty()) return;
  const auto type =
      schedule_type_from_name(cfg.get_string("parallelism.pipeline_parallel_schedule"));
  const auto& tr = schedule_traits(type);
  const auto spr = cfg.get_int_opt("parallelism.pipeline_parallel_stages_per_rank");
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

inline PlanSpec plan_spec_from_config(const Config& cfg,
                                      const std::vector<std::string>& model_fqns) {
  validate_plan_config(cfg);
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
