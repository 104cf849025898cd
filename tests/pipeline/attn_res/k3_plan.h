// The pipeline plan of a kimi_k3 model as the trainer computes it, for the
// multi-process AttnRes tests that check measured bytes against the tables.
#pragma once

#include <string>
#include <vector>

#include "pipeline/schedule/plan.h"

namespace viaduct::testing {

inline pipeline::PipelinePlan k3_plan(int64_t layers, int64_t pp, int64_t spr, int64_t micro) {
  std::vector<std::string> fqns{"tok_embeddings"};
  for (int64_t i = 0; i < layers; ++i) fqns.push_back("layers." + std::to_string(i));
  fqns.insert(fqns.end(), {"norm", "lm_head", "attn_res_final"});
  pipeline::PlanSpec spec;
  spec.split.model = pipeline::model_layout_from_fqns(fqns);
  spec.split.pp = pp;
  spec.split.stages_per_rank = spr;
  spec.schedule = "Interleaved1F1B";
  spec.microbatches = micro;
  return pipeline::make_pipeline_plan(spec);
}

}  // namespace viaduct::testing
