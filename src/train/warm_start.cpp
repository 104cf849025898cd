// Warm start and the Hugging Face export of the final weights (see
// warm_start.h).
#include "train/warm_start.h"

#include <algorithm>

#include "checkpoint/manager.h"
#include "core/check.h"
#include "core/log.h"
#include "data/sampler.h"
#include "model/family.h"
#include "train/expert_parallel.h"

namespace viaduct {
namespace ck = checkpoint;
namespace fs = std::filesystem;

namespace {

constexpr const char* kPathKey = "checkpoint.initial_load_path";

// The HF folder's weights into this rank's parameters (the FQNs it owns).
void load_hf_weights(const JobConfig& job, const fs::path& folder,
                     const std::vector<std::shared_ptr<ModelPart>>& parts) {
  const ck::TensorMap weights = ck::read_hf_model(folder, *state_dict_adapter(job));
  torch::NoGradGuard no_grad;
  for (const auto& part : parts) {
    for (const auto& p : part->named_parameters()) {
      const auto it = weights.find(p.key());
      VIADUCT_CHECK_T(FileError, it != weights.end(), kPathKey, " '", folder.string(),
                      "': the Hugging Face model has no tensor for '", p.key(), "'");
      at::Tensor dst = p.value();
      VIADUCT_CHECK_T(FileError, dst.sizes() == it->second.sizes(), kPathKey, " '",
                      folder.string(), "': tensor '", p.key(), "' has shape ",
                      it->second.sizes(), " in the Hugging Face model, but the model has ",
                      dst.sizes());
      dst.copy_(it->second);
    }
  }
}

// A step folder, or a checkpoint folder's latest step.
fs::path viaduct_step_folder(const fs::path& path) {
  if (fs::exists(path / ck::kMetadataFileName)) return path;
  const auto latest = ck::find_latest_checkpoint(path);
  VIADUCT_CHECK_T(FileError, latest.has_value(), kPathKey, " '", path.string(),
                  "' holds no viaduct checkpoint (no metadata.json, no complete step-N "
                  "folder) and no Hugging Face model (no config.json)");
  return ck::checkpoint_dir(path, *latest);
}

// Every model tensor of the checkpoint must have a place in this model: a
// checkpoint of a deeper model would otherwise lose its other layers unseen.
void check_every_tensor_has_a_place(const JobConfig& job, const ck::Checkpoint& ckpt) {
  const auto modules = model_module_fqns(job);
  for (const auto& name : ckpt.tensors.names()) {
    if (name.rfind("optim.", 0) == 0) continue;
    bool owned = false;
    for (const auto& m : modules) owned = owned || name == m || name.rfind(m + ".", 0) == 0;
    VIADUCT_CHECK_T(ConfigError, owned, kPathKey, " '", ckpt.dir.string(), "': tensor '",
                    name, "' has no place in this model (model.n_layers and the family "
                    "must match the checkpoint's)");
  }
}

}  // namespace

TrainProgress warm_start(const JobConfig& job,
                         const std::vector<std::shared_ptr<ModelPart>>& parts,
                         Optimizer& optimizer, data::TokenSampler& sampler,
                         ck::Verify verify) {
  const fs::path path = job.checkpoint.initial_load_path;
  const bool model_only = job.checkpoint.initial_load_model_only;
  std::error_code ec;
  VIADUCT_CHECK_T(FileError, fs::is_directory(path, ec), kPathKey, " '", path.string(),
                  "' is not a folder (from ", job.source(kPathKey), ")");
  if (job.checkpoint.initial_load_in_hf || ck::is_hf_folder(path)) {
    VIADUCT_CHECK_T(ConfigError, model_only, kPathKey, " '", path.string(),
                    "' is a Hugging Face model folder, which holds weights only: "
                    "set checkpoint.initial_load_model_only = true");
    load_hf_weights(job, path, parts);
    log::info("warm start: the weights of the Hugging Face model ", path.string(),
              ", at step 0");
    return {};
  }
  const fs::path dir = viaduct_step_folder(path);
  const ck::Checkpoint ckpt = ck::open_checkpoint(dir, verify);
  check_every_tensor_has_a_place(job, ckpt);
  for (const auto& part : parts) {
    load_part_tensors(ckpt.tensors, *part);
    ckpt.tensors.load_into(part->extra_state());
  }
  if (model_only) {
    log::info("warm start: the weights of ", dir.string(), " (step ", ckpt.metadata.step,
              "), at step 0 with a fresh optimizer and data cursor");
    return {};
  }
  const auto& excluded = job.checkpoint.exclude_from_loading;
  const auto excludes = [&](const char* what) {
    return std::find(excluded.begin(), excluded.end(), what) != excluded.end();
  };
  if (!excludes("optimizer")) {
    optimizer.load_from(ckpt.tensors);
    optimizer.set_steps_taken(
        ckpt.metadata.extra.value("optimizer_steps", ckpt.metadata.step));
  }
  if (!excludes("data")) {
    sampler.restore(data::DataCursor::from_json(ckpt.metadata.data_cursor.dump()));
  }
  TrainProgress progress;
  if (!excludes("step")) progress = {ckpt.metadata.step, ckpt.metadata.tokens_seen};
  log::info("warm start: the training state of ", dir.string(), " (step ",
            ckpt.metadata.step, excluded.empty() ? "" : ", without ",
            [&] {
              std::string s;
              for (const auto& e : excluded) s += (s.empty() ? "" : ", ") + e;
              return s;
            }(),
            "), at step ", progress.step);
  return progress;
}

fs::path hf_export_folder(const JobConfig& job, int64_t step) {
  return fs::path(checkpoint_folder_from_config(job)) / str("hf-step-", step);
}

std::vector<ck::HfExtraFile> hf_export_tokenizer_files(const JobConfig& job) {
  const std::string& tokenizer = job.data.tokenizer;
  if (tokenizer.empty()) return {};
  return ck::hf_tokenizer_files(tokenizer,
                                str("data.tokenizer (from ", job.source("data.tokenizer"), ")"));
}

void write_hf_export(const JobConfig& job, const fs::path& folder,
                     const ck::TensorMap& tensors) {
  ck::HfWriteOptions options;
  options.dtype = at::kFloat;
  options.extra_files = hf_export_tokenizer_files(job);
  ck::write_hf_folder(folder, tensors, *state_dict_adapter(job), options);
}

}  // namespace viaduct
