// The [parallelism] section -> the pure plan's PlanSpec, and the checks of
// those keys that need the schedule table (config/ sits below pipeline/ and
// cannot make them; pipeline/ takes no config). Every command that takes a
// config runs validate_plan_config at load (apps/command.cpp), and so does
// plan_spec_from_config.
#pragma once

#include <string>
#include <vector>

#include "config/job_config.h"
#include "pipeline/schedule/plan.h"

namespace viaduct {

// The schedule keys against the schedule table: an unknown
// parallelism.pipeline_parallel_schedule is refused with the closest valid
// name, and parallelism.pipeline_parallel_stages_per_rank outside what the
// schedule runs with the range it takes. A CSV schedule brings its own
// stages, so nothing is checked then. Throws ConfigError.
void validate_plan_config(const ParallelismSection& parallelism);

// `model_fqns` is the model's ordered module list (model_module_fqns in
// model/model.h).
pipeline::PlanSpec plan_spec_from_config(const ParallelismSection& parallelism,
                                         const std::vector<std::string>& model_fqns);

}  // namespace viaduct
