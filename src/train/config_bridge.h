// Transitional: the `const Config&` forms of the functions the trainer and
// its components still holding a Config call (train/trainer.cpp,
// checkpointer.cpp; optimizer.cpp and resume_checks.cpp through the three
// declared in model/model.h), until they hold a JobConfig
// (config/job_config.h). Each makes the JobConfig of the raw config and
// calls the typed form; their conversion deletes this file and those three
// declarations. Nothing new calls these.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"

namespace viaduct {

struct ProcessSetup;
struct JobSummary;
struct RankModel;
struct MemoryEstimate;
struct MetricsOptions;
struct ModelInfo;
struct TrainProgress;
class ModelPart;
class Optimizer;
class FolderLock;
namespace checkpoint {
struct CheckpointPolicy;
struct HfExtraFile;
class StateDictAdapter;
enum class Verify;
}  // namespace checkpoint
namespace data {
class TokenSampler;
}  // namespace data
namespace distributed {
class ProcessGroup;
}  // namespace distributed
namespace pipeline {
struct PipelinePlan;
}  // namespace pipeline

ProcessSetup init_process(const Config& cfg);
void log_job_summary(const Config& cfg, const JobSummary& job);
RankModel build_rank_model(const Config& cfg, int pp_rank, at::Device device,
                           at::ScalarType compute_dtype, distributed::ProcessGroup* pp_group,
                           const std::string& context, distributed::ProcessGroup* ep_group = nullptr);
std::vector<MemoryEstimate> estimate_memory_per_rank(const Config& cfg, const ModelInfo& info,
                                                     const pipeline::PipelinePlan& plan,
                                                     at::ScalarType compute_dtype,
                                                     bool on_cuda);
MemoryEstimate check_rank_memory_fits(const Config& cfg, int64_t pp_rank,
                                      at::ScalarType compute_dtype, bool on_cuda,
                                      double available, const std::string& device_name);
MetricsOptions metrics_options_from_config(const Config& cfg, bool logging_rank);
std::string checkpoint_folder_from_config(const Config& cfg);
checkpoint::CheckpointPolicy checkpoint_policy_from_config(const Config& cfg);
std::vector<std::unique_ptr<FolderLock>> lock_run_folders(const Config& cfg);
std::unique_ptr<checkpoint::StateDictAdapter> state_dict_adapter(const Config& cfg);
TrainProgress warm_start(const Config& cfg, const std::vector<std::shared_ptr<ModelPart>>& parts,
                         Optimizer& optimizer, data::TokenSampler& sampler,
                         checkpoint::Verify verify);
std::filesystem::path hf_export_folder(const Config& cfg, int64_t step);
std::vector<checkpoint::HfExtraFile> hf_export_tokenizer_files(const Config& cfg);
void write_hf_export(const Config& cfg, const std::filesystem::path& folder,
                     const std::map<std::string, at::Tensor>& tensors);

}  // namespace viaduct
