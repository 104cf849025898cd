// This rank's share of the model under the pipeline plan: the plan itself,
// the model parts of the stages this rank holds (initialised from
// training.seed, on the device, in the compute dtype), their pipeline stages,
// the AttnRes layout tables and block store where stages hand on AttnRes
// blocks, where each part's parameters sit in the global FQN order, and the
// options its ops run with -- among them the rank's weight cache.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "config/job_config.h"
#include "model/model.h"
#include "ops/options.h"
#include "pipeline/runtime/stage.h"
#include "pipeline/schedule/plan.h"
#include "train/optimizer.h"

namespace viaduct {

struct ExpertExchangeStats;
namespace distributed {
class ProcessGroup;
}  // namespace distributed
namespace pipeline {
class RankBlockStore;
struct BlockLayoutTables;
}  // namespace pipeline

struct RankModel {
  ModelInfo info;
  std::unique_ptr<pipeline::PipelinePlan> plan;
  std::vector<std::shared_ptr<ModelPart>> parts;  // in stage order
  std::vector<std::unique_ptr<pipeline::PipelineStage>> stages;
  std::vector<NamedParam> params;  // the parts' training parameters
  // Null unless a family with an AttnRes block stack (attn_res_layout,
  // model/family.h) runs over more than one stage.
  std::shared_ptr<const pipeline::BlockLayoutTables> attn_res_tables;
  std::shared_ptr<pipeline::RankBlockStore> attn_res_store;
  // Global index of each part's first parameter (global FQN order = stage
  // order, then each part's registration order) and the model's count.
  std::vector<int64_t> param_offsets;
  int64_t total_param_tensors = 0;
  // Under expert parallelism: what the MoE layers' exchanges moved.
  std::shared_ptr<ExpertExchangeStats> expert_stats;
  // What every part's modules run their ops with, and the optimizer its
  // kernel: the config's switches (kernel_options, model/model.h), the
  // capabilities probed at start-up, and this rank's weight cache
  // (see Note [Low-precision weight cache], kernels/weight_cache.h), made
  // here and freed with the last holder of these options.
  ops::KernelOptions kernel_options;
};

// `capabilities`: what the GEMMs take on `device` (ops::probe_capabilities,
// at start-up); `pp_group` sums the stages' parameter counts over the
// pipeline ranks (null: one process); `ep_group`, when set, shards every MoE
// layer's experts over it before the weights are initialised (see Note
// [Expert parallelism], model/moe.h); `context` names this rank in a
// timeout.
RankModel build_rank_model(const JobConfig& job, int pp_rank, at::Device device,
                           at::ScalarType compute_dtype, const ops::Capabilities& capabilities,
                           distributed::ProcessGroup* pp_group, const std::string& context,
                           distributed::ProcessGroup* ep_group = nullptr);

}  // namespace viaduct
