// `viaduct convert`: a viaduct checkpoint (any pipeline layout wrote it) to a
// Hugging Face model folder that transformers loads, and an HF llama / gpt2
// folder to a viaduct checkpoint (checkpoint/hf.h writes and reads the
// folders, the family's StateDictAdapter maps the tensors and config.json).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "apps/command.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/hf.h"
#include "checkpoint/manager.h"
#include "config/config.h"
#include "config/job_config.h"
#include "core/check.h"
#include "core/log.h"
#include "model/family.h"

namespace viaduct::apps {
namespace {

namespace fs = std::filesystem;
namespace ck = checkpoint;

constexpr const char* kUsage =
    "usage: viaduct convert --to hf --input CHECKPOINT --output DIR\n"
    "                       [--dtype fp32|bf16|fp16] [--tokenizer FILE]\n"
    "                       [--max-shard-mb N]\n"
    "       viaduct convert --to viaduct --input HF_DIR --output FOLDER\n"
    "                       --config JOB.toml [--section.key=value ...]\n"
    "\n"
    "--to hf: CHECKPOINT is a step folder or a checkpoint folder (its latest\n"
    "step); the model is described by the config saved in it. DIR gets\n"
    "config.json, model.safetensors (or shards and an index) and the\n"
    "tokenizer: --tokenizer's tokenizer.json (a .json file is copied as\n"
    "tokenizer.json; a folder gives its tokenizer.json; a .tiktoken file\n"
    "keeps its name, a SentencePiece .model becomes tokenizer.model)\n"
    "with the tokenizer_config.json and\n"
    "special_tokens_map.json beside it. DIR must not exist and is written\n"
    "atomically.\n"
    "--to viaduct: HF_DIR holds config.json and model.safetensors (or an\n"
    "index and shards), llama or gpt2; its shape is checked against the job\n"
    "config, and FOLDER/step-0 gets the model weights; FOLDER must hold no\n"
    "checkpoint yet.\n";

int to_hf(const std::string& input, const std::string& output,
          const ck::HfWriteOptions& options) {
  fs::path dir(input);
  if (!fs::exists(dir / ck::kMetadataFileName)) {
    auto latest = ck::find_latest_checkpoint(dir);
    VIADUCT_CHECK_T(FileError, latest.has_value(), "convert: no complete checkpoint in '",
                    input, "'");
    dir = ck::checkpoint_dir(dir, *latest);
  }
  ck::Checkpoint c = ck::open_checkpoint(dir);
  const auto job =
      JobConfig::from(Config::parse(c.metadata.config_toml, dir.string() + "/metadata.json"));
  const auto adapter = state_dict_adapter(job);
  std::vector<fs::path> model_files;
  for (const auto& f : c.metadata.files) {
    if (f.name.rfind("model", 0) == 0) model_files.push_back(dir / f.name);
  }
  ck::TensorFileIndex index(model_files, dir);
  ck::TensorMap tensors;
  for (const auto& name : index.names()) tensors[name] = index.load(name);
  ck::write_hf_folder(output, tensors, *adapter, options);
  log::info("convert: ", dir.string(), " (step ", c.metadata.step, ", ", model_family(job).name,
            ") -> ", output, " (", ck::torch_dtype_name(options.dtype), ")");
  return 0;
}

int to_viaduct(const std::string& input, const std::string& output, const JobConfig& job) {
  // As --to hf refuses an existing folder: a checkpoint already in FOLDER
  // would be replaced, or, newer than step 0, be what a run resumes from.
  std::error_code ec;
  std::vector<std::string> held;
  for (const auto& de : fs::directory_iterator(output, ec)) {
    const auto name = de.path().filename().string();
    if (name.rfind("step-", 0) == 0 && de.is_directory(ec)) held.push_back(name);
  }
  std::sort(held.begin(), held.end());
  VIADUCT_CHECK_T(FileError, held.empty(), "convert: --output '", output,
                  "' already holds checkpoints (", held.empty() ? "" : held.front(),
                  held.size() > 1 ? str(" and ", held.size() - 1, " more") : std::string(),
                  "); give a folder without checkpoints, nothing was written");
  ck::TensorMap tensors = ck::read_hf_model(input, *state_dict_adapter(job));
  ck::CheckpointMetadata meta;
  meta.step = 0;
  meta.config_toml = job.to_toml();
  meta.layout = {{"pp", 1}, {"dp", 1}, {"stages", 1}};
  meta.extra = {{"converted_from", input}};
  ck::CheckpointPart part{"model.safetensors", {}, {}};
  for (auto& [name, t] : tensors) part.tensors.emplace_back(name, t);
  fs::path step = ck::save_checkpoint(output, meta, {part});
  log::info("convert: ", input, " (", model_family(job).name, ") -> ", step.string());
  return 0;
}

int convert_main(int argc, char** argv) {
  std::string to, input, output, config;
  std::vector<std::string> overrides;
  ck::HfWriteOptions options;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    std::string name = arg, value;
    bool has_value = false;
    if (auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      has_value = true;
    }
    const bool ours = name == "--to" || name == "--input" || name == "--output" ||
                      name == "--dtype" || name == "--tokenizer" || name == "--config" ||
                      name == "--max-shard-mb";
    if (!ours) {
      if (has_value && name.find('.') != std::string::npos) {
        overrides.push_back(arg.substr(2));
        continue;
      }
      std::fprintf(stderr, "viaduct convert: unknown argument '%s'\n\n%s", arg.c_str(),
                   kUsage);
      return 2;
    }
    if (!has_value) {
      VIADUCT_CHECK_T(ConfigError, i + 1 < argc, name, " needs a value");
      value = argv[++i];
    }
    if (name == "--to") to = value;
    else if (name == "--input") input = value;
    else if (name == "--output") output = value;
    else if (name == "--config") config = value;
    else if (name == "--dtype") options.dtype = ck::parse_hf_dtype(value);
    else if (name == "--tokenizer") {
      for (auto& f : ck::hf_tokenizer_files(value, "convert --tokenizer")) {
        options.extra_files.push_back(std::move(f));
      }
    } else {
      char* end = nullptr;
      long long mb = std::strtoll(value.c_str(), &end, 10);
      VIADUCT_CHECK_T(ConfigError, !value.empty() && *end == '\0' && mb >= 1,
                      "--max-shard-mb: '", value, "' is not a positive count");
      options.max_shard_bytes = mb * 1000 * 1000;
    }
  }
  // Each missing or bad argument by name.
  std::string problem;
  if (to.empty()) problem = "--to is required (hf or viaduct)";
  else if (to != "hf" && to != "viaduct") problem = "--to must be hf or viaduct, got '" + to + "'";
  else if (input.empty()) problem = "--input is required";
  else if (output.empty()) problem = "--output is required";
  else if (to == "viaduct" && config.empty()) problem = "--to viaduct needs --config (the job config the checkpoint is for)";
  if (!problem.empty()) {
    std::fprintf(stderr, "viaduct convert: %s\n\n%s", problem.c_str(), kUsage);
    return 2;
  }
  if (to == "hf") return to_hf(input, output, options);
  return to_viaduct(input, output, JobConfig::load(config, overrides));
}

}  // namespace

VIADUCT_COMMAND("convert", "viaduct checkpoint <-> Hugging Face model folder (llama, gpt2)",
                convert_main);

}  // namespace viaduct::apps
