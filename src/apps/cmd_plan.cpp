// `viaduct plan`: what a pipeline job will move and hold before it runs --
// per-hop bytes for both AttnRes transports and both rank-cache backwards,
// the rank block store's peak per rank, boundary activation memory and the
// schedule's bubble -- from the config alone (no model is built, so the
// 93-layer flavor plans instantly).
#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "apps/command.h"
#include "config/config.h"
#include "core/check.h"
#include "model/family.h"
#include "model/model.h"
#include "pipeline/attn_res/block_layout.h"
#include "pipeline/schedule/plan_config.h"

namespace viaduct::apps {
namespace {

constexpr const char* kUsage =
    "usage: viaduct plan --config FILE [--section.key=value ...] [--json]\n"
    "\n"
    "Sizes a pipeline run without running it: per hop s -> s+1 the bytes one\n"
    "step sends forward with the AttnRes rank cache and with the whole stack\n"
    "(gradients travel back as many, except with the rank cache and\n"
    "parallelism.attn_res_cache_backward = whole_stack: the whole stack's), the\n"
    "rank block store's peak per rank for both cache backwards, the boundary\n"
    "activations each rank holds at its peak, and the schedule's bubble (unit\n"
    "costs F = 1, B = 2). A block entry is [B/M, T, D] in the compute dtype\n"
    "(bf16: 2 bytes, else 4).\n";

double gib(double b) { return b / (1024.0 * 1024.0 * 1024.0); }

int plan_main(int argc, char** argv) {
  const auto cmd = parse_config_command(argc, argv, "plan", kUsage, {"--json"});
  if (!cmd) return 0;
  const auto& cfg = cmd->config;
  const bool json = cmd->has("--json");
  const auto& family = model_family(cfg);
  if (!family.attn_res) {
    std::string attn_res_families;
    for (const auto& f : model_families()) {
      if (!f.attn_res) continue;
      attn_res_families += (attn_res_families.empty() ? "" : " or ") + f.name;
    }
    throw ConfigError(str("plan: model.family is '", family.name,
                          "'; the AttnRes byte plan needs ", attn_res_families));
  }
  const auto plan = plan_for(cfg);
  const auto& sp = plan.split;
  const auto layout = family.attn_res(cfg);  // nullopt: a chain
  const int64_t M = plan.compute.microbatches;
  const int64_t B = cfg.get_int("training.local_batch_size");
  // As the trainer refuses it: a micro-batch of B / M sequences.
  VIADUCT_CHECK_T(ConfigError, M >= 1 && B % M == 0, "training.local_batch_size (", B,
                  ") must be divisible by the ", M,
                  " micro-batches (parallelism.pipeline_parallel_microbatches)");
  const int64_t T = cfg.get_int("training.seq_len");
  VIADUCT_CHECK_T(ConfigError, layout.has_value(),
                  "plan: model.attn_res = false; without AttnRes no block "
                  "stack crosses a hop (use viaduct schedule)");
  const AttnResLayout& o = *layout;
  const std::string dtype = cfg.get_string("training.dtype");
  const int64_t elem = (dtype == "bfloat16" || dtype == "bf16") ? 2 : 4;
  const double entry = static_cast<double>(B / M * T * o.dim * elem);

  using pipeline::AttnResCacheBackward;
  using pipeline::AttnResTransport;
  const auto whole = pipeline::make_block_layout_tables(sp, o.block_size,
                                                        AttnResTransport::kWholeStack);
  // `cache`: deposit backward; `cache_wsb`: whole-stack backward (Note
  // [AttnRes cache backward]).
  std::optional<pipeline::BlockLayoutTables> cache, cache_wsb;
  std::string cache_refused;
  try {
    cache = pipeline::make_block_layout_tables(sp, o.block_size, AttnResTransport::kRankCache,
                                               AttnResCacheBackward::kDeposit);
    cache_wsb = pipeline::make_block_layout_tables(
        sp, o.block_size, AttnResTransport::kRankCache, AttnResCacheBackward::kWholeStack);
  } catch (const ConfigError& e) {
    cache_refused = e.what();
  }

  nlohmann::json out;
  out["n_layers"] = o.n_layers;
  out["block_size"] = o.block_size;
  out["pp"] = sp.pp;
  out["num_stages"] = sp.num_stages;
  out["schedule"] = plan.compute.name;
  out["microbatches"] = M;
  out["entry_bytes"] = entry;
  out["bubble_fraction"] = plan.simulation.bubble_fraction;
  if (plan.simulation_flops) {
    out["bubble_fraction_flops"] = plan.simulation_flops->bubble_fraction;
  }
  if (plan.balanced_weights) {
    out["balanced_weights"] = {plan.balanced_weights->first, plan.balanced_weights->second};
    out["balanced_bubble_fraction_flops"] = plan.balanced_bubble_flops;
  }
  nlohmann::json hops = nlohmann::json::array();
  double total_whole = 0, total_cache = 0;
  // Backward (gradient) bytes: whole stack, cache + deposit, cache + whole-stack backward.
  double grad_whole = 0, grad_cache = 0, grad_cache_wsb = 0;
  const auto bytes = [&](int64_t tensors) { return tensors * entry * static_cast<double>(M); };
  for (int64_t s = 0; s + 1 < sp.num_stages; ++s) {
    nlohmann::json h;
    h["from"] = s;
    h["to"] = s + 1;
    h["whole_stack_tensors"] = whole.hop_tensors(s);
    h["whole_stack_bytes"] = bytes(whole.hop_tensors(s));
    h["whole_stack_grad_bytes"] = bytes(whole.grad_hop_tensors(s));
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
  out["hops"] = hops;
  out["whole_stack_bytes_per_step"] = total_whole;
  out["whole_stack_grad_bytes_per_step"] = grad_whole;
  if (cache) {
    out["rank_cache_bytes_per_step"] = total_cache;
    out["rank_cache_deposit_grad_bytes_per_step"] = grad_cache;
    out["rank_cache_whole_stack_grad_bytes_per_step"] = grad_cache_wsb;
  }
  if (!cache_refused.empty()) out["rank_cache_refused"] = cache_refused;
  nlohmann::json ranks = nlohmann::json::array();
  for (int64_t r = 0; r < sp.pp; ++r) {
    nlohmann::json j;
    j["rank"] = r;
    int64_t widest = 0;  // the largest stack a stage of the rank holds per micro-batch
    for (int64_t s : sp.rank_to_stages[static_cast<size_t>(r)]) {
      widest = std::max(widest, 1 + whole.stage(s).entries_in);
    }
    const auto in_flight = plan.simulation.peak_activations.at(static_cast<size_t>(r));
    j["peak_microbatches_in_flight"] = in_flight;
    j["boundary_activation_bytes"] = static_cast<double>(in_flight * widest) * entry;
    if (cache) {
      const auto peak = pipeline::predict_store_peak(*cache, plan.compute, r);
      j["store_peak_entries"] = peak.total;
      j["store_peak_bytes"] = static_cast<double>(peak.total) * entry;
      j["store_peak_blocks"] = peak.blocks;
      j["store_peak_grad_slots"] = peak.grad_slots;
      const auto peak_wsb = pipeline::predict_store_peak(*cache_wsb, plan.compute, r);
      j["store_peak_bytes_whole_stack_backward"] = static_cast<double>(peak_wsb.total) * entry;
    }
    ranks.push_back(j);
  }
  out["ranks"] = ranks;
  if (json) {
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  std::printf("%s/%s: %lld layers in blocks of %lld; %lld stages on %lld ranks, %s, "
              "%lld micro-batches of [%lld, %lld, %lld] (%.0f bytes per block entry)\n",
              family.name.c_str(), cfg.get_string("model.flavor").c_str(),
              static_cast<long long>(o.n_layers),
              static_cast<long long>(o.block_size), static_cast<long long>(sp.num_stages),
              static_cast<long long>(sp.pp), plan.compute.name.c_str(),
              static_cast<long long>(M), static_cast<long long>(B / M),
              static_cast<long long>(T), static_cast<long long>(o.dim), entry);
  std::printf("bubble %.1f%% (F = 1, B = 2)", 100.0 * plan.simulation.bubble_fraction);
  if (plan.simulation_flops) {
    std::printf(", %.1f%% with stage costs by FLOPs",
                100.0 * plan.simulation_flops->bubble_fraction);
  }
  if (plan.balanced_weights &&
      !plan.balanced &&
      plan.balanced_bubble_flops < plan.simulation_flops->bubble_fraction) {
    // Note [Split balanced by FLOPs]
    std::printf("; %.1f%% with parallelism.pipeline_parallel_balance = \"flops\"",
                100.0 * plan.balanced_bubble_flops);
  }
  std::printf("\n");
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
  std::printf("  rank  in flight  boundary activations  store peak: deposit (blocks + grad "
              "slots), whole_stack backward\n");
  for (const auto& j : ranks) {
    std::printf("  %4lld  %9lld  %16.3f GiB", j["rank"].get<long long>(),
                j["peak_microbatches_in_flight"].get<long long>(),
                gib(j["boundary_activation_bytes"].get<double>()));
    if (cache) {
      std::printf("  %8.3f GiB (%lld + %lld entries), %8.3f GiB",
                  gib(j["store_peak_bytes"].get<double>()),
                  j["store_peak_blocks"].get<long long>(),
                  j["store_peak_grad_slots"].get<long long>(),
                  gib(j["store_peak_bytes_whole_stack_backward"].get<double>()));
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace

VIADUCT_COMMAND("plan",
                "size a pipeline run: per-hop bytes (AttnRes cache vs whole stack, "
                "both cache backwards), store peak, activations, bubble",
                plan_main);

}  // namespace viaduct::apps
