// What a checkpoint holds of one training process, and putting it back:
// this rank's model parameters and extra state (the model file), its
// optimizer state (the optim file), and in the metadata the step, the tokens
// seen, the data cursor, the optimizer's step count and the layout.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/manager.h"
#include "config/job_config.h"
#include "model/model.h"
#include "train/optimizer.h"

namespace viaduct {

namespace data {
class TokenSampler;
}  // namespace data

// checkpoint.folder, under job.dump_folder unless absolute.
std::string checkpoint_folder_from_config(const JobConfig& job);
// The checkpoint.* keys.
checkpoint::CheckpointPolicy checkpoint_policy_from_config(const CheckpointSection& checkpoint);

struct TrainProgress {
  int64_t step = 0;
  int64_t tokens_seen = 0;
};

// The files of pp rank `pp_rank` (of `pp`): its model part and optim part.
// `optim_dp` > 1: the optimizer is sharded over that many data-parallel
// replicas (ZeRO-1) and the optim file is dp replica `dp_rank`'s own.
std::vector<checkpoint::CheckpointPart> training_state_parts(
    const std::vector<std::shared_ptr<ModelPart>>& parts, const Optimizer& optimizer,
    int pp_rank, int pp, int dp_rank = 0, int optim_dp = 1);

checkpoint::CheckpointMetadata training_state_metadata(
    TrainProgress progress, const data::TokenSampler& sampler, const Optimizer& optimizer,
    std::string config_toml, nlohmann::json layout);

// Loads this rank's tensors of `parts` and `optimizer` (by FQN, whatever
// layout saved them) and restores the sampler; returns the saved progress.
// Without `load_optimizer` the optimizer keeps its fresh state (a resume
// under another optimizer.name).
TrainProgress load_training_state(const checkpoint::Checkpoint& ckpt,
                                  const std::vector<std::shared_ptr<ModelPart>>& parts,
                                  Optimizer& optimizer, data::TokenSampler& sampler,
                                  bool load_optimizer = true);

}  // namespace viaduct
