// A run's state from elsewhere, and its weights out to Hugging Face: the
// warm start from checkpoint.initial_load_path (a viaduct checkpoint of any
// layout, or an HF llama / gpt2 model folder) when the run's own checkpoint
// folder has nothing to resume from, and checkpoint.last_save_in_hf's model
// folder of the final weights (with data.tokenizer's files). The folders are
// checkpoint/hf.h's, the layout the family's StateDictAdapter
// (state_dict_adapter in model/family.h).
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/hf.h"
#include "config/job_config.h"
#include "model/model.h"
#include "train/optimizer.h"
#include "train/train_state.h"

namespace viaduct {

namespace data {
class TokenSampler;
}  // namespace data

// Loads checkpoint.initial_load_path into this rank's `parts` (the FQNs it
// owns, whatever layout saved them) and, for a full-state warm start
// (initial_load_model_only = false), the optimizer state, the data cursor
// and the step unless checkpoint.exclude_from_loading names them. Returns
// the progress to start from ({0, 0} for weights only). A missing or
// unreadable folder, a tensor of another shape (named, with both shapes) or
// an HF model of another shape is an error naming the file or field.
TrainProgress warm_start(const JobConfig& job,
                         const std::vector<std::shared_ptr<ModelPart>>& parts,
                         Optimizer& optimizer, data::TokenSampler& sampler,
                         checkpoint::Verify verify);

// <checkpoint folder>/hf-step-<step>: where last_save_in_hf writes.
std::filesystem::path hf_export_folder(const JobConfig& job, int64_t step);
// The tokenizer files the export carries: data.tokenizer's
// (checkpoint::hf_tokenizer_files), none when it is empty. A missing file is
// a FileError naming data.tokenizer, so the trainer asks before it trains.
std::vector<checkpoint::HfExtraFile> hf_export_tokenizer_files(const JobConfig& job);
// Writes the FQN-keyed weights `tensors` (all of the model's) as an HF model
// folder in fp32 at `folder`, with the tokenizer files, atomically.
void write_hf_export(const JobConfig& job, const std::filesystem::path& folder,
                     const checkpoint::TensorMap& tensors);

}  // namespace viaduct
