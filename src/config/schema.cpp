// The full schema (the union of every section's keys), the deprecated
// aliases and the deprecated spellings of several keys together.
#include <set>

#include "config/config.h"
#include "config/schema_parts.h"
#include "core/check.h"

namespace viaduct {

const std::vector<ConfigKey>& config_schema() {
  static const std::vector<ConfigKey> keys = [] {
    std::vector<ConfigKey> k;
    add_core_keys(k);
    add_model_keys(k);
    add_data_keys(k);
    add_parallelism_keys(k);
    std::set<std::string> seen;
    for (const auto& key : k) {
      VIADUCT_ASSERT(seen.insert(key.dotted()).second, "duplicate key ",
                     key.dotted());
    }
    return k;
  }();
  return keys;
}

const std::map<std::string, std::string>& config_aliases() {
  // Old spellings users bring from other trainers or older viaduct configs.
  static const std::map<std::string, std::string> aliases = {
      {"training.batch_size", "training.local_batch_size"},
      {"training.max_grad_norm", "training.max_norm"},
      {"training.warmup_steps", "lr_scheduler.warmup_steps"},
      {"training.mixed_precision_param", "training.dtype"},
      {"checkpoint.keep_latest", "checkpoint.keep_latest_k"},
      {"parallelism.pipeline_parallel_microbatch_count",
       "parallelism.pipeline_parallel_microbatches"},
  };
  return aliases;
}

const std::vector<DeprecatedSpelling>& config_deprecated_spellings() {
  static const std::vector<DeprecatedSpelling> spellings = {
      // exact16 was a kimi_k3 flavor before it became its own family.
      {{{"model.family", "kimi_k3"}, {"model.flavor", "exact16"}},
       {{"model.family", "exact16"}, {"model.flavor", "debugmodel"}}},
  };
  return spellings;
}

const std::map<std::string, std::string>& config_removed_keys() {
  // Choices a measurement settled: the winner is the only form now.
  static const std::map<std::string, std::string> removed = {
      {"model.swiglu_one_gemm",
       "the fused SwiGLU always runs w1 and w3 as one GEMM where its kernels run"},
      {"model.attn_res_fused_norm",
       "each AttnRes read and the RMSNorm after it always run as one kernel where the "
       "kernels take them"},
      {"model.attn_res_grad_in_place",
       "the AttnRes reads' backward always adds each block's gradient into one buffer"},
  };
  return removed;
}

}  // namespace viaduct
