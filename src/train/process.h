// What a training process sets up before it builds a model: the log level,
// the thread count, its place in the pp x dp mesh, the determinism
// settings, the device, the compute dtype and what the device's GEMMs take;
// and the summary of the job it logs once everything is built.
#pragma once

#include <torch/torch.h>

#include <memory>

#include "config/job_config.h"
#include "model/model.h"
#include "ops/options.h"

namespace viaduct {

namespace distributed {
class Mesh;
}  // namespace distributed
namespace pipeline {
struct PipelinePlan;
}  // namespace pipeline
namespace data {
class TokenSampler;
class TokenStream;
}  // namespace data

struct ProcessSetup {
  std::unique_ptr<distributed::Mesh> mesh;  // null: one process
  at::Device device{at::kCPU};
  at::ScalarType compute_dtype = at::kFloat;
  int pp_rank = 0, dp_rank = 0, dp_size = 1;
  // What this LibTorch build's GEMMs take on `device`, probed once here
  // (ops::probe_capabilities; See Note [GEMM support decided at start-up],
  // core/torch_compat.h): every op of the run takes the path it gives.
  ops::Capabilities capabilities;
};

// training.dtype on a CUDA device or not: auto is bfloat16 on CUDA, float32
// elsewhere.
at::ScalarType resolve_compute_dtype(const std::string& name, bool on_cuda);

// Reads WORLD_SIZE & co. (distributed::rendezvous_from_env); a world that does not
// match parallelism.* is a ConfigError.
ProcessSetup init_process(const JobConfig& job);

// The job at info level: model, device, dtype, threads, fused kernels and
// the GEMM path, parallelism and its simulated bubble, data.
struct JobSummary {
  const ModelInfo& model;
  const pipeline::PipelinePlan& plan;
  at::Device device;
  at::ScalarType compute_dtype;
  const ops::Capabilities& capabilities;
  int dp_size = 1;
  int64_t num_microbatches = 1;
  const data::TokenSampler& sampler;
  const data::TokenStream* eval_tokens = nullptr;
};
void log_job_summary(const JobConfig& config, const JobSummary& job);

}  // namespace viaduct
