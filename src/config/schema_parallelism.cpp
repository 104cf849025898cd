// [parallelism] keys and their cross-field checks. The checks that need the
// model's layer count (is the split possible?) or the schedule table (is the
// schedule name known, does it run this many stages per rank?) run when the
// plan is built (train/plan_spec.h); these are the ones the
// config alone decides.
#include <filesystem>

#include "config/config.h"
#include "config/schema_parts.h"
#include "core/check.h"

namespace viaduct {
namespace {
using T = ConfigType;
ConfigKey key(const char* n, T t, ConfigValue d, const char* h) {
  return ConfigKey{"parallelism", n, t, std::move(d), h};
}
const ConfigValue kUnset{};
}  // namespace

void add_parallelism_keys(std::vector<ConfigKey>& k) {
  k.push_back(key("pipeline_parallel_degree", T::kInt, int64_t{1},
                  "pipeline ranks (pp)").in(greater_than(0)));
  k.push_back(key("pipeline_parallel_schedule", T::kString, std::string("1F1B"),
                  "GPipe | 1F1B | Interleaved1F1B | LoopedBFS | "
                  "InterleavedZeroBubble | ZBVZeroBubble | DualPipeV (case-insensitive)"));
  k.push_back(key("pipeline_parallel_schedule_csv", T::kString, std::string(""),
                  "a schedule in torch's CSV format (one row per rank); overrides "
                  "pipeline_parallel_schedule"));
  k.push_back(key("pipeline_parallel_layers_per_stage", T::kInt, kUnset,
                  "units per stage; stages = ceil((layers + first + last weights) / k)").in(greater_than(0)));
  k.push_back(key("pipeline_parallel_stages_per_rank", T::kInt, kUnset,
                  "virtual stages per rank (default: 1 for GPipe/1F1B, 2 otherwise)").in(greater_than(0)));
  k.push_back(key("pipeline_parallel_first_stage_less_layers", T::kInt, int64_t{1},
                  "split units the embedding counts for").in(at_least(0)));
  k.push_back(key("pipeline_parallel_last_stage_less_layers", T::kInt, int64_t{1},
                  "split units the head counts for").in(at_least(0)));
  k.push_back(key("pipeline_parallel_balance", T::kString, std::string("layers"),
                  "layers: the split counts the embedding and the head as the two keys "
                  "above say (torchtitan's rule); flops: it chooses those two weights so "
                  "the stages' FLOPs give the smallest simulated bubble"));
  k.push_back(key("module_fqns_per_model_part", T::kStringListList, kUnset,
                  "explicit top-level modules per stage, e.g. "
                  "[[\"tok_embeddings\", \"layers.0\"], [\"layers.1\", \"norm\", \"lm_head\"]]"));
  k.push_back(key("pipeline_parallel_microbatches", T::kInt, kUnset,
                  "micro-batches per step (default: pp x stages per rank)").in(greater_than(0)));
  k.push_back(key("data_parallel_degree", T::kInt, int64_t{1},
                  "data-parallel replicas (dp); world = pp x dp").in(greater_than(0)));
  k.push_back(key("expert_parallel_degree", T::kInt, int64_t{1},
                  "expert-parallel ranks (ep): each MoE layer's routed experts are split "
                  "over ep of the data-parallel replicas of a stage, tokens reach them by "
                  "all-to-all; must divide data_parallel_degree and model.n_routed_experts "
                  "(1: every rank holds every expert)").in(greater_than(0)));
  k.push_back(key("expert_gradient_sum", T::kString, std::string("replica_order"),
                  "under expert parallelism: replica_order (each expert's gradient kept per "
                  "source rank over the step and summed in replica order: the bits of "
                  "expert_parallel_degree = 1, holding ep x the local experts' gradients, "
                  "the whole layer's, during the backward) | local (one gradient of the "
                  "local experts, the sources added as the backward meets them: the "
                  "experts' gradient memory / ep, the same bits run to run but not those "
                  "of ep = 1)"));
  k.push_back(key("comm_timeout_seconds", T::kInt, int64_t{300},
                  "timeout of every collective and P2P; a stuck or dead peer "
                  "turns into an error naming rank, stage, micro-batch and action").in(greater_than(0)));
  k.push_back(key("dp_bucket_mb", T::kInt, int64_t{25},
                  "data-parallel gradient all-reduce bucket size (MiB)").in(greater_than(0)));
  k.push_back(key("dp_shard_optimizer", T::kBool, false,
                  "ZeRO-1: each data-parallel rank keeps AdamW's moments for a contiguous "
                  "slice of every gradient bucket, updates its slice of the weights and "
                  "all-gathers the rest (optimizer state / dp per rank; same bits as false)"));
  k.push_back(key("attn_res_cache", T::kBool, true,
                  "AttnRes: rank block cache (hops carry only missing blocks); "
                  "false = every hop carries the whole stack"));
  k.push_back(key("attn_res_cache_backward", T::kString, std::string("deposit"),
                  "AttnRes rank cache's backward: deposit (stored blocks' gradients "
                  "summed per rank in the store; last bits may differ from one "
                  "process) | whole_stack (every backward hop carries the whole "
                  "stack's gradients: one process's bits, whole-stack bytes "
                  "backward); only with attn_res_cache = true"));
  k.push_back(key("attn_res_cache_offload", T::kBool, false,
                  "AttnRes: keep cached blocks in pinned host memory between "
                  "commit and read"));
}

void validate_parallelism(const Config& c) {
  constexpr const char* kPP = "parallelism.pipeline_parallel_degree";
  const int64_t pp = c.get_int(kPP);
  const auto balance = c.get_string("parallelism.pipeline_parallel_balance");
  VIADUCT_CHECK_T(ConfigError, balance == "layers" || balance == "flops",
                  "parallelism.pipeline_parallel_balance must be \"layers\" or \"flops\", "
                  "got \"", balance, "\"");
  const auto lps = c.get_int_opt("parallelism.pipeline_parallel_layers_per_stage");
  const auto spr = c.get_int_opt("parallelism.pipeline_parallel_stages_per_rank");
  const bool fqns = c.is_set("parallelism.module_fqns_per_model_part");
  std::vector<std::string> given;
  if (lps) given.push_back("pipeline_parallel_layers_per_stage");
  if (spr) given.push_back("pipeline_parallel_stages_per_rank");
  if (fqns) given.push_back("module_fqns_per_model_part");
  if (given.size() > 1) {
    std::string list;
    for (const auto& g : given) list += (list.empty() ? "parallelism." : " and parallelism.") + g;
    throw ConfigError(str("the stage count comes from exactly one of "
                          "parallelism.pipeline_parallel_layers_per_stage, "
                          "parallelism.pipeline_parallel_stages_per_rank and "
                          "parallelism.module_fqns_per_model_part; the config sets ",
                          list));
  }

  // See Note [Expert parallelism] (model/moe.h): ep ranks are data-parallel
  // replicas of one stage.
  const int64_t dp = c.get_int("parallelism.data_parallel_degree");
  const int64_t ep = c.get_int("parallelism.expert_parallel_degree");
  VIADUCT_CHECK_T(ConfigError, dp % ep == 0, "parallelism.expert_parallel_degree (", ep,
                  ") must divide parallelism.data_parallel_degree (", dp,
                  "): the expert-parallel ranks are data-parallel replicas of one stage");

  const auto sum = c.get_string("parallelism.expert_gradient_sum");
  VIADUCT_CHECK_T(ConfigError, sum == "replica_order" || sum == "local",
                  "parallelism.expert_gradient_sum must be \"replica_order\" or \"local\", "
                  "got \"", sum, "\"");

  // See Note [AttnRes cache backward] (pipeline/attn_res/block_layout.h).
  constexpr const char* kCacheBackward = "parallelism.attn_res_cache_backward";
  const auto cache_backward = c.get_string(kCacheBackward);
  VIADUCT_CHECK_T(ConfigError, cache_backward == "deposit" || cache_backward == "whole_stack",
                  kCacheBackward, " must be \"deposit\" or \"whole_stack\", got '",
                  cache_backward, "'");
  VIADUCT_CHECK_T(ConfigError,
                  c.get_bool("parallelism.attn_res_cache") || cache_backward != "deposit" ||
                      !c.is_set(kCacheBackward),
                  kCacheBackward, " = \"deposit\" needs parallelism.attn_res_cache = true: "
                  "without the rank cache there is no store to deposit into and every "
                  "backward hop already carries the whole stack's gradients (drop the key "
                  "or set it to \"whole_stack\")");

  const std::string csv = c.get_string("parallelism.pipeline_parallel_schedule_csv");
  if (!csv.empty()) {
    VIADUCT_CHECK_T(ConfigError, std::filesystem::is_regular_file(csv),
                    "parallelism.pipeline_parallel_schedule_csv = '", csv,
                    "' is not a readable file");
    return;
  }
  if (fqns) {
    const auto lists = c.get_string_list_list("parallelism.module_fqns_per_model_part");
    const auto S = static_cast<int64_t>(lists.size());
    VIADUCT_CHECK_T(ConfigError, S >= 1 && S % pp == 0,
                    "parallelism.module_fqns_per_model_part lists ", S,
                    " stages, not a multiple of ", kPP, " = ", pp);
  }
}

}  // namespace viaduct
