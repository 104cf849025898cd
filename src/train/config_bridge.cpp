// Transitional `const Config&` forms for train/trainer.cpp and
// train/optimizer.cpp (see config_bridge.h).
#include "train/config_bridge.h"

#include "checkpoint/manager.h"
#include "config/job_config.h"
#include "data/sampler.h"
#include "distributed/distributed.h"
#include "model/family.h"
#include "model/model.h"
#include "train/fresh_run.h"
#include "train/memory_estimate.h"
#include "train/metrics.h"
#include "train/process.h"
#include "train/rank_model.h"
#include "train/train_state.h"
#include "train/warm_start.h"

namespace viaduct {

ops::KernelOptions kernel_options(const Config& cfg) {
  // Read as kernel_options(ModelSection) reads them, without a JobConfig:
  // the trainer asks once per step.
  ModelSection model;
  model.cuda_kernels = cfg.get_bool("model.cuda_kernels");
  model.swiglu_recompute = cfg.get_bool("model.swiglu_recompute");
  return kernel_options(model);
}

ProcessSetup init_process(const Config& cfg) { return init_process(JobConfig::from(cfg)); }

void log_job_summary(const Config& cfg, const JobSummary& job) {
  log_job_summary(JobConfig::from(cfg), job);
}

RankModel build_rank_model(const Config& cfg, int pp_rank, at::Device device,
                           at::ScalarType compute_dtype, distributed::ProcessGroup* pp_group,
                           const std::string& context, distributed::ProcessGroup* ep_group) {
  return build_rank_model(JobConfig::from(cfg), pp_rank, device, compute_dtype, pp_group,
                          context, ep_group);
}

std::vector<MemoryEstimate> estimate_memory_per_rank(const Config& cfg, const ModelInfo& info,
                                                     const pipeline::PipelinePlan& plan,
                                                     at::ScalarType compute_dtype,
                                                     bool on_cuda) {
  return estimate_memory_per_rank(JobConfig::from(cfg), info, plan, compute_dtype, on_cuda);
}

MemoryEstimate check_rank_memory_fits(const Config& cfg, int64_t pp_rank,
                                      at::ScalarType compute_dtype, bool on_cuda,
                                      double available, const std::string& device_name) {
  return check_rank_memory_fits(JobConfig::from(cfg), pp_rank, compute_dtype, on_cuda,
                                available, device_name);
}

MetricsOptions metrics_options_from_config(const Config& cfg, bool logging_rank) {
  return metrics_options_from_config(JobConfig::from(cfg), logging_rank);
}

std::string checkpoint_folder_from_config(const Config& cfg) {
  return checkpoint_folder_from_config(JobConfig::from(cfg));
}

checkpoint::CheckpointPolicy checkpoint_policy_from_config(const Config& cfg) {
  return checkpoint_policy_from_config(JobConfig::from(cfg).checkpoint);
}

std::vector<std::unique_ptr<FolderLock>> lock_run_folders(const Config& cfg) {
  return lock_run_folders(JobConfig::from(cfg));
}

std::unique_ptr<checkpoint::StateDictAdapter> state_dict_adapter(const Config& cfg) {
  return state_dict_adapter(JobConfig::from(cfg));
}

std::vector<std::string> model_module_fqns(const Config& cfg) {
  return model_module_fqns(JobConfig::from(cfg));
}

ModelInfo describe_model(const Config& cfg) { return describe_model(JobConfig::from(cfg)); }

TrainProgress warm_start(const Config& cfg, const std::vector<std::shared_ptr<ModelPart>>& parts,
                         Optimizer& optimizer, data::TokenSampler& sampler,
                         checkpoint::Verify verify) {
  return warm_start(JobConfig::from(cfg), parts, optimizer, sampler, verify);
}

std::filesystem::path hf_export_folder(const Config& cfg, int64_t step) {
  return hf_export_folder(JobConfig::from(cfg), step);
}

std::vector<checkpoint::HfExtraFile> hf_export_tokenizer_files(const Config& cfg) {
  return hf_export_tokenizer_files(JobConfig::from(cfg));
}

void write_hf_export(const Config& cfg, const std::filesystem::path& folder,
                     const std::map<std::string, at::Tensor>& tensors) {
  write_hf_export(JobConfig::from(cfg), folder, tensors);
}

}  // namespace viaduct
