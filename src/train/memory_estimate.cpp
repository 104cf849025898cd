#include "train/memory_estimate.h"

#include <algorithm>
#include <cstdio>

#include "config/job_config.h"
#include "core/check.h"
#include "core/log.h"
#include "model/model.h"
#include "ops/cross_entropy.h"
#include "train/plan_spec.h"

namespace viaduct {

MemoryEstimate estimate_rank_memory(const JobConfig& job, const ModelInfo& info,
                                    const pipeline::PipelinePlan& plan, int64_t pp_rank,
                                    at::ScalarType compute_dtype, bool on_cuda) {
  const auto& split = plan.split;
  VIADUCT_CHECK(pp_rank >= 0 && pp_rank < split.pp, "memory estimate: pp rank ", pp_rank,
                " outside [0, ", split.pp, ")");
  MemoryEstimate e;
  // An even share of the parameters, of which the routed experts' part is
  // split again over the expert-parallel ranks.
  e.expert_shards = info.routed_expert_params > 0
                        ? job.parallelism.expert_parallel_degree
                        : 1;
  const double pp = static_cast<double>(split.pp);
  const double experts = static_cast<double>(info.routed_expert_params) / pp;
  e.expert_params = experts / static_cast<double>(e.expert_shards);
  const double params = static_cast<double>(info.params) / pp - experts + e.expert_params;
  const bool adamw = job.optimizer.name == "AdamW";
  const double elem = static_cast<double>(c10::elementSize(compute_dtype));
  // The fp32 master, and under bf16 the weight cache's copy of every weight
  // but the embeddings (read by row, never cast whole).
  const double cached =
      static_cast<double>(info.params - info.embedding_params) / pp - experts + e.expert_params;
  e.weights = params * 4.0 + (compute_dtype == at::kFloat ? 0.0 : cached * elem);
  // Under expert parallelism with parallelism.expert_gradient_sum =
  // replica_order the local experts' gradients are held once per source
  // rank until the step's sum (see Note [Expert gradient sum]).
  const bool per_source =
      e.expert_shards > 1 && job.parallelism.expert_gradient_sum == "replica_order";
  e.gradients = params * 4.0 +
                (per_source ? static_cast<double>(e.expert_shards - 1) * e.expert_params * 4.0
                            : 0.0);
  // ZeRO-1: each dp rank keeps the moments of ~1/dp of the parameters.
  if (adamw && job.parallelism.dp_shard_optimizer) {
    e.optimizer_shards = job.parallelism.data_parallel_degree;
  }
  // The experts' moments are split over their dp / ep replicas.
  const double shards = static_cast<double>(e.optimizer_shards);
  const double optimized =
      shards == 1 ? params
                  : (params - e.expert_params) / shards +
                        e.expert_params * static_cast<double>(e.expert_shards) / shards;
  e.optimizer = optimized * (adamw ? 8.0 : 0.0);

  // One process runs its micro-batches one after another; a pipeline holds
  // what the schedule's simulation says.
  const int64_t microbatches =
      split.pp > 1 ? plan.compute.microbatches
                   : job.parallelism.pipeline_parallel_microbatches.value_or(1);
  const int64_t batch = job.training.local_batch_size;
  e.tokens_per_microbatch =
      std::max<int64_t>(1, batch / std::max<int64_t>(1, microbatches)) *
      job.training.seq_len;
  e.microbatches_in_flight =
      split.pp > 1 ? plan.simulation.peak_activations.at(static_cast<size_t>(pp_rank)) : 1;
  // Activation checkpointing: a checkpointed layer keeps its input per
  // micro-batch in flight, and one layer at a time is recomputed in full.
  // A schedule that splits the backward (zero bubble) keeps the recomputed
  // layers of a micro-batch from its I to its W, so there they count in full.
  bool splits_backward = false;
  if (static_cast<size_t>(pp_rank) < plan.compute.ranks.size()) {
    for (const auto& a : plan.compute.ranks[static_cast<size_t>(pp_rank)]) {
      splits_backward = splits_backward || a.kind == pipeline::ActionKind::kBackwardWeight;
    }
  }
  bool holds_head = false;
  double largest_layer = 0;  // the rank's largest layer's values in full
  const double dim = static_cast<double>(info.dim);
  for (int64_t s : split.rank_to_stages.at(static_cast<size_t>(pp_rank))) {
    double stage = 0;
    const auto [first, end] = split.stage_layers.at(static_cast<size_t>(s));
    for (int64_t l = first; l < end && l < static_cast<int64_t>(info.layers.size()); ++l) {
      const auto& layer = info.layers[static_cast<size_t>(l)];
      const bool recomputed = layer.recompute_values_per_token > 0;
      const double full = recomputed ? layer.recompute_values_per_token : layer.saved_values_per_token;
      largest_layer = std::max(largest_layer, full);
      stage += recomputed && splits_backward ? full : layer.saved_values_per_token;
      if (recomputed && !splits_backward) {
        // The recompute materialises what the layer did not keep beside
        // its input: all of it under "full", the cheap ops under "op".
        e.recompute_values_per_token = std::max(
            e.recompute_values_per_token, full - layer.saved_values_per_token + dim);
      }
    }
    e.saved_values_per_token = std::max(e.saved_values_per_token, stage);
    if (s == split.num_stages - 1) holds_head = true;
  }
  const double tokens = static_cast<double>(e.tokens_per_microbatch);
  e.activations = (static_cast<double>(e.microbatches_in_flight) * e.saved_values_per_token +
                   e.recompute_values_per_token) *
                  tokens * elem;
  if (holds_head) {
    const int64_t chunk = ops::loss_chunk_tokens(
        info.loss_chunk_tokens, /*kernels_run=*/on_cuda && job.model.cuda_kernels);
    const int64_t rows =
        chunk > 0 ? std::min(chunk, e.tokens_per_microbatch) : e.tokens_per_microbatch;
    e.loss = static_cast<double>(rows) * static_cast<double>(info.vocab_size) * 8.0;
  }
  e.backward_transient = largest_layer * tokens * elem +
                         (holds_head ? static_cast<double>(info.vocab_size) * dim * 4.0 : 0.0);
  // Gradients are freed after each step; they are live beside kept
  // activations when the rank runs several micro-batches or accumulates.
  e.gradients_in_forward = microbatches > 1 || split.pp > 1 ||
                           job.training.gradient_accumulation_steps > 1;
  return e;
}

std::vector<MemoryEstimate> estimate_memory_per_rank(const JobConfig& job, const ModelInfo& info,
                                                     const pipeline::PipelinePlan& plan,
                                                     at::ScalarType compute_dtype,
                                                     bool on_cuda) {
  std::vector<MemoryEstimate> out;
  for (int64_t r = 0; r < plan.split.pp; ++r) {
    out.push_back(estimate_rank_memory(job, info, plan, r, compute_dtype, on_cuda));
  }
  return out;
}

std::string format_gib(double bytes) {
  constexpr double kMiB = 1024.0 * 1024.0;
  char buf[32];
  if (bytes < 1024.0 * kMiB) {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", bytes / kMiB);
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", bytes / (1024.0 * kMiB));
  }
  return buf;
}

std::string describe_memory_estimate(const MemoryEstimate& e) {
  return str(format_gib(e.total()), " (weights ", format_gib(e.weights), ", gradients ",
             format_gib(e.gradients), ", optimizer ", format_gib(e.optimizer),
             e.optimizer_shards > 1 ? str(" sharded over ", e.optimizer_shards, " dp ranks")
                                    : std::string(),
             e.expert_params > 0
                 ? str("; routed experts ", format_gib(e.expert_params * 4.0),
                       " of the fp32 weights",
                       e.expert_shards > 1 ? str(", split over ", e.expert_shards, " ep ranks")
                                           : std::string())
                 : std::string(),
             ", activations ",
             format_gib(e.activations), " for ", e.microbatches_in_flight,
             " micro-batch", e.microbatches_in_flight == 1 ? "" : "es", " of ",
             e.tokens_per_microbatch, " tokens in flight, loss ", format_gib(e.loss),
             ", backward working set ", format_gib(e.backward_transient),
             e.gradients_in_forward ? "; all live together" : "; gradients after the activations",
             ")");
}

MemoryEstimate check_rank_memory_fits(const JobConfig& job, int64_t pp_rank,
                                      at::ScalarType compute_dtype, bool on_cuda,
                                      double available, const std::string& device_name) {
  const ModelInfo info = describe_model(job);
  auto spec = plan_spec_from_config(job.parallelism, model_module_fqns(job));
  spec.module_flops = info.module_flops;
  const auto plan = pipeline::make_pipeline_plan(spec);
  const auto all = estimate_memory_per_rank(job, info, plan, compute_dtype, on_cuda);
  const auto& e = all.at(static_cast<size_t>(pp_rank));
  const int64_t pp = plan.split.pp;
  const std::string has = str(device_name, " has ", format_gib(available),
                              on_cuda ? " free" : " available");
  // The totals metrics.jsonl carries as plan_memory_bytes beside the
  // measured peak_memory_bytes.
  std::string totals;
  for (size_t r = 0; pp > 1 && r < all.size(); ++r) {
    totals += str(r == 0 ? str("; pp ranks 0-", pp - 1, ": ") : ", ", format_gib(all[r].total()));
  }
  log::info("memory estimate for pp rank ", pp_rank, ": ", describe_memory_estimate(e), totals,
            "; ", has);
  const bool adamw = job.optimizer.name == "AdamW";
  const bool can_shard = adamw && e.optimizer_shards == 1 &&
                         job.parallelism.data_parallel_degree > 1;
  VIADUCT_CHECK_T(
      ConfigError, e.total() <= available, "this run cannot fit: pp rank ", pp_rank,
      " needs about ", describe_memory_estimate(e), " for ", info.family, "/", info.flavor,
      " (", info.params, " parameters over ", pp, " pipeline rank", pp > 1 ? "s" : "",
      ") but ", has,
      ". To fit: smaller micro-batches (training.local_batch_size, training.seq_len, or more "
      "parallelism.pipeline_parallel_microbatches), more pipeline ranks (parallelism.pipeline_parallel_degree, started with `viaduct "
      "launch`), a smaller model (model.flavor, model.n_layers, model.dim)",
      can_shard ? ", parallelism.dp_shard_optimizer = true (optimizer state / dp)" : "",
      e.expert_params > 0 && e.expert_shards == 1 &&
              job.parallelism.data_parallel_degree > 1
          ? ", parallelism.expert_parallel_degree > 1 (the routed experts / ep)"
          : "",
      e.expert_shards > 1 && job.parallelism.expert_gradient_sum == "replica_order"
          ? ", parallelism.expert_gradient_sum = \"local\" (the experts' gradients / ep, "
            "without ep = 1's bits)"
          : "",
      adamw ? ", or optimizer.name = SGD (no optimizer state)" : "",
      activation_checkpoint(job.activation_checkpoint).mode == ops::ActivationCheckpoint::Mode::kFull
          ? ""
          : ", or activation_checkpoint.mode = \"full\" (keep only each layer's input)");
  // Within a tenth of the limit a run may still fail: the estimate leaves
  // out temporaries inside ops and the allocator's slack.
  if (e.total() > kNearLimitFraction * available) {
    log::warn("pp rank ", pp_rank, "'s memory estimate ", format_gib(e.total()), " is ",
              static_cast<int>(100.0 * e.total() / available + 0.5), "% of what ", has,
              "; the estimate leaves out temporaries and the allocator's slack, so this run "
              "may still run out of memory (a smaller training.local_batch_size or "
              "activation checkpointing leaves room)");
  }
  return e;
}

}  // namespace viaduct
