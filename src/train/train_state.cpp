// A training process's checkpoint contents (see train_state.h).
#include "train/train_state.h"

#include <filesystem>

#include "core/torch_compat.h"
#include "train/expert_parallel.h"
#include "data/sampler.h"

namespace viaduct {
namespace ck = checkpoint;
namespace fs = std::filesystem;

std::string checkpoint_folder_from_config(const JobConfig& job) {
  fs::path f = job.checkpoint.folder;
  if (f.is_absolute()) return f.string();
  return (fs::path(job.job.dump_folder) / f).string();
}

ck::CheckpointPolicy checkpoint_policy_from_config(const CheckpointSection& c) {
  ck::CheckpointPolicy p;
  p.enable = c.enable;
  p.resume = c.resume;
  p.interval = c.interval;
  p.keep_latest_k = static_cast<int>(c.keep_latest_k);
  p.save_initial = c.save_initial;
  p.save_final = c.save_final;
  return p;
}

std::vector<ck::CheckpointPart> training_state_parts(
    const std::vector<std::shared_ptr<ModelPart>>& parts, const Optimizer& optimizer,
    int pp_rank, int pp, int dp_rank, int optim_dp) {
  ck::CheckpointPart model_part{ck::part_file_name("model", pp_rank, pp), {}, {}};
  for (const auto& part : parts) {
    for (const auto& p : part->named_parameters()) {
      model_part.tensors.emplace_back(p.key(), p.value().detach());
    }
    for (const auto& [k, t] : part->extra_state()) model_part.tensors.emplace_back(k, t);
  }
  ck::CheckpointPart optim_part{ck::part_file_name("optim", pp_rank, pp, dp_rank, optim_dp),
                                optimizer.state(), optimizer.state_file_metadata()};
  return {model_part, optim_part};
}

ck::CheckpointMetadata training_state_metadata(TrainProgress progress,
                                               const data::TokenSampler& sampler,
                                               const Optimizer& optimizer,
                                               std::string config_toml,
                                               nlohmann::json layout) {
  ck::CheckpointMetadata meta;
  meta.step = progress.step;
  meta.tokens_seen = progress.tokens_seen;
  meta.data_cursor = nlohmann::json::parse(sampler.cursor().to_json());
  meta.config_toml = std::move(config_toml);
  meta.layout = std::move(layout);
  meta.extra = {{"optimizer_steps", optimizer.steps_taken()}};
  meta.torch_version = compat::torch_version();
  return meta;
}

TrainProgress load_training_state(const ck::Checkpoint& ckpt,
                                  const std::vector<std::shared_ptr<ModelPart>>& parts,
                                  Optimizer& optimizer, data::TokenSampler& sampler,
                                  bool load_optimizer) {
  for (const auto& part : parts) {
    load_part_tensors(ckpt.tensors, *part);
    ckpt.tensors.load_into(part->extra_state());
  }
  if (load_optimizer) {
    optimizer.load_from(ckpt.tensors);
    optimizer.set_steps_taken(ckpt.metadata.extra.value("optimizer_steps", ckpt.metadata.step));
  }
  sampler.restore(data::DataCursor::from_json(ckpt.metadata.data_cursor.dump()));
  return {ckpt.metadata.step, ckpt.metadata.tokens_seen};
}

}  // namespace viaduct
