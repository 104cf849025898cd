// The training loop of one process: model parts, optimizer, LR schedule,
// gradient accumulation and micro-batches, deterministic clipping, eval,
// metrics and checkpoints (save, prune, resume).
//
// Note [Loss scaling]
// Every micro-batch's loss is its summed token cross-entropy divided by the
// number of target tokens of the whole optimizer step (all accumulation
// steps, all micro-batches). Gradients then need no post-hoc scaling, and any
// split of the step into micro-batches adds up the same per-token terms.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "model/model.h"
#include "train/optimizer.h"

namespace viaduct {

namespace dist {
class Mesh;
class ProcessGroup;
}  // namespace dist
namespace pipeline {
struct PipelinePlan;
class PipelineExecutor;
class RankBlockStore;
struct BlockLayoutTables;
}  // namespace pipeline

namespace data {
class TokenSampler;
class EvalLoader;
class TokenStream;
}  // namespace data

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;        // mean token cross-entropy of the step
  double grad_norm = 0;   // before clipping
  double lr = 0;
  int64_t tokens = 0;     // target tokens of the step (all dp ranks)
  double seconds = 0;
  double tokens_per_sec = 0;
  double mfu = -1;        // fraction of peak; < 0 when the peak is unknown
  double peak_memory_bytes = 0;
  // pp > 1: each pp rank's device peak so far, read at the loss's all-reduce
  // (after the backward; on CPU the process's peak resident set).
  std::vector<double> peak_memory_bytes_per_rank;
  int64_t p2p_bytes = 0;  // this rank's pipeline sends + receives
  // Forward and backward (gradient) bytes per hop s -> s+1 (all ranks), and
  // the AttnRes rank block store's peak bytes per pp rank (empty without an
  // AttnRes pipeline).
  std::vector<int64_t> hop_bytes;
  std::vector<int64_t> hop_grad_bytes;
  std::vector<int64_t> attn_res_store_peak_bytes;
  // Pipeline timing (Note [Measured bubble], pipeline/runtime/executor.h):
  // this rank's span of the schedule, compute and P2P wait seconds, and
  // 1 - compute / span for each pp rank of this pipeline; empty when off.
  double pipeline_seconds = 0;
  double pipeline_compute_seconds = 0;
  double pipeline_p2p_wait_seconds = 0;
  std::vector<double> bubble_measured_per_rank;
};

class Trainer {
 public:
  explicit Trainer(Config cfg);
  ~Trainer();

  // The whole job: resume if a checkpoint exists, train to training.steps,
  // eval and checkpoint on their intervals. Returns the last step's metrics.
  StepMetrics run();

  // One optimizer step (exposed for tests).
  StepMetrics train_step();
  // Mean token cross-entropy over the held-out batches; NaN without data.
  double evaluate();
  void save_checkpoint();
  // Loads the latest checkpoint of the folder; false when there is none.
  bool resume();

  int64_t step() const { return step_; }
  // This rank's model parts, one per stage it holds, in stage order.
  const std::vector<std::shared_ptr<ModelPart>>& parts() const { return parts_; }
  // Global rank (0 without a launcher) and whether this rank logs.
  int rank() const;
  bool is_logging_rank() const { return rank() == 0; }
  const pipeline::PipelinePlan& plan() const { return *plan_; }
  const Optimizer& optimizer() const { return *optimizer_; }
  const Config& config() const { return cfg_; }
  std::string checkpoint_folder() const;

 private:
  at::Tensor forward_loss(const at::Tensor& inputs, const at::Tensor& targets);
  // Sum a few doubles over a group (no-op without one). Only one rank of the
  // group holds non-zeros where this adds "the value from the last stage", so
  // the sum is exact.
  void sum_over(dist::ProcessGroup* group, std::vector<double>& values,
                const std::string& what);
  void allreduce_grads_over_dp();
  double global_grad_norm();
  int64_t num_microbatches() const;
  void log_step(const StepMetrics& m);
  void log_eval(double loss);
  void append_metrics(const std::string& json_line);
  void truncate_metrics_after(int64_t step);

  Config cfg_;
  std::unique_ptr<dist::Mesh> mesh_;
  std::unique_ptr<pipeline::PipelinePlan> plan_;
  std::unique_ptr<pipeline::PipelineExecutor> executor_;  // null: one stage
  // AttnRes pipelines (kimi_k3 over > 1 stage): the layout tables and this
  // rank's block store, shared by its stages; null otherwise.
  std::shared_ptr<const pipeline::BlockLayoutTables> attn_res_tables_;
  std::shared_ptr<pipeline::RankBlockStore> attn_res_store_;
  int pp_rank_ = 0, dp_rank_ = 0, dp_size_ = 1;
  // Global index of this rank's first parameter of each of its stages, and
  // the model's parameter count (for clipping in global FQN order).
  std::vector<int64_t> param_offsets_;
  int64_t total_param_tensors_ = 0;
  at::Device device_;
  at::ScalarType compute_dtype_;
  std::vector<std::shared_ptr<ModelPart>> parts_;
  std::unique_ptr<Optimizer> optimizer_;
  std::shared_ptr<const data::TokenStream> train_tokens_, eval_tokens_;
  std::unique_ptr<data::TokenSampler> sampler_;
  std::unique_ptr<data::EvalLoader> eval_loader_;
  int64_t step_ = 0;
  int64_t tokens_seen_ = 0;
  double flops_per_token_ = 0;
  bool progress_bar_ = false;
};

}  // namespace viaduct
