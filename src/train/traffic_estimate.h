// What one pipeline rank sends over the data-parallel and expert-parallel
// groups in a step, from the config alone (`viaduct plan`).
//
// Note [Data-parallel and expert traffic estimate]
// Gradient sums (fp32, see Notes [Data-parallel sum in a fixed order] and
// [Expert gradient sum]): the rank's dense share G (parameters / pp less
// the routed experts) moves 2 (dp - 1) / dp G -- a reduce-scatter and an
// all-gather, of the sums or (ZeRO-1) of the updated weights; its expert
// share X (routed experts / pp / ep) moves (ep + 1) (m - 1) / m X with m =
// dp / ep replicas of each expert: every source's range out, the summed
// range back (at ep = 1 that is the dense rule; at ep = dp, nothing).
// All-to-all: each MoE layer on the rank moves each token copy (N K rows of
// D in the compute dtype, N the micro-batch's tokens) out and back in the
// forward and again in the backward, of which (ep - 1) / ep leave the rank
// under an even routing: 4 N K D (ep - 1) / ep bytes per layer and
// micro-batch; a checkpointed layer's recompute adds its forward's two.
#pragma once

#include <cstdint>

#include <torch/torch.h>

#include "model/model.h"
#include "pipeline/schedule/plan.h"

namespace viaduct {

struct JobConfig;

struct TrafficEstimate {
  int64_t moe_layers = 0;  // on the rank
  double alltoall_bytes_per_microbatch = 0;
  double alltoall_bytes_per_step = 0;
  double dense_reduce_bytes_per_step = 0;
  double expert_reduce_bytes_per_step = 0;
};

TrafficEstimate estimate_rank_traffic(const JobConfig& job, const ModelInfo& info,
                                      const pipeline::PipelinePlan& plan, int64_t pp_rank,
                                      at::ScalarType compute_dtype);

}  // namespace viaduct
