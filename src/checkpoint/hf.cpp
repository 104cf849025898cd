// Hugging Face model folders (see hf.h); the tensors and config.json come
// from the family's StateDictAdapter.
#include "checkpoint/hf.h"

#include <unistd.h>

#include <cstdio>
#include <set>

#include "checkpoint/safetensors.h"
#include "core/check.h"
#include "core/file_io.h"

namespace viaduct::checkpoint {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kConfigFile = "config.json";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

json read_config(const fs::path& folder) {
  const std::string source = folder.string();
  VIADUCT_CHECK_T(FileError, is_hf_folder(folder), source,
                  ": no config.json (not a Hugging Face model folder)");
  try {
    return json::parse(read_text_file(folder / kConfigFile));
  } catch (const json::exception& e) {
    throw FileError(str(source, "/config.json is not valid JSON: ", e.what()));
  }
}

// Every tensor of model.safetensors or of the shards the index lists.
TensorMap read_tensors(const fs::path& folder) {
  const std::string source = folder.string();
  TensorMap out;
  std::vector<fs::path> files;
  json index_names = json::object();
  std::error_code ec;
  if (fs::is_regular_file(folder / kIndexFile, ec)) {
    json index;
    try {
      index = json::parse(read_text_file(folder / kIndexFile));
    } catch (const json::exception& e) {
      throw FileError(str(source, "/", kIndexFile, " is not valid JSON: ", e.what()));
    }
    VIADUCT_CHECK_T(FileError, index.contains("weight_map") && index["weight_map"].is_object(),
                    source, "/", kIndexFile, " has no weight_map");
    std::set<std::string> shards;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      shards.insert(it.value().get<std::string>());
    }
    for (const auto& s : shards) {
      VIADUCT_CHECK_T(FileError, fs::is_regular_file(folder / s, ec), source, "/",
                      kIndexFile, " lists shard '", s, "', which is missing");
      files.push_back(folder / s);
    }
    index_names = index["weight_map"];
  } else {
    VIADUCT_CHECK_T(FileError, fs::is_regular_file(folder / kSingleFile, ec), source,
                    ": neither ", kSingleFile, " nor ", kIndexFile);
    files.push_back(folder / kSingleFile);
  }
  for (const auto& f : files) {
    SafetensorsFile st(f);
    for (const auto& [name, entry] : st.entries()) {
      VIADUCT_CHECK_T(FileError, !out.count(name), source, ": tensor '", name,
                      "' is in more than one shard");
      out[name] = st.read(name);
    }
  }
  for (auto it = index_names.begin(); it != index_names.end(); ++it) {
    VIADUCT_CHECK_T(FileError, out.count(it.key()), source, "/", kIndexFile, " maps '",
                    it.key(), "' to ", it.value().dump(), ", which does not hold it");
  }
  return out;
}

}  // namespace

std::string torch_dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default:
      throw ConfigError(viaduct::str("HF export: dtype ", c10::toString(dtype),
                                     " is not float32, bfloat16 or float16"));
  }
}

at::ScalarType parse_hf_dtype(const std::string& name) {
  if (name == "fp32" || name == "float32") return at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "fp16" || name == "float16") return at::kHalf;
  throw ConfigError(str("--dtype: '", name, "' is not fp32, bf16 or fp16"));
}

bool is_hf_folder(const fs::path& folder) {
  std::error_code ec;
  return fs::is_regular_file(folder / kConfigFile, ec);
}

HfFolder read_hf_folder(const fs::path& folder) {
  HfFolder out;
  out.config = read_config(folder);
  out.tensors = read_tensors(folder);
  return out;
}

TensorMap read_hf_model(const fs::path& folder, const StateDictAdapter& adapter) {
  const json config = read_config(folder);
  adapter.check_hf_config(config, folder.string());
  return adapter.from_hf(read_tensors(folder), config, folder.string());
}

std::vector<HfExtraFile> hf_tokenizer_files(const fs::path& tokenizer,
                                            const std::string& key) {
  std::error_code ec;
  VIADUCT_CHECK_T(FileError, fs::exists(tokenizer, ec), key, ": the tokenizer '",
                  tokenizer.string(), "' does not exist");
  fs::path file = tokenizer;
  if (fs::is_directory(tokenizer, ec)) {
    file = tokenizer / "tokenizer.json";
    VIADUCT_CHECK_T(FileError, fs::is_regular_file(file, ec), key, ": the folder '",
                    tokenizer.string(), "' holds no tokenizer.json");
  }
  VIADUCT_CHECK_T(FileError, fs::is_regular_file(file, ec), key, ": the tokenizer '",
                  file.string(), "' is not a file");
  // The names transformers looks for: tokenizer.json, and tokenizer.model
  // for a SentencePiece model; a tiktoken file keeps its own name.
  const std::string ext = file.extension().string();
  const std::string name = ext == ".json"    ? std::string("tokenizer.json")
                           : ext == ".model" ? std::string("tokenizer.model")
                                             : file.filename().string();
  std::vector<HfExtraFile> out{{file, name}};
  for (const char* companion : {"tokenizer_config.json", "special_tokens_map.json"}) {
    const fs::path beside = file.parent_path() / companion;
    if (beside != file && fs::is_regular_file(beside, ec)) out.push_back({beside, companion});
  }
  return out;
}

void write_hf_folder(const fs::path& folder, const TensorMap& viaduct,
                     const StateDictAdapter& adapter, const HfWriteOptions& options) {
  std::error_code ec;
  VIADUCT_CHECK_T(FileError, !fs::exists(folder, ec), "HF export: '", folder.string(),
                  "' exists; give a new folder");
  std::set<std::string> names = {kConfigFile, kSingleFile, kIndexFile};
  for (const auto& f : options.extra_files) {
    VIADUCT_CHECK_T(FileError, fs::is_regular_file(f.source, ec), "HF export: '",
                    f.source.string(), "' (to copy as ", f.name, ") is not a file");
    VIADUCT_CHECK_T(FileError, names.insert(f.name).second, "HF export: two files named '",
                    f.name, "' (the last from '", f.source.string(), "')");
  }
  const std::string dtype_name = torch_dtype_name(options.dtype);
  TensorMap hf = adapter.to_hf(viaduct);
  fs::path tmp = folder;
  tmp += ".tmp-" + std::to_string(::getpid());
  remove_tree(tmp);
  make_dirs(tmp);
  try {
    // Shards in name order, each up to max_shard_bytes (a larger tensor
    // gets a shard of its own).
    std::vector<NamedTensors> shards(1);
    int64_t bytes = 0, total = 0;
    for (const auto& [name, t] : hf) {
      at::Tensor c = t.to(options.dtype).contiguous();
      const int64_t n = c.numel() * static_cast<int64_t>(c.element_size());
      if (!shards.back().empty() && bytes + n > options.max_shard_bytes) {
        shards.emplace_back();
        bytes = 0;
      }
      shards.back().emplace_back(name, c);
      bytes += n;
      total += n;
    }
    const StringMap meta{{"format", "pt"}};
    if (shards.size() == 1) {
      write_safetensors(tmp / kSingleFile, shards[0], meta);
    } else {
      json weight_map = json::object();
      for (size_t k = 0; k < shards.size(); ++k) {
        char name[64];
        std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", k + 1,
                      shards.size());
        write_safetensors(tmp / name, shards[k], meta);
        for (const auto& [n, t] : shards[k]) weight_map[n] = name;
      }
      json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
      write_text_file(tmp / kIndexFile, index.dump(2) + "\n");
    }
    write_text_file(tmp / kConfigFile, adapter.to_hf_config(dtype_name).dump(2) + "\n");
    for (const auto& f : options.extra_files) {
      write_text_file(tmp / f.name, read_text_file(f.source));
    }
    fsync_dir(tmp);
    rename_path(tmp, folder);
    fsync_dir(folder.has_parent_path() ? folder.parent_path() : fs::path("."));
  } catch (...) {
    remove_tree_noexcept(tmp);
    throw;
  }
}

}  // namespace viaduct::checkpoint
