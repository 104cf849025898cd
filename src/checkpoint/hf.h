// Hugging Face model folders in and out: config.json, model.safetensors (or
// shards listed by model.safetensors.index.json) and the tokenizer's files,
// written atomically. Which tensors and which config.json a model has is its
// family's StateDictAdapter's (checkpoint/state_dict_adapter.h); this file
// knows the folder, not the families.
#pragma once

#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/state_dict_adapter.h"

namespace viaduct::checkpoint {

struct HfFolder {
  nlohmann::json config;
  TensorMap tensors;  // HF names, stored dtypes
};
// Reads config.json and every tensor of model.safetensors or of the shards
// model.safetensors.index.json lists. A missing or corrupt file is a
// FileError naming it.
HfFolder read_hf_folder(const std::filesystem::path& folder);
// The weights of the HF model at `folder` as the model `adapter` describes
// them (viaduct FQN -> fp32 tensor): config.json is checked against the
// model (adapter.check_hf_config) before any tensor is read.
TensorMap read_hf_model(const std::filesystem::path& folder,
                        const StateDictAdapter& adapter);
// True when `folder` holds a config.json (an HF model folder).
bool is_hf_folder(const std::filesystem::path& folder);

// A file copied byte for byte into an HF model folder as `name`.
struct HfExtraFile {
  std::filesystem::path source;
  std::string name;
};

// The files of the tokenizer `tokenizer` names (a tokenizer.json, a folder
// holding one, or a tiktoken .tiktoken file: what `prepare-data --tokenizer`
// takes) for an HF model folder: the file itself, a .json one as
// tokenizer.json, and the tokenizer_config.json and special_tokens_map.json
// that sit beside it. A missing file is a FileError naming `key` (the
// option or config key) and the path.
std::vector<HfExtraFile> hf_tokenizer_files(const std::filesystem::path& tokenizer,
                                            const std::string& key);

struct HfWriteOptions {
  at::ScalarType dtype = at::kFloat;  // kFloat, kBFloat16 or kHalf
  int64_t max_shard_bytes = 5'000'000'000;
  // Copied beside the weights (the tokenizer's files: hf_tokenizer_files).
  std::vector<HfExtraFile> extra_files;
};
// Writes `viaduct` (FQN-keyed) as the HF model folder `adapter` describes
// at `folder`, which must not exist: everything goes to a temporary sibling
// that is fsynced and renamed into place, see Note [Atomic replace] in
// core/file_io.h. An extra file that is missing, or two files of one name,
// are refused before anything is written.
void write_hf_folder(const std::filesystem::path& folder,
                     const TensorMap& viaduct, const StateDictAdapter& adapter,
                     const HfWriteOptions& options);

// "float32" / "bfloat16" / "float16" for --dtype fp32 / bf16 / fp16 (also
// accepted as written); ConfigError otherwise.
at::ScalarType parse_hf_dtype(const std::string& name);
std::string torch_dtype_name(at::ScalarType dtype);

}  // namespace viaduct::checkpoint
