// Building this rank's model parts and stages (see rank_model.h).
#include "train/rank_model.h"

#include "distributed/distributed.h"
#include "kernels/weight_cache.h"
#include "model/family.h"
#include "pipeline/attn_res/attn_res_stage.h"
#include "train/expert_parallel.h"
#include "train/plan_spec.h"
#include "train/reduce.h"

namespace viaduct {

RankModel build_rank_model(const JobConfig& job, int pp_rank, at::Device device,
                           at::ScalarType compute_dtype, const ops::Capabilities& capabilities,
                           distributed::ProcessGroup* pp_group, const std::string& context,
                           distributed::ProcessGroup* ep_group) {
  RankModel rm;
  rm.kernel_options = kernel_options(job.model);
  rm.kernel_options.capabilities = capabilities;
  rm.kernel_options.weight_cache = std::make_shared<kernels::WeightCache>();
  // Written by the trainer each step (see Note [The loss's gradient scale
  // known to its forward], ops/options.h).
  rm.kernel_options.loss_grad_scale = std::make_shared<ops::LossGradScale>();
  rm.kernel_options.loss_grad_scale->value =
      at::ones({}, at::TensorOptions().dtype(at::kFloat).device(device));
  // The pipeline plan (a pure function of the config: every rank agrees).
  rm.info = describe_model(job);
  auto plan_spec = plan_spec_from_config(job.parallelism, model_module_fqns(job));
  plan_spec.module_flops = rm.info.module_flops;  // See Note [Bubble weighted by FLOPs]
  rm.plan = std::make_unique<pipeline::PipelinePlan>(pipeline::make_pipeline_plan(plan_spec));
  const auto& split = rm.plan->split;
  const auto seed = static_cast<uint64_t>(job.training.seed);
  std::vector<double> counts(static_cast<size_t>(split.num_stages), 0.0);
  const auto attn_res = attn_res_layout(job);  // nullopt: a chain model
  if (split.num_stages > 1 && attn_res) {
    // See Note [AttnRes transports] (pipeline/attn_res/block_layout.h). A chain
    // (kimi_k3 with model.attn_res = false among them) runs plain stages.
    rm.attn_res_tables = std::make_shared<const pipeline::BlockLayoutTables>(
        pipeline::make_block_layout_tables(
            split, attn_res->block_size,
            job.parallelism.attn_res_cache
                ? pipeline::AttnResTransport::kRankCache
                : pipeline::AttnResTransport::kWholeStack,
            pipeline::cache_backward_from_name(
                job.parallelism.attn_res_cache_backward)));
    rm.attn_res_store = std::make_shared<pipeline::RankBlockStore>(
        pp_rank, *rm.attn_res_tables, job.parallelism.attn_res_cache_offload);
  }
  for (int64_t s : split.rank_to_stages.at(pp_rank)) {
    auto part = build_model_part(
        job, split.num_stages == 1 ? std::vector<std::string>{} : split.stage_modules.at(s));
    ops::set_kernel_options(*part, rm.kernel_options);  // the config's, completed
    if (ep_group != nullptr) {
      if (!rm.expert_stats) rm.expert_stats = std::make_shared<ExpertExchangeStats>();
      shard_moe_experts(*part, *ep_group, str("rank ", ep_group->global_rank(ep_group->rank())),
                        rm.expert_stats,
                        job.parallelism.expert_gradient_sum == "replica_order");
    }
    part->init_weights(seed);
    part->to(device);
    part->set_compute_dtype(compute_dtype);
    auto named = named_params_for_training(*part);
    for (const auto& shard : expert_shards(*part)) {
      for (auto& np : named) {
        if (np.fqn != shard.fqn) continue;
        np.first_row = shard.first_row;
        np.whole_rows = shard.whole_rows;
      }
    }
    counts[static_cast<size_t>(s)] = static_cast<double>(named.size());
    rm.params.insert(rm.params.end(), named.begin(), named.end());
    rm.parts.push_back(part);
    rm.stages.push_back(pipeline::make_stage(s, split.num_stages, part, rm.attn_res_tables,
                                             rm.attn_res_store));
  }
  // Global FQN order = stage order, then each part's registration order.
  sum_over(pp_group, counts, context, "parameter counts");
  std::vector<int64_t> stage_offset(counts.size() + 1, 0);
  for (size_t s = 0; s < counts.size(); ++s)
    stage_offset[s + 1] = stage_offset[s] + static_cast<int64_t>(counts[s]);
  rm.total_param_tensors = stage_offset.back();
  for (int64_t s : split.rank_to_stages.at(pp_rank))
    rm.param_offsets.push_back(stage_offset[static_cast<size_t>(s)]);
  return rm;
}

}  // namespace viaduct
