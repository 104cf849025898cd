// The update at the end of a training step: the data-parallel sums of the
// gradients, their global norm, the clip and the optimizer's step. It owns
// the optimizer (plain, or sharded over the data-parallel replicas: the same
// Optimizer interface either way) and the gradient reductions, and it is
// built from the rank's parameters: the buckets of the data-parallel sum,
// which ZeRO-1 also shards, come from the parameters' stages and their
// routed-expert tensors.
//
// The norm is the whole model's, in global FQN order, so every layout clips
// with the same bits (see Note [Gradient norm in shard pieces], train/reduce.h).
// Where one process holds every parameter and AdamW's CUDA kernel runs, the
// norm and the clip coefficient stay on the device and the update is queued
// before the host reads them (see Note [Clip coefficient on the device],
// kernels/clip.cu); elsewhere the host reads the norm and the update carries
// the coefficient (see Note [Clip folded into AdamW]). Both give the same bits.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ops/clip.h"
#include "ops/options.h"
#include "train/expert_parallel.h"
#include "train/metrics.h"
#include "train/optimizer.h"

namespace viaduct {

struct JobConfig;
class GradReduction;
class ModelPart;
namespace distributed {
class Mesh;
}  // namespace distributed

struct OptimizerStepSetup {
  // This rank's parts in stage order, their stages, and the global index of
  // each part's first parameter (RankModel).
  const std::vector<std::shared_ptr<ModelPart>>* parts = nullptr;
  std::vector<int64_t> stages;
  std::vector<int64_t> param_offsets;
  int64_t total_param_tensors = 0;
  distributed::Mesh* mesh = nullptr;  // null: one process
  // The rank model's options: the device clip and the AdamW kernel run
  // under them, and the kernel writes the copies of their weight cache.
  ops::KernelOptions kernels;
};

class OptimizerStep {
 public:
  // `params`: the parts' training parameters in global FQN order.
  OptimizerStep(const JobConfig& job, std::vector<NamedParam> params, OptimizerStepSetup setup);
  ~OptimizerStep();

  // parallelism.dp_shard_optimizer with more than one replica (ZeRO-1).
  bool shards_optimizer() const { return shards_; }
  // Whether the data-parallel sum runs (dp > 1); its buckets start as their
  // stage finishes its last backward (see Note [Overlapped data-parallel
  // reduction]) through stage_ready().
  bool reduces_over_dp() const { return grad_reduction_ != nullptr; }
  void stage_ready(int64_t stage);

  // Waits for the data-parallel sums (dense and expert) and records their
  // figures in `m`.
  void finish_reduction(StepMetrics& m, const std::string& context);
  // Clips the gradients to `max_norm` (<= 0: no clip) and updates with `lr`;
  // returns the global gradient norm. `pending_losses` (the micro-batches'
  // losses, still on the device) are read after the norm and added to
  // `loss_sum`. A norm that is not finite is an error naming the step, with
  // nothing updated.
  double clip_and_step(double lr, double max_norm, const std::vector<at::Tensor>& pending_losses,
                       double& loss_sum, int64_t step, const std::string& context);
  // The host seconds the last step waited for the device's norm and
  // losses: -1 where its clip ran on the host (and before any step).
  double last_device_wait_seconds() const { return device_wait_seconds_; }

  // Whether the clip and the update run on the device: one process holds
  // the whole model (no pipeline rank, ZeRO-1 shard or expert share) and
  // the optimizer reads the clip coefficient there (AdamW on viaduct's
  // kernel).
  bool updates_on_device() const;
  // Where updates_on_device() and the gradients suit the device clip: its
  // device half over this step's gradients (the data-parallel sums, when
  // dp > 1), with `pending_losses` beside the norm; nullopt elsewhere.
  // Device work only: a step graph captures it (see Note [The step as one
  // CUDA graph], train/step_graph.h).
  std::optional<ops::DeviceClip> device_clip(double max_norm,
                                             const std::vector<at::Tensor>& pending_losses);
  // The rest of a step whose clip came from device_clip(): queues the
  // update with the device's coefficient, then reads the norm and the
  // losses (added to `loss_sum`) and returns the norm, an error naming
  // `step` when it is not finite (nothing was updated). keep_grads leaves
  // the gradient tensors in place for a step graph to rewrite, where
  // other steps release them.
  double step_with_device_clip(double lr, const ops::DeviceClip& clip, double& loss_sum,
                               bool keep_grads, int64_t step);

  Optimizer& optimizer() { return *optimizer_; }
  const Optimizer& optimizer() const { return *optimizer_; }
  // This rank's sharded expert tensors (none at ep = 1).
  const std::vector<ExpertShard>& expert_shards() const { return expert_shards_; }

 private:
  double global_grad_norm(const std::string& context);

  OptimizerStepSetup setup_;
  bool shards_ = false;
  double device_wait_seconds_ = -1;
  int dp_size_ = 1;
  std::unique_ptr<Optimizer> optimizer_;
  // dp > 1: the data-parallel gradient sum over optimizer_'s parameters.
  std::unique_ptr<GradReduction> grad_reduction_;
  // ep > 1: the sum of the sharded experts' gradients (see Note [Expert gradient
  // sum], train/expert_parallel.h); grad_reduction_ leaves them out.
  std::unique_ptr<ExpertGradReduction> expert_reduction_;
  std::vector<ExpertShard> expert_shards_;
};

}  // namespace viaduct
