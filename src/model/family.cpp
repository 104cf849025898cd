// The model-family registry (model/family.h) and the family-independent
// entry points of model/model.h that dispatch through it.
#include "model/family.h"

#include <algorithm>

#include "core/check.h"
#include "model/families.h"
#include "ops/options.h"

namespace viaduct {
namespace {

// "a, b or c"
std::string one_of(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += i + 1 == names.size() ? " or " : ", ";
    out += names[i];
  }
  return out;
}

// See Note [Expert parallelism] (model/moe.h): ep > 1 splits every MoE layer's
// routed experts evenly, so the config must build MoE layers and ep must
// divide their expert count; a capacity factor needs MoE layers too.
void check_expert_parallel(const ModelFamily& family, const JobConfig& job) {
  constexpr const char* kEp = "parallelism.expert_parallel_degree";
  const int64_t ep = job.parallelism.expert_parallel_degree;
  const int64_t experts = family.routed_experts ? family.routed_experts(job) : 0;
  VIADUCT_CHECK_T(ConfigError, job.model.moe_capacity_factor == 0 || experts > 0,
                  "model.moe_capacity_factor = ", job.model.moe_capacity_factor,
                  " needs a model with MoE layers, but ", family.name,
                  family.routed_experts ? " with this config" : "", " has none");
  if (ep == 1) return;
  VIADUCT_CHECK_T(ConfigError, experts > 0, kEp, " = ", ep, " needs a model with MoE layers, but ",
                  family.name, family.routed_experts ? " with this config" : "",
                  " has none (model.family = ", family.name,
                  family.routed_experts ? ", model.moe_ffn = false" : "", ")");
  VIADUCT_CHECK_T(ConfigError, experts % ep == 0, kEp, " (", ep,
                  ") must divide model.n_routed_experts (", experts,
                  "): every expert-parallel rank holds the same number of experts");
}

}  // namespace

const std::vector<ModelFamily>& model_families() {
  static const std::vector<ModelFamily> families{llama_family(), gpt2_family(),
                                                 kimi_k3_family(), exact16_family()};
  return families;
}

ConfigError unknown_flavor_error(const std::string& family, const std::string& flavor,
                                 const std::vector<std::string>& flavors) {
  return ConfigError(str("model.flavor '", flavor, "' is not a ", family,
                         " flavor (choose ", one_of(flavors), ")"));
}

std::vector<std::string> chain_model_keys(bool rope, bool swiglu) {
  std::vector<std::string> keys{"model.n_layers",     "model.dim",         "model.n_heads",
                                "model.n_kv_heads",   "model.vocab_size",  "model.ffn_hidden_dim",
                                "model.max_seq_len",  "model.norm_eps",    "model.tie_embeddings",
                                "model.loss_chunk_tokens", "model.cuda_kernels",
                                "model.attn_mask_type", "model.reset_position_ids"};
  if (rope) {
    for (const char* k : {"model.rope_theta", "model.rope_scaling_factor",
                          "model.rope_scaling_low_freq_factor",
                          "model.rope_scaling_high_freq_factor",
                          "model.rope_scaling_original_max_seq_len"}) {
      keys.emplace_back(k);
    }
  }
  if (swiglu) keys.emplace_back("model.swiglu_recompute");
  return keys;
}

namespace {

// The keys of another family: see ModelFamily::model_keys.
void check_model_keys(const ModelFamily& family, const ModelKeys& keys) {
  if (family.model_keys.empty()) return;
  for (const auto& key : ModelKeys::names()) {
    if (key == "model.family" || key == "model.flavor" || !keys.differs_from_default(key)) {
      continue;
    }
    if (std::find(family.model_keys.begin(), family.model_keys.end(), key) !=
        family.model_keys.end()) {
      continue;
    }
    std::string takes;
    for (size_t i = 0; i < family.model_keys.size(); ++i) {
      takes += str(i ? ", " : "", family.model_keys[i]);
    }
    throw ConfigError(str(key, " (from ", keys.source(key), ") does not apply to model.family = ",
                          family.name, ", which takes ", takes,
                          " besides model.family and model.flavor; remove it"));
  }
}

}  // namespace

const ModelFamily& model_family(const JobConfig& job) {
  const auto& name = job.model.family;
  const auto& all = model_families();
  const auto it = std::find_if(all.begin(), all.end(),
                               [&](const ModelFamily& f) { return f.name == name; });
  if (it == all.end()) {
    std::vector<std::string> names;
    for (const auto& f : all) names.push_back(f.name);
    throw ConfigError(str("model.family must be ", one_of(names), ", got '", name, "' (",
                          job.origin(), ")"));
  }
  const auto& flavor = job.model.flavor;
  if (std::find(it->flavors.begin(), it->flavors.end(), flavor) == it->flavors.end()) {
    throw unknown_flavor_error(it->name, flavor, it->flavors);
  }
  check_model_keys(*it, job.model.keys);
  if (it->check) it->check(job);
  check_expert_parallel(*it, job);
  return *it;
}

std::optional<AttnResLayout> attn_res_layout(const JobConfig& job) {
  const auto& family = model_family(job);
  return family.attn_res ? family.attn_res(job) : std::nullopt;
}

std::optional<ImageInput> image_input(const JobConfig& job) {
  const auto& family = model_family(job);
  return family.image_input ? family.image_input(job) : std::nullopt;
}

std::unique_ptr<checkpoint::StateDictAdapter> state_dict_adapter(const JobConfig& job) {
  const auto& family = model_family(job);
  if (family.state_dict_adapter) return family.state_dict_adapter(job);
  std::string with;
  for (const auto& f : model_families()) {
    if (f.state_dict_adapter) with += str(with.empty() ? "" : ", ", f.name);
  }
  throw ConfigError(str("model.family '", family.name, "' has no Hugging Face layout (", with,
                        ")"));
}

std::vector<std::string> model_module_fqns(const JobConfig& job) {
  return model_family(job).module_fqns(job);
}

std::shared_ptr<ModelPart> build_model_part(const JobConfig& job,
                                            const std::vector<std::string>& fqns) {
  auto part = model_family(job).build(job, fqns);
  ops::set_kernel_options(*part, kernel_options(job.model));  // See Note [Ops own the kernel choice]
  return part;
}

ModelInfo describe_model(const JobConfig& job) {
  auto info = model_family(job).describe(job);
  // See Note [Activation memory estimate] under activation checkpointing: a
  // checkpointed layer keeps its input, the hidden stream (an AttnRes
  // layer's block stack is left out as before: it is the stack), and under
  // "op" its expensive ops' outputs too.
  const auto ac = activation_checkpoint(job.activation_checkpoint);
  const bool op = ac.mode == ops::ActivationCheckpoint::Mode::kOp;
  for (auto& l : info.layers) {
    if (!ac.checkpoints(l.layer) || l.saved_values_per_token <= 0) continue;
    l.recompute_values_per_token = l.saved_values_per_token;
    l.saved_values_per_token =
        static_cast<double>(info.dim) + (op ? l.op_output_values_per_token : 0.0);
  }
  return info;
}


}  // namespace viaduct
