// `viaduct plan`: what a job will hold and move before it runs, from the
// config alone (no model is built, so the 93-layer flavor plans instantly).
// For every family: each pp rank's memory -- weights, gradients, optimizer
// state (divided over dp under parallelism.dp_shard_optimizer), activations
// at the schedule's peak with the config's activation checkpointing and with
// none and full, the loss buffer (see Note [Activation memory estimate],
// train/memory_estimate.h: the figure the trainer checks and logs as
// plan_memory_bytes) -- the boundary activations each rank holds and the
// schedule's bubble. For AttnRes families also the per-hop bytes for both
// transports and both rank-cache backwards and the rank block store's peak
// per rank. For MoE families the routed experts' bytes per rank under
// parallelism.expert_parallel_degree, the all-to-all and gradient-sum bytes
// (train/traffic_estimate.h), and the peak at every expert-parallel degree
// the layout allows, against --device-gib.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/command.h"
#include "config/job_config.h"
#include "core/check.h"
#include "core/strings.h"
#include "model/family.h"
#include "model/model.h"
#include "pipeline/attn_res/block_layout.h"
#include "core/device.h"
#include "train/memory_estimate.h"
#include "train/process.h"
#include "train/traffic_estimate.h"

namespace viaduct::apps {
namespace {

constexpr const char* kUsage =
    "usage: viaduct plan --config FILE [--section.key=value ...] [--json]\n"
    "                    [--device-gib G]\n"
    "\n"
    "Sizes a run without running it. For every model family and layout, per pp\n"
    "rank: the bytes of weights, gradients, optimizer state (AdamW's moments\n"
    "divided over the dp ranks under parallelism.dp_shard_optimizer = true),\n"
    "activations kept for the backward at the schedule's peak -- with the\n"
    "config's activation_checkpoint.mode and with none and full -- and the\n"
    "head's loss buffer, the backward's working set when it starts, and the\n"
    "peak: the parts live together (gradients are freed after each step, so\n"
    "in one process with one micro-batch they peak after the activations are\n"
    "freed); the peak is the figure a run is checked against before it\n"
    "starts, and which metrics.jsonl carries as plan_memory_bytes; the\n"
    "boundary activations each rank holds at its peak, and the schedule's\n"
    "bubble (unit costs F = 1, B = 2). The device and dtype are the trainer's:\n"
    "training.device = auto is this machine's (set --training.device=cuda to\n"
    "plan a GPU run elsewhere), training.dtype = auto is bf16 on CUDA.\n"
    "\n"
    "AttnRes families (kimi_k3, exact16) add, per hop s -> s+1, the bytes one\n"
    "step sends forward with the AttnRes rank cache and with the whole stack\n"
    "(gradients travel back as many, except with the rank cache and\n"
    "parallelism.attn_res_cache_backward = whole_stack: the whole stack's), and\n"
    "the rank block store's peak per rank for both cache backwards. A block\n"
    "entry is [B/M, T, D] in the compute dtype.\n"
    "\n"
    "MoE families (kimi_k3) add the routed experts' share of each rank's\n"
    "parameters after parallelism.expert_parallel_degree (ep) splits them, the\n"
    "bytes each rank's MoE layers send by all-to-all per micro-batch and per\n"
    "step, the bytes of the step's gradient sums over dp (dense) and over each\n"
    "expert's dp / ep replicas (experts), and the largest rank's peak at every\n"
    "ep that divides dp and the expert count, with whether it fits --device-gib\n"
    "G (default: this machine's GPU, when planning for CUDA).\n";

double gib(double b) { return b / (1024.0 * 1024.0 * 1024.0); }

void print_bubble(const pipeline::PipelinePlan& plan) {
  std::printf("bubble %.1f%% (F = 1, B = 2)", 100.0 * plan.simulation.bubble_fraction);
  if (plan.simulation_flops) {
    std::printf(", %.1f%% with stage costs by FLOPs",
                100.0 * plan.simulation_flops->bubble_fraction);
  }
  if (plan.balanced_weights && !plan.balanced && plan.simulation_flops &&
      plan.balanced_bubble_flops < plan.simulation_flops->bubble_fraction) {
    // See Note [Split balanced by FLOPs]
    std::printf("; %.1f%% with parallelism.pipeline_parallel_balance = \"flops\"",
                100.0 * plan.balanced_bubble_flops);
  }
  std::printf("\n");
}

// As `viaduct train` resolves training.device: auto is CUDA where this
// machine has it.
bool plans_for_cuda(const TrainingSection& training) {
  const auto& device = training.device;
  return device == "cuda" || (device == "auto" && torch::cuda::is_available());
}

// activation_checkpoint.mode as the user wrote it, with selective's option.
std::string checkpointing_name(const ActivationCheckpointSection& ac) {
  const auto& mode = ac.mode;
  if (mode != "selective") return mode;
  return str(mode, " (selective_ac_option = ", ac.selective_ac_option, ")");
}

// Every pp rank's estimate for `job` with activation_checkpoint.mode =
// `mode`, the model described and the plan made as the trainer makes them.
std::vector<MemoryEstimate> estimate_with_checkpointing(const JobConfig& job,
                                                        const std::string& mode,
                                                        at::ScalarType dtype, bool on_cuda) {
  JobConfig c = job;
  c.activation_checkpoint.mode = mode;
  return estimate_memory_per_rank(c, describe_model(c), plan_for(c), dtype, on_cuda);
}

int plan_main(int argc, char** argv) {
  const auto cmd =
      parse_config_command(argc, argv, "plan", kUsage, {"--json"}, {"--device-gib"});
  if (!cmd) return 0;
  const auto& job = cmd->job;
  const bool json = cmd->has("--json");
  const auto& family = model_family(job);
  const auto plan = plan_for(job);
  const auto& sp = plan.split;
  const ModelInfo info = describe_model(job);
  // nullopt: a chain (llama, gpt2, kimi_k3 with model.attn_res = false).
  const auto layout =
      family.attn_res ? family.attn_res(job) : std::optional<AttnResLayout>();
  const int64_t M = plan.compute.microbatches;
  const int64_t B = job.training.local_batch_size;
  // As the trainer refuses it: a micro-batch of B / M sequences.
  VIADUCT_CHECK_T(ConfigError, M >= 1 && B % M == 0, "training.local_batch_size (", B,
                  ") must be divisible by the ", M,
                  " micro-batches (parallelism.pipeline_parallel_microbatches)");
  const int64_t T = job.training.seq_len;
  const bool on_cuda = plans_for_cuda(job.training);
  const at::ScalarType dtype = resolve_compute_dtype(job.training.dtype, on_cuda);
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t dim = layout ? layout->dim : info.dim;
  const double entry = static_cast<double>(B / M * T * dim * elem);

  // See Note [Activation memory estimate]: the config's checkpointing, and none
  // and full to show what it buys.
  const auto memory = estimate_memory_per_rank(job, info, plan, dtype, on_cuda);
  const auto memory_none = estimate_with_checkpointing(job, "none", dtype, on_cuda);
  const auto memory_full = estimate_with_checkpointing(job, "full", dtype, on_cuda);
  const bool adamw = job.optimizer.name == "AdamW";
  const int64_t dp = job.parallelism.data_parallel_degree;
  const int64_t shards = memory.at(0).optimizer_shards;

  nlohmann::json out;
  out["family"] = family.name;
  out["flavor"] = info.flavor;
  out["n_layers"] = layout ? layout->n_layers : info.n_layers;
  out["attn_res"] = layout.has_value();
  if (layout) out["block_size"] = layout->block_size;
  out["pp"] = sp.pp;
  out["data_parallel_degree"] = dp;
  out["num_stages"] = sp.num_stages;
  out["schedule"] = plan.compute.name;
  out["microbatches"] = M;
  out["device"] = on_cuda ? "cuda" : "cpu";
  out["dtype"] = dtype == at::kBFloat16 ? "bfloat16" : "float32";
  out["entry_bytes"] = entry;
  out["activation_checkpoint"] = checkpointing_name(job.activation_checkpoint);
  out["optimizer"] = job.optimizer.name;
  out["optimizer_sharded"] = shards > 1;
  out["optimizer_shards"] = shards;
  out["bubble_fraction"] = plan.simulation.bubble_fraction;
  if (plan.simulation_flops) {
    out["bubble_fraction_flops"] = plan.simulation_flops->bubble_fraction;
  }
  if (plan.balanced_weights) {
    out["balanced_weights"] = {plan.balanced_weights->first, plan.balanced_weights->second};
    out["balanced_bubble_fraction_flops"] = plan.balanced_bubble_flops;
  }

  // AttnRes: the layout tables of both transports. `cache`: deposit
  // backward; `cache_wsb`: whole-stack backward (see Note [AttnRes cache
  // backward]).
  using pipeline::AttnResCacheBackward;
  using pipeline::AttnResTransport;
  std::optional<pipeline::BlockLayoutTables> whole, cache, cache_wsb;
  std::string cache_refused;
  if (layout) {
    whole = pipeline::make_block_layout_tables(sp, layout->block_size,
                                               AttnResTransport::kWholeStack);
    try {
      cache = pipeline::make_block_layout_tables(sp, layout->block_size,
                                                 AttnResTransport::kRankCache,
                                                 AttnResCacheBackward::kDeposit);
      cache_wsb = pipeline::make_block_layout_tables(sp, layout->block_size,
                                                     AttnResTransport::kRankCache,
                                                     AttnResCacheBackward::kWholeStack);
    } catch (const ConfigError& e) {
      cache_refused = e.what();
    }
  }

  nlohmann::json hops = nlohmann::json::array();
  double total_whole = 0, total_cache = 0;
  // Backward (gradient) bytes: whole stack, cache + deposit, cache + whole-stack backward.
  double grad_whole = 0, grad_cache = 0, grad_cache_wsb = 0;
  const auto bytes = [&](int64_t tensors) { return tensors * entry * static_cast<double>(M); };
  for (int64_t s = 0; whole && s + 1 < sp.num_stages; ++s) {
    nlohmann::json h;
    h["from"] = s;
    h["to"] = s + 1;
    h["whole_stack_tensors"] = whole->hop_tensors(s);
    h["whole_stack_bytes"] = bytes(whole->hop_tensors(s));
    h["whole_stack_grad_bytes"] = bytes(whole->grad_hop_tensors(s));
    total_whole += h["whole_stack_bytes"].get<double>();
    grad_whole += h["whole_stack_grad_bytes"].get<double>();
    if (cache) {
      h["rank_cache_tensors"] = cache->hop_tensors(s);
      h["rank_cache_bytes"] = bytes(cache->hop_tensors(s));
      h["rank_cache_deposit_grad_tensors"] = cache->grad_hop_tensors(s);
      h["rank_cache_deposit_grad_bytes"] = bytes(cache->grad_hop_tensors(s));
      h["rank_cache_whole_stack_grad_tensors"] = cache_wsb->grad_hop_tensors(s);
      h["rank_cache_whole_stack_grad_bytes"] = bytes(cache_wsb->grad_hop_tensors(s));
      total_cache += h["rank_cache_bytes"].get<double>();
      grad_cache += h["rank_cache_deposit_grad_bytes"].get<double>();
      grad_cache_wsb += h["rank_cache_whole_stack_grad_bytes"].get<double>();
    }
    hops.push_back(h);
  }
  if (whole) {
    out["hops"] = hops;
    out["whole_stack_bytes_per_step"] = total_whole;
    out["whole_stack_grad_bytes_per_step"] = grad_whole;
  }
  if (cache) {
    out["rank_cache_bytes_per_step"] = total_cache;
    out["rank_cache_deposit_grad_bytes_per_step"] = grad_cache;
    out["rank_cache_whole_stack_grad_bytes_per_step"] = grad_cache_wsb;
  }
  if (!cache_refused.empty()) out["rank_cache_refused"] = cache_refused;

  auto& ranks = out["ranks"] = nlohmann::json::array();
  for (int64_t r = 0; r < sp.pp; ++r) {
    const auto ri = static_cast<size_t>(r);
    nlohmann::json j;
    j["rank"] = r;
    // The widest input a stage of the rank keeps per micro-batch: the
    // hidden state, plus the block stack under AttnRes.
    int64_t widest = 0;
    for (int64_t s : sp.rank_to_stages[ri]) {
      widest = std::max<int64_t>(widest, 1 + (whole ? whole->stage(s).entries_in : 0));
    }
    const auto in_flight = plan.simulation.peak_activations.at(ri);
    j["peak_microbatches_in_flight"] = in_flight;
    j["boundary_activation_bytes"] =
        sp.num_stages > 1 ? static_cast<double>(in_flight * widest) * entry : 0.0;
    if (cache) {
      const auto peak = pipeline::predict_store_peak(*cache, plan.compute, r);
      j["store_peak_entries"] = peak.total;
      j["store_peak_bytes"] = static_cast<double>(peak.total) * entry;
      j["store_peak_blocks"] = peak.blocks;
      j["store_peak_grad_slots"] = peak.grad_slots;
      const auto peak_wsb = pipeline::predict_store_peak(*cache_wsb, plan.compute, r);
      j["store_peak_bytes_whole_stack_backward"] = static_cast<double>(peak_wsb.total) * entry;
    }
    const auto& e = memory[ri];
    j["memory"] = {{"weights", e.weights},
                   {"gradients", e.gradients},
                   {"optimizer", e.optimizer},
                   {"activations", e.activations},
                   {"loss", e.loss},
                   {"backward_working_set", e.backward_transient},
                   {"gradients_live_in_forward", e.gradients_in_forward},
                   {"total", e.total()},
                   {"microbatches_in_flight", e.microbatches_in_flight},
                   {"tokens_per_microbatch", e.tokens_per_microbatch},
                   {"activations_ac_none", memory_none[ri].activations},
                   {"activations_ac_full", memory_full[ri].activations},
                   {"total_ac_none", memory_none[ri].total()},
                   {"total_ac_full", memory_full[ri].total()}};
    ranks.push_back(j);
  }
  // See Note [Expert parallelism] (model/moe.h): the experts' share, their
  // traffic, and the peak at every ep the layout allows.
  std::optional<double> device_bytes;
  if (auto it = cmd->options.find("--device-gib"); it != cmd->options.end()) {
    const auto g = parse_finite_number(it->second);
    VIADUCT_CHECK_T(ConfigError, g && *g > 0,
                    "--device-gib must be a finite number of GiB > 0, got '", it->second, "'");
    device_bytes = *g * 1024.0 * 1024.0 * 1024.0;
  } else if (on_cuda && torch::cuda::is_available()) {
    device_bytes = device_memory_bytes(at::Device(at::kCUDA, 0));
  }
  const bool moe = info.routed_expert_params > 0;
  const int64_t ep = job.parallelism.expert_parallel_degree;
  std::vector<TrafficEstimate> traffic;
  std::vector<std::pair<int64_t, double>> peak_by_ep;  // ep, the largest rank's peak
  if (moe) {
    out["expert_parallel_degree"] = ep;
    out["routed_experts"] = info.routed_experts;
    out["experts_per_token"] = info.experts_per_token;
    for (int64_t r = 0; r < sp.pp; ++r) {
      traffic.push_back(estimate_rank_traffic(job, info, plan, r, dtype));
      const auto& t = traffic.back();
      auto& j = out["ranks"][static_cast<size_t>(r)];
      j["memory"]["expert_params"] = memory[static_cast<size_t>(r)].expert_params;
      j["traffic"] = {{"moe_layers", t.moe_layers},
                      {"alltoall_bytes_per_microbatch", t.alltoall_bytes_per_microbatch},
                      {"alltoall_bytes_per_step", t.alltoall_bytes_per_step},
                      {"dense_reduce_bytes_per_step", t.dense_reduce_bytes_per_step},
                      {"expert_reduce_bytes_per_step", t.expert_reduce_bytes_per_step}};
    }
    nlohmann::json by_ep = nlohmann::json::array();
    for (int64_t e = 1; e <= dp; ++e) {
      if (dp % e != 0 || info.routed_experts % e != 0) continue;
      JobConfig c = job;
      c.parallelism.expert_parallel_degree = e;
      double worst = 0;
      for (const auto& m : estimate_memory_per_rank(c, info, plan, dtype, on_cuda)) {
        worst = std::max(worst, m.total());
      }
      peak_by_ep.emplace_back(e, worst);
      nlohmann::json j{{"ep", e}, {"peak", worst}};
      if (device_bytes) j["fits"] = worst <= *device_bytes;
      by_ep.push_back(j);
    }
    out["peak_by_expert_parallel_degree"] = by_ep;
    if (device_bytes) out["device_bytes"] = *device_bytes;
  }
  if (json) {
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }

  std::printf("%s/%s: %lld layers", family.name.c_str(), info.flavor.c_str(),
              out["n_layers"].get<long long>());
  if (layout) std::printf(" in blocks of %lld", static_cast<long long>(layout->block_size));
  std::printf("; %lld stage%s on %lld rank%s x dp %lld%s, %lld micro-batch%s of "
              "[%lld, %lld, %lld]; %s on %s\n",
              static_cast<long long>(sp.num_stages), sp.num_stages == 1 ? "" : "s",
              static_cast<long long>(sp.pp), sp.pp == 1 ? "" : "s",
              static_cast<long long>(dp),
              sp.num_stages > 1 ? (", " + plan.compute.name).c_str() : "",
              static_cast<long long>(M), M == 1 ? "" : "es", static_cast<long long>(B / M),
              static_cast<long long>(T), static_cast<long long>(dim),
              out["dtype"].get<std::string>().c_str(), on_cuda ? "cuda" : "cpu");
  if (sp.num_stages > 1) print_bubble(plan);


  if (whole) {
    std::printf("AttnRes (%.0f bytes per block entry):\n", entry);
    std::printf("  hop      whole stack            rank cache\n");
    for (const auto& h : hops) {
      std::printf("  %3lld->%-3lld %3lld tensors %8.3f GiB", h["from"].get<long long>(),
                  h["to"].get<long long>(), h["whole_stack_tensors"].get<long long>(),
                  gib(h["whole_stack_bytes"].get<double>()));
      if (cache) {
        std::printf("   %3lld tensors %8.3f GiB", h["rank_cache_tensors"].get<long long>(),
                    gib(h["rank_cache_bytes"].get<double>()));
      }
      std::printf("\n");
    }
    std::printf("  per step: whole stack %.3f GiB", gib(total_whole));
    if (cache) std::printf(", rank cache %.3f GiB", gib(total_cache));
    std::printf(" forward\n");
    std::printf("  per step backward: whole stack %.3f GiB", gib(grad_whole));
    if (cache) {
      std::printf(", rank cache %.3f GiB (attn_res_cache_backward = deposit) or %.3f GiB "
                  "(= whole_stack)",
                  gib(grad_cache), gib(grad_cache_wsb));
    }
    std::printf("\n");
    if (!cache_refused.empty()) std::printf("rank cache: %s\n", cache_refused.c_str());
  }
  if (sp.num_stages > 1) {
    std::printf("  rank  in flight  boundary activations%s\n",
                cache ? "  store peak: deposit (blocks + grad slots), whole_stack backward"
                      : "");
    for (const auto& j : ranks) {
      std::printf("  %4lld  %9lld  %20s", j["rank"].get<long long>(),
                  j["peak_microbatches_in_flight"].get<long long>(),
                  format_gib(j["boundary_activation_bytes"].get<double>()).c_str());
      if (cache) {
        std::printf("  %12s (%lld + %lld entries), %s",
                    format_gib(j["store_peak_bytes"].get<double>()).c_str(),
                    j["store_peak_blocks"].get<long long>(),
                    j["store_peak_grad_slots"].get<long long>(),
                    format_gib(j["store_peak_bytes_whole_stack_backward"].get<double>()).c_str());
      }
      std::printf("\n");
    }
  }

  // See Note [Activation memory estimate]
  const std::string optimizer =
      !adamw ? str(job.optimizer.name, ": no optimizer state")
      : shards > 1
          ? str("AdamW moments sharded over ", shards,
                " dp ranks (parallelism.dp_shard_optimizer = true)")
          : str("AdamW moments not sharded (parallelism.dp_shard_optimizer = false",
                dp > 1 ? str("; true divides them by ", dp) : std::string(), ")");
  std::printf("memory per pp rank (estimate, before allocator slack and temporaries): %s; "
              "activation_checkpoint.mode = %s\n",
              optimizer.c_str(), checkpointing_name(job.activation_checkpoint).c_str());
  std::printf("  %4s %11s %11s %11s %11s %11s %11s %11s   %s\n", "rank", "weights", "gradients",
              "optimizer", "activations", "loss", "bwd work", "peak",
              "activations with mode none / full");
  for (size_t r = 0; r < memory.size(); ++r) {
    const auto& e = memory[r];
    std::printf("  %4zu %11s %11s %11s %11s %11s %11s %11s   %s / %s\n", r,
                format_gib(e.weights).c_str(), format_gib(e.gradients).c_str(),
                format_gib(e.optimizer).c_str(), format_gib(e.activations).c_str(),
                format_gib(e.loss).c_str(), format_gib(e.backward_transient).c_str(),
                format_gib(e.total()).c_str(),
                format_gib(memory_none[r].activations).c_str(),
                format_gib(memory_full[r].activations).c_str());
  }
  if (moe) {
    std::printf("experts: %lld routed per MoE layer, %lld per token; ep %lld (each rank holds "
                "%lld of every MoE layer's experts)\n",
                static_cast<long long>(info.routed_experts),
                static_cast<long long>(info.experts_per_token), static_cast<long long>(ep),
                static_cast<long long>(info.routed_experts / ep));
    std::printf("  %4s %9s %16s %16s %16s %12s %12s\n", "rank", "moe layers", "expert weights",
                "a2a/micro-batch", "a2a/step", "dp sum/step", "expert sum");
    for (size_t r = 0; r < traffic.size(); ++r) {
      const auto& t = traffic[r];
      std::printf("  %4zu %9lld %16s %16s %16s %12s %12s\n", r,
                  static_cast<long long>(t.moe_layers),
                  format_gib(memory[r].expert_params * 4.0).c_str(),
                  format_gib(t.alltoall_bytes_per_microbatch).c_str(),
                  format_gib(t.alltoall_bytes_per_step).c_str(),
                  format_gib(t.dense_reduce_bytes_per_step).c_str(),
                  format_gib(t.expert_reduce_bytes_per_step).c_str());
    }
    std::printf("  the largest rank's peak by ep%s:",
                device_bytes ? str(" (device ", format_gib(*device_bytes), ")").c_str() : "");
    for (const auto& [e, peak] : peak_by_ep) {
      std::printf(" ep %lld %s%s;", static_cast<long long>(e), format_gib(peak).c_str(),
                  device_bytes ? (peak <= *device_bytes ? " fits" : " does not fit") : "");
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace

VIADUCT_COMMAND("plan",
                "size a run before it runs: per-rank memory (weights, gradients, optimizer, "
                "activations with and without checkpointing), bubble; for AttnRes the "
                "per-hop bytes and the block store's peak",
                plan_main);

}  // namespace viaduct::apps
