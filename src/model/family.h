// The model-family registry: what the rest of viaduct asks of a model family
// (torchtitan's ModelSpec). model.family picks one entry; nothing outside
// model/ compares family names.
//
// Adding a family: model/<name>.cpp defines `ModelFamily <name>_family()`
// (declared in model/families.h) and model_families() (model/family.cpp)
// lists it. Its flavors, module list, part builder, description and, for a
// family whose parts hand on an AttnRes block stack, that stack's shape are
// all the pipeline, the trainer and the commands need; a family with a
// Hugging Face layout adds its StateDictAdapter, all checkpoint/hf.h needs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/state_dict_adapter.h"
#include "core/check.h"
#include "model/model.h"

namespace viaduct {

// The block stack a family's parts pass between stages (see Note [Kimi-K3 part
// activations] in model/kimi_k3.h): what the AttnRes stage and `viaduct
// plan` size their tables and bytes by.
struct AttnResLayout {
  int64_t n_layers = 0;
  int64_t block_size = 0;  // layers per block
  int64_t dim = 0;         // width of a block entry [B, T, dim]
};

// What a model with a vision tower takes of image-text data (see Note
// [Image-text rows], data/sampler.h): `patches` placeholder tokens of id
// `image_token_id` per image, images [C, S, S] with S = image_size.
struct ImageInput {
  int64_t patches = 0;
  int64_t image_token_id = 0;
  int64_t channels = 0;
  int64_t image_size = 0;
};

struct ModelFamily {
  std::string name;                  // the value of model.family
  std::vector<std::string> flavors;  // the values of model.flavor it takes
  // Each function reads the job config as the family needs it: its own
  // [model] keys parsed from ModelSection::keys into its options struct,
  // the typed sections for the rest (activation checkpointing, seq_len).
  // Every top-level module FQN of the whole model, in order (model.h).
  std::function<std::vector<std::string>(const JobConfig&)> module_fqns;
  // The part holding the given modules (empty: the whole model), as
  // build_model_part (model.h) promises.
  std::function<std::shared_ptr<ModelPart>(const JobConfig&, const std::vector<std::string>&)>
      build;
  std::function<ModelInfo(const JobConfig&)> describe;
  // Set where the family's parts hand on an AttnRes block stack: its shape
  // for this config, or nullopt where the config builds a chain (kimi_k3
  // with model.attn_res = false). Unset: the parts form a chain.
  std::function<std::optional<AttnResLayout>(const JobConfig&)> attn_res;
  // Cross-field checks of the model keys that need no model built; run by
  // every lookup (model_family). Unset: none.
  std::function<void(const JobConfig&)> check;
  // The routed experts of each MoE layer under this config (0: the config
  // builds no MoE layer). Unset: a family without experts. What
  // parallelism.expert_parallel_degree is checked against.
  std::function<int64_t(const JobConfig&)> routed_experts;
  // The model.* keys the family reads besides model.family and model.flavor.
  // Any other model key the config sets to something but its default is
  // refused naming the family, so a setting meant for another family is
  // never silently ignored (a default, as a saved config writes every key,
  // changes nothing). Empty: the
  // family's own check does it (exact16 also takes some switches at the
  // value it has anyway).
  std::vector<std::string> model_keys;
  // What a part of the given modules needs of the config, checked without
  // building it: every command runs it on each stage of the config's split,
  // so `plan` and `split` refuse what `train` would. Unset: nothing.
  std::function<void(const JobConfig&, const std::vector<std::string>&)> check_part;
  // The family's Hugging Face layout: transformers' model_type in
  // config.json, and the adapter (names and tensors both ways, config.json
  // both ways) of the model a config builds. Unset: no HF layout; convert,
  // checkpoint.initial_load_in_hf and checkpoint.last_save_in_hf refuse the
  // family.
  // The images the config's model takes, or nullopt where it builds no
  // vision tower. Unset: a family without one.
  std::function<std::optional<ImageInput>(const JobConfig&)> image_input;
  std::string hf_model_type;
  std::function<std::unique_ptr<checkpoint::StateDictAdapter>(const JobConfig&)>
      state_dict_adapter;
};

// Every registered family, in the order the error messages list them.
const std::vector<ModelFamily>& model_families();

// The family model.family names, with model.flavor checked against its
// flavors and the family's checks run. Throws ConfigError naming the valid
// families or flavors.
const ModelFamily& model_family(const JobConfig& job);

// The AttnRes block stack the config's parts hand on, or nullopt for a
// chain model (model_family(job).attn_res).
std::optional<AttnResLayout> attn_res_layout(const JobConfig& job);

// The images the config's model takes (model_family(job).image_input), or
// nullopt for a model without a vision tower.
std::optional<ImageInput> image_input(const JobConfig& job);

// The Hugging Face adapter of the model the config builds
// (model_family(job).state_dict_adapter); a ConfigError naming the families
// that have one when model.family has none.
std::unique_ptr<checkpoint::StateDictAdapter> state_dict_adapter(const JobConfig& job);

// The ConfigError of a flavor the family does not have, as model_family
// throws it; for a family's own flavor table.
ConfigError unknown_flavor_error(const std::string& family, const std::string& flavor,
                                 const std::vector<std::string>& flavors);

}  // namespace viaduct
