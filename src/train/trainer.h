// The training loop of one process: model parts, optimizer, LR schedule,
// gradient accumulation and micro-batches, deterministic clipping and eval.
// Checkpoints are the Checkpointer's (train/checkpointer.h), metrics output
// the MetricsWriter's (train/metrics.h).
//
// Note [Loss scaling]
// Every micro-batch's loss is its summed token cross-entropy divided by the
// number of target tokens of the whole optimizer step (all accumulation
// steps, all micro-batches). Gradients then need no post-hoc scaling, and any
// split of the step into micro-batches adds up the same per-token terms.
#pragma once

#include <c10/core/Event.h>
#include <torch/torch.h>

#include <exception>
#include <memory>
#include <thread>
#include <optional>
#include <string>
#include <vector>

#include "config/config.h"
#include "model/model.h"
#include "train/metrics.h"
#include "train/expert_parallel.h"
#include "train/fault_injection.h"
#include "train/optimizer.h"

namespace viaduct {

namespace distributed {
class Mesh;
class ProcessGroup;
}  // namespace distributed
namespace pipeline {
struct PipelinePlan;
class PipelineExecutor;
class RankBlockStore;
struct BlockLayoutTables;
}  // namespace pipeline
namespace checkpoint {
class CheckpointManager;
struct Checkpoint;
struct CheckpointPart;
}  // namespace checkpoint
class Checkpointer;
class FolderLock;
class GradReduction;

namespace data {
class TokenSampler;
class EvalLoader;
class TokenStream;
struct TokenBatch;
struct SamplerOptions;
}  // namespace data

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
  // Loads checkpoint.initial_load_path (train/warm_start.h); false when the
  // key is unset. run() calls it when resume() found nothing.
  bool warm_start();

  int64_t step() const { return step_; }
  // True when run() stopped early on SIGTERM / SIGINT / SIGUSR1 (Note [Save
  // and exit on a signal], train/preemption.h).
  bool stopped_on_signal() const { return stopped_on_signal_; }
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
  // Setup: the token sources (data.path or the blend of data.paths) in the
  // sampler and the eval stream; the plan, this rank's parts, the optimizer
  // and the executor; then the eval batches.
  void open_data();
  ModelInfo build_model();
  void init_data();
  data::SamplerOptions sampler_options() const;
  // Note [One trainer per dump folder] (core/folder_lock.h).
  void lock_folders();
  // checkpoint.last_save_in_hf without data.tokenizer: a hint when the token
  // files name the tokenizer that made them.
  void hint_export_tokenizer() const;
  // A run whose estimated memory (weights, gradients, optimizer state,
  // activations: Note [Activation memory estimate], train/memory_estimate.h)
  // exceeds what the device has stops here with the figures and what would
  // make it fit.
  void check_memory_fits() const;
  // A resume whose checkpoint holds another model is a ConfigError naming
  // the difference.
  void check_checkpoint_matches_model(const checkpoint::Checkpoint& ckpt) const;
  // False when the checkpoint was saved under another optimizer.name and
  // checkpoint.resume_with_new_optimizer allows starting it fresh; a
  // ConfigError naming both optimizers without that key.
  bool resume_loads_optimizer(const checkpoint::Checkpoint& ckpt) const;
  // The signal's stop: a checkpoint of this step unless one was just saved.
  void stop_on_signal(bool saved_this_step);
  // report.html and schedule.svg in the dump folder (rank 0, train/report.h).
  void write_report() const;
  // checkpoint.last_save_in_hf: the final weights as an HF model folder
  // (rank 0; under a launcher read back from the final checkpoint).
  void write_final_hf() const;

  // The pieces of train_step.
  std::vector<data::TokenBatch> next_batches(int64_t& global_tokens);
  double forward_backward(const std::vector<data::TokenBatch>& batches, double scale,
                          std::vector<at::Tensor>& pending_losses);
  at::Tensor forward_loss(const at::Tensor& inputs, const at::Tensor& targets);
  void reduce_grads_over_dp(StepMetrics& m);
  // parallelism.dp_shard_optimizer with more than one replica (ZeRO-1).
  bool shards_optimizer() const;
  // Clips and updates on the device where it can (Note [Clip coefficient on
  // the device]): returns the norm and adds the losses to loss_sum; nullopt
  // where the host path runs.
  std::optional<double> step_with_device_clip(double lr, double max_norm,
                                              const std::vector<at::Tensor>& pending_losses,
                                              double& loss_sum);
  // The norm on the host path, then the pending losses added to loss_sum.
  double host_grad_norm(const std::vector<at::Tensor>& pending_losses, double& loss_sum);
  double global_grad_norm();
  double gather_loss_and_pipeline_metrics(double loss_sum, StepMetrics& m);
  void gather_attn_res_bytes(StepMetrics& m);
  // MoE families: this rank's layers' expert counts of the step, [layers,
  // E] int64, copied to the host without a wait (queued before the
  // optimizer, so read after the norm without stalling on it); undefined
  // without MoE layers. Then the load imbalance per layer over dp and pp,
  // and under expert parallelism the exchanges' figures.
  at::Tensor snapshot_moe_counts();
  void gather_moe_metrics(const at::Tensor& counts, StepMetrics& m);
  void sync_replica_statistics();
  void fill_throughput(StepMetrics& m, double seconds) const;

  // "rank R step S": the context of a collective's timeout message.
  std::string step_context() const;
  void sum_over(distributed::ProcessGroup* group, std::vector<double>& values,
                const std::string& what);
  int64_t num_microbatches() const;

  Config cfg_;
  std::unique_ptr<distributed::Mesh> mesh_;
  std::vector<std::unique_ptr<FolderLock>> folder_locks_;
  std::unique_ptr<pipeline::PipelinePlan> plan_;
  std::unique_ptr<pipeline::PipelineExecutor> executor_;  // null: one stage
  // AttnRes pipelines (a family with a block stack over > 1 stage): the
  // layout tables and this rank's block store, shared by its stages; null
  // otherwise.
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
  // dp > 1: the data-parallel gradient sum over optimizer_'s parameters.
  std::unique_ptr<GradReduction> grad_reduction_;
  // ep > 1: the sum of the sharded experts' gradients (Note [Expert gradient
  // sum], train/expert_parallel.h); grad_reduction_ leaves them out.
  std::unique_ptr<ExpertGradReduction> expert_reduction_;
  int ep_size_ = 1;
  std::shared_ptr<ExpertExchangeStats> expert_stats_;
  std::unique_ptr<c10::Event> moe_counts_ready_;  // snapshot_moe_counts' copy (CUDA)
  int64_t n_layers_ = 0;
  int64_t moe_experts_ = 0;  // routed experts of an MoE layer; 0: no MoE model
  // This rank's MoE layers and its sharded expert tensors (none at ep = 1).
  std::vector<MoeLayerRef> moe_layers_;
  std::vector<ExpertShard> expert_shards_;
  std::shared_ptr<const data::TokenStream> eval_tokens_;
  std::unique_ptr<data::TokenSampler> sampler_;
  std::unique_ptr<data::EvalLoader> eval_loader_;
  std::unique_ptr<Checkpointer> checkpointer_;
  FaultInjection faults_;
  std::unique_ptr<MetricsWriter> metrics_;
  int64_t step_ = 0;
  int64_t tokens_seen_ = 0;
  bool stop_requested_ = false;  // every rank agreed at this step's loss gather
  bool stopped_on_signal_ = false;
  double flops_per_token_ = 0;
};

}  // namespace viaduct
