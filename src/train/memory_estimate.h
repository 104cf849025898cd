// The memory one rank of a run needs, estimated from the config before
// anything is allocated, and the refusal of a run that cannot fit.
//
// Note [Activation memory estimate]
// Per rank: weights (the fp32 master, plus under bf16 the low-precision copy
// the weight cache keeps of every weight but the embeddings, which are read
// by row), fp32 gradients and AdamW's two fp32 moments for an even share of
// the parameters over the pipeline ranks -- the moments divided by
// parallelism.data_parallel_degree under parallelism.dp_shard_optimizer
// (ZeRO-1: each dp rank keeps the moments of its slice of every gradient
// bucket; master weights and gradients stay whole), the routed experts'
// share of all three divided by parallelism.expert_parallel_degree (Note
// [Expert parallelism], model/moe.h) -- the gradients' but for the copy per
// source rank that parallelism.expert_gradient_sum = replica_order holds;
// activations kept for the
// backward at the schedule's peak -- the most micro-batches the plan's
// simulation holds in flight on the rank (1 in one process, up to pp for
// 1F1B on the first rank, more for interleaved schedules) times the largest
// of the rank's stages' kept values per token (LayerInfo::saved_values_per_token,
// from each family's shapes) times the micro-batch's tokens, in the compute
// dtype; on the head's rank the loss buffer (fp32 log-probabilities and their
// gradient, [rows, V] x 8 bytes, rows = the micro-batch's tokens or one chunk
// of them under see Note [Chunked head loss]); and the backward's working set
// when it starts (backward_transient): the head's weight gradient (fp32, on
// the head's rank) and the gradients of one layer's activations, counted as
// the rank's largest layer in full.
//
// The parts are not all live at once. The loss buffer is gone when the
// layers' backward starts, so the two count as their larger. Gradients are
// freed after each optimizer step (Optimizer::zero_grad): in one process
// with one micro-batch and no accumulation they grow during the backward as
// the activations are freed, so the peak is the larger of the end of the
// forward (activations and the larger of loss and transient) and the end of
// the backward (gradients); with several micro-batches a rank (pipeline or
// accumulation) holds a whole set of gradients while later micro-batches'
// activations are kept, so the two add.
//
// Under activation checkpointing a checkpointed layer keeps its input alone
// (D values per token; under selective_ac_option = "op" plus its expensive
// ops' outputs, LayerInfo::op_output_values_per_token, see Note [Per-op
// activation checkpointing]) and the rank adds one recomputed layer, once:
// layers are recomputed one at a time, and a recompute materialises what the
// layer did not keep (under "op" the kept outputs are reused); a schedule
// that splits the backward (zero bubble) keeps a micro-batch's recomputed
// layers from its I to its W, so there checkpointed layers count in full.
// It is an estimate: temporaries inside an op, attention scores where a
// backend materialises them, the allocator's slack and the CUDA context are
// not in it; it is meant to refuse runs that cannot fit, not to promise a
// fit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "model/model.h"
#include "pipeline/schedule/plan.h"

namespace viaduct {

struct JobConfig;

struct MemoryEstimate {
  // Bytes on one rank.
  double weights = 0;
  double gradients = 0;
  double optimizer = 0;
  double activations = 0;  // kept for the backward at the schedule's peak
  double loss = 0;         // the head's logits / loss buffer (head's rank only)
  // Data-parallel ranks the optimizer state is divided over (1: unsharded).
  int64_t optimizer_shards = 1;
  // The routed experts' parameters on this rank (after expert parallelism)
  // and the ranks each layer's experts are split over; their bytes are
  // part of weights, gradients and optimizer.
  double expert_params = 0;
  int64_t expert_shards = 1;
  int64_t microbatches_in_flight = 0;
  int64_t tokens_per_microbatch = 0;
  double saved_values_per_token = 0;  // of the rank's widest stage
  // Activation checkpointing: what the largest layer recomputed at a time
  // adds while it is recomputed.
  double recompute_values_per_token = 0;
  // The backward's working set when it starts: the head's weight gradient
  // and the gradients of the largest layer's activations.
  double backward_transient = 0;
  // Whether a whole set of gradients is live while activations are kept
  // (several micro-batches on the rank, or accumulated batches).
  bool gradients_in_forward = true;
  // The peak (see the Note): the parts that are live together.
  double total() const {
    const double forward = activations + std::max(loss, backward_transient);
    return weights + optimizer +
           (gradients_in_forward ? gradients + forward : std::max(forward, gradients));
  }
};

// `plan` is the run's pipeline plan and `pp_rank` the rank estimated.
// `on_cuda` resolves model.loss_chunk_tokens = -1 (auto).
MemoryEstimate estimate_rank_memory(const JobConfig& job, const ModelInfo& info,
                                    const pipeline::PipelinePlan& plan, int64_t pp_rank,
                                    at::ScalarType compute_dtype, bool on_cuda);

// Every pp rank's estimate, indexed by pp rank.
std::vector<MemoryEstimate> estimate_memory_per_rank(const JobConfig& job, const ModelInfo& info,
                                                     const pipeline::PipelinePlan& plan,
                                                     at::ScalarType compute_dtype,
                                                     bool on_cuda);

// The share of the available memory above which a run that fits the
// estimate is warned about (the estimate's omissions need the rest).
constexpr double kNearLimitFraction = 0.9;

// Before anything is allocated: this rank's estimate from the config alone
// (the model described, the plan made as the rank model makes it), logged
// in one line against `available` bytes; throws ConfigError with the
// figures and the knobs that would make it fit when it does not; warns
// when it fits with less than a tenth of `available` to spare.
MemoryEstimate check_rank_memory_fits(const JobConfig& job, int64_t pp_rank,
                                      at::ScalarType compute_dtype, bool on_cuda,
                                      double available, const std::string& device_name);

// "12.5 MiB" below a GiB, else "1.50 GiB"
std::string format_gib(double bytes);
// One line: the total and its parts.
std::string describe_memory_estimate(const MemoryEstimate& e);

}  // namespace viaduct
