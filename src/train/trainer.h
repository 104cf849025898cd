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

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "config/job_config.h"
#include "model/model.h"
#include "ops/clip.h"
#include "ops/options.h"
#include "train/metrics.h"
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
class TrainingData;
class MoeStepMetrics;
class StepGather;
class OptimizerStep;
class FolderLock;
class StepGraph;

namespace data {
class TokenSampler;
class EvalLoader;
class TokenStream;
struct TokenBatch;
struct SamplerOptions;
}  // namespace data

class Trainer {
 public:
  explicit Trainer(JobConfig job);
  // The loaded raw config's sections (JobConfig::from).
  explicit Trainer(const Config& cfg) : Trainer(JobConfig::from(cfg)) {}
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
  // Steps run as a replay of the step's CUDA graph (training.cuda_graphs;
  // see Note [The step as one CUDA graph], train/step_graph.h).
  int64_t graph_replays() const;
  // True when run() stopped early on SIGTERM / SIGINT / SIGUSR1 (see Note [Save
  // and exit on a signal], train/preemption.h).
  bool stopped_on_signal() const { return stopped_on_signal_; }
  // This rank's model parts, one per stage it holds, in stage order.
  const std::vector<std::shared_ptr<ModelPart>>& parts() const { return parts_; }
  // Global rank (0 without a launcher) and whether this rank logs.
  int rank() const;
  bool is_logging_rank() const { return rank() == 0; }
  const pipeline::PipelinePlan& plan() const { return *plan_; }
  const Optimizer& optimizer() const;
  const JobConfig& config() const { return job_; }
  std::string checkpoint_folder() const;

 private:
  // Setup: the plan, this rank's parts, the optimizer step and the
  // executor.
  ModelInfo build_model();
  // A run whose estimated memory (weights, gradients, optimizer state,
  // activations: see Note [Activation memory estimate], train/memory_estimate.h)
  // exceeds what the device has stops here with the figures and what would
  // make it fit.
  void check_memory_fits() const;
  // The signal's stop: a checkpoint of this step unless one was just saved.
  void stop_on_signal(bool saved_this_step);

  // The pieces of train_step.
  // The step's batches and their target tokens over all dp ranks; under
  // block_causal the step's document counts and FLOPs into `m` too.
  std::vector<data::TokenBatch> next_batches(int64_t& global_tokens, StepMetrics& m);
  // Every micro-batch's forward and backward; their losses (on this rank's
  // last stage) go to pending_losses, unread.
  void forward_backward(const std::vector<data::TokenBatch>& batches, double scale,
                        std::vector<at::Tensor>& pending_losses);
  // See Note [The step as one CUDA graph] (train/step_graph.h): the step's
  // forward, backward and device clip as one graph, captured on its first
  // call; returns the clip the replay rewrote.
  const ops::DeviceClip& replay_step_graph(const std::vector<data::TokenBatch>& batches,
                                           double scale);
  // One process: a micro-batch's tokens (and images) through every part.
  at::Tensor forward_loss(const data::TokenBatch& mb);
  // Each micro-batch's documents (see Note [Document boundaries],
  // ops/documents.h); empty under model.attn_mask_type = "causal".
  std::vector<ops::DocumentsPtr> documents_of(const std::vector<data::TokenBatch>& mbs) const;
  void sync_replica_statistics();

  // "rank R step S": the context of a collective's timeout message.
  std::string step_context() const;
  void sum_over(distributed::ProcessGroup* group, std::vector<double>& values,
                const std::string& what);
  int64_t num_microbatches() const;

  JobConfig job_;
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
  at::Device device_;
  at::ScalarType compute_dtype_;
  // What the GEMMs take on device_, probed once at start-up (init_process).
  ops::Capabilities capabilities_;
  std::vector<std::shared_ptr<ModelPart>> parts_;
  ModelInfo info_;  // the whole model's, from its shapes
  // The data-parallel sums, the clip and the optimizer.
  std::unique_ptr<OptimizerStep> update_;
  std::unique_ptr<MoeStepMetrics> moe_metrics_;  // null without routed experts
  // Null: eager steps (training.cuda_graphs = false, or unset where the run
  // does not allow the graph).
  std::unique_ptr<StepGraph> step_graph_;
  // The loss scale the parts' head loss reads in its forward, written
  // before each step's (see Note [The loss's gradient scale known to its
  // forward], ops/options.h).
  std::shared_ptr<ops::LossGradScale> loss_grad_scale_;
  // training.cuda_graphs unset: why the warm-up steps found the graph
  // cannot run ("" while nothing stops it); the capture step drops it then.
  std::string graph_unfit_;
  std::unique_ptr<StepGather> gather_;
  std::unique_ptr<TrainingData> data_;
  std::unique_ptr<Checkpointer> checkpointer_;
  FaultInjection faults_;
  std::unique_ptr<MetricsWriter> metrics_;
  int64_t step_ = 0;
  int64_t tokens_seen_ = 0;
  bool stopped_on_signal_ = false;
};

}  // namespace viaduct
