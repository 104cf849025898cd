// See Note [Data-parallel and expert traffic estimate] (traffic_estimate.h).
#include "train/traffic_estimate.h"

#include "config/job_config.h"
#include "core/check.h"

namespace viaduct {

TrafficEstimate estimate_rank_traffic(const JobConfig& job, const ModelInfo& info,
                                      const pipeline::PipelinePlan& plan, int64_t pp_rank,
                                      at::ScalarType compute_dtype) {
  const auto& split = plan.split;
  VIADUCT_CHECK(pp_rank >= 0 && pp_rank < split.pp, "traffic estimate: pp rank ", pp_rank,
                " outside [0, ", split.pp, ")");
  TrafficEstimate t;
  const double dp = static_cast<double>(job.parallelism.data_parallel_degree);
  const double ep = info.routed_expert_params > 0
                        ? static_cast<double>(job.parallelism.expert_parallel_degree)
                        : 1.0;
  const double pp = static_cast<double>(split.pp);
  const double experts = static_cast<double>(info.routed_expert_params) / pp;
  const double dense = static_cast<double>(info.params) / pp - experts;
  t.dense_reduce_bytes_per_step = 2.0 * (dp - 1.0) / dp * dense * 4.0;
  const double members = dp / ep;
  t.expert_reduce_bytes_per_step =
      (ep + 1.0) * (members - 1.0) / members * experts / ep * 4.0;

  const auto ac = activation_checkpoint(job.activation_checkpoint);
  int64_t recomputed = 0;
  for (int64_t s : split.rank_to_stages.at(static_cast<size_t>(pp_rank))) {
    const auto [first, end] = split.stage_layers.at(static_cast<size_t>(s));
    for (int64_t l = first; l < end && l < static_cast<int64_t>(info.layers.size()); ++l) {
      if (info.layers[static_cast<size_t>(l)].ffn != "moe") continue;
      ++t.moe_layers;
      if (ac.checkpoints(l)) ++recomputed;
    }
  }
  const int64_t microbatches =
      split.pp > 1 ? plan.compute.microbatches
                   : job.parallelism.pipeline_parallel_microbatches.value_or(1);
  const double tokens =
      static_cast<double>(job.training.local_batch_size / microbatches *
                          job.training.seq_len);
  const double copies = tokens * static_cast<double>(info.experts_per_token);
  const double row = static_cast<double>(info.dim * c10::elementSize(compute_dtype));
  const double per_pass = copies * row * (ep - 1.0) / ep;  // one direction of one exchange
  t.alltoall_bytes_per_microbatch =
      per_pass * (4.0 * static_cast<double>(t.moe_layers) + 2.0 * static_cast<double>(recomputed));
  t.alltoall_bytes_per_step = t.alltoall_bytes_per_microbatch *
                              static_cast<double>(microbatches) *
                              static_cast<double>(job.training.gradient_accumulation_steps);
  return t;
}

}  // namespace viaduct
