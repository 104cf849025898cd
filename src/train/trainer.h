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
  const std::vector<std::shared_ptr<ModelPart>>& parts() const { return parts_; }
  const Optimizer& optimizer() const { return *optimizer_; }
  const Config& config() const { return cfg_; }
  std::string checkpoint_folder() const;

 private:
  at::Tensor forward_loss(const at::Tensor& inputs, const at::Tensor& targets);
  void log_step(const StepMetrics& m);
  void log_eval(double loss);
  void append_metrics(const std::string& json_line);
  void truncate_metrics_after(int64_t step);

  Config cfg_;
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
