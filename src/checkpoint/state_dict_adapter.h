// What a Hugging Face model folder needs of a model (torchtitan's
// StateDictAdapter): its tensors under transformers' names, and its
// config.json, both ways. checkpoint/hf.h reads and writes the folders and
// knows no family; each family with an HF layout implements this in model/
// (ModelFamily::hf_adapter, model/family.h), for the model one config
// builds.
#pragma once

#include <torch/torch.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace viaduct::checkpoint {

using TensorMap = std::map<std::string, at::Tensor>;

class StateDictAdapter {
 public:
  virtual ~StateDictAdapter() = default;

  // config.json of the model, its weights stored as `torch_dtype`
  // ("float32", "bfloat16" or "float16").
  virtual nlohmann::json to_hf_config(const std::string& torch_dtype) const = 0;
  // The `section.key=value` config overrides (model.family and the model
  // keys) that build the model config.json describes. A ConfigError names
  // `folder`/config.json and the field for another model_type or an
  // architecture or setting the family does not model.
  virtual std::vector<std::string> from_hf_config(
      const nlohmann::json& config, const std::string& folder) const = 0;
  // A ConfigError unless config.json, read from the model folder `folder`,
  // describes this model: what from_hf_config refuses, or the first field
  // that differs, named with the viaduct key and both values (an HF vocab
  // smaller than viaduct's fits: from_hf pads it).
  virtual void check_hf_config(const nlohmann::json& config,
                               const std::string& folder) const = 0;

  // viaduct FQN -> tensor to HF name -> tensor (dtypes kept, CPU,
  // contiguous). A missing tensor is a FileError naming it.
  virtual TensorMap to_hf(const TensorMap& viaduct) const = 0;
  // HF name -> tensor, as the folder whose config.json is `config` stores
  // them, to viaduct FQN -> tensor (fp32). A missing tensor or a wrong shape
  // is a FileError naming it and `source`.
  virtual TensorMap from_hf(const TensorMap& hf, const nlohmann::json& config,
                            const std::string& source) const = 0;
};

}  // namespace viaduct::checkpoint
