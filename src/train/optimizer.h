// Optimizers over FQN-named parameters, with state keyed by FQN so a
// checkpoint saved under one layout loads under any other.
#pragma once

#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ops/options.h"

namespace viaduct {

struct JobConfig;
struct OptimizerSection;

namespace checkpoint {
class TensorFileIndex;
}  // namespace checkpoint

struct NamedParam {
  std::string fqn;
  at::Tensor param;     // fp32 master weight
  bool weight_decay;    // false for norms, biases and embeddings
  // Set for an expert tensor sharded by expert parallelism (see Note [Expert
  // parallelism], model/moe.h): param holds rows [first_row, first_row +
  // param.size(0)) of the whole tensor `fqn` of whole_rows rows; 0: whole.
  int64_t first_row = 0;
  int64_t whole_rows = 0;
};

// Parameters of a module tree in registration (= model) order, with the
// decay rule applied. `prefix` is prepended to every name.
std::vector<NamedParam> named_params_for_training(const torch::nn::Module& m);

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update with learning rate `lr`, reading each param's .grad().
  virtual void step(double lr) = 0;
  // The update from every gradient times grad_scale (the clip coefficient;
  // 1: as they are). Here: the gradients are scaled in place, then step();
  // AdamW's CUDA kernel reads the scale instead and leaves the gradients
  // as they are (see Note [Clip folded into AdamW]). Either way the update has
  // the same bits.
  virtual void step_scaled(double lr, double grad_scale);
  // See Note [Clip coefficient on the device] (kernels/clip.cu): the
  // update with the clip coefficient read on the device from `scale` ([1]
  // fp32, ops::clip_on_device), NaN there updating nothing; only where
  // takes_device_scale() (AdamW's own CUDA kernel), else an error.
  virtual bool takes_device_scale() const { return false; }
  virtual void step_device_scaled(double lr, const at::Tensor& scale);
  // FQN-keyed state: "optim.<slot>.<fqn>" -> tensor (the checkpoint layer's
  // naming, see checkpoint/tensor_index.h).
  virtual std::vector<std::pair<std::string, at::Tensor>> state() const = 0;
  // Restore from `tensors` (keys as state() names them); a missing key is an
  // error naming it.
  virtual void load_state(const std::map<std::string, at::Tensor>& tensors) = 0;
  // Keys state() would produce (for loading).
  virtual std::vector<std::string> state_keys() const = 0;
  // The metadata of the file state() is saved into (a sharded optimizer's
  // pieces table, see Note [Tensors stored in pieces]); empty by default.
  virtual std::map<std::string, std::string> state_file_metadata() const { return {}; }
  // Restores the state from a checkpoint's tensors, stored whole or in
  // pieces; by default load_state() of every state_keys() tensor, the state
  // of a sharded expert tensor cut to its rows.
  virtual void load_from(const checkpoint::TensorFileIndex& index);
  // Bytes of the state this process holds.
  int64_t state_bytes() const;
  // Bytes this process sent to other ranks in its last step (a sharded
  // optimizer's gathers); 0 for one that updates its own parameters only.
  virtual int64_t last_step_bytes() const { return 0; }
  int64_t steps_taken() const { return steps_; }
  void set_steps_taken(int64_t s) { steps_ = s; }
  const std::vector<NamedParam>& params() const { return params_; }
  void zero_grad();

 protected:
  explicit Optimizer(std::vector<NamedParam> params) : params_(std::move(params)) {}
  std::vector<NamedParam> params_;
  int64_t steps_ = 0;
};

// Decoupled weight decay (Loshchilov & Hutter), bias-corrected moments in fp32.
class AdamW : public Optimizer, public ops::KernelUser {
 public:
  AdamW(std::vector<NamedParam> params, double beta1, double beta2, double eps,
        double weight_decay);
  void step(double lr) override;
  void step_scaled(double lr, double grad_scale) override;
  bool takes_device_scale() const override;
  void step_device_scaled(double lr, const at::Tensor& scale) override;
  std::vector<std::pair<std::string, at::Tensor>> state() const override;
  void load_state(const std::map<std::string, at::Tensor>& tensors) override;
  std::vector<std::string> state_keys() const override;

 private:
  // Whether every gradient meets the fused paths' needs (contiguous fp32
  // on one GPU), and whether viaduct's own kernel runs (not ATen's).
  bool fusable() const;
  bool own_kernel() const;
  // The update through a fused kernel (bias corrections bc1, bc2 of this
  // step); false: none applies here, the caller runs the loop.
  bool fused_step(double lr, double bc1, double bc2);
  double beta1_, beta2_, eps_, weight_decay_;
  double grad_scale_ = 1.0;  // read by viaduct's kernel (step_scaled)
  at::Tensor scale_dev_;     // or this, on the device (step_device_scaled)
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;
  at::Tensor step_tensor_;  // the step count for the fused kernel
};

// Plain SGD: p -= lr * g (no state). Used by the exactness tests.
class SGD : public Optimizer {
 public:
  explicit SGD(std::vector<NamedParam> params) : Optimizer(std::move(params)) {}
  void step(double lr) override;
  std::vector<std::pair<std::string, at::Tensor>> state() const override { return {}; }
  void load_state(const std::map<std::string, at::Tensor>&) override {}
  std::vector<std::string> state_keys() const override { return {}; }
};

// optimizer.name's optimizer over `params`; AdamW runs its kernel under
// `kernels` (the rank model's options: model.cuda_kernels, the weight cache
// whose copies its update writes).
std::unique_ptr<Optimizer> make_optimizer(const OptimizerSection& section, std::vector<NamedParam> params,
                                          const ops::KernelOptions& kernels);

// Learning rate at optimizer step `step` (1-based): linear warmup, then
// cosine / linear decay to min_lr_factor x lr, or constant.
double lr_at(const JobConfig& job, int64_t step);

// The gradients that are defined, in the order of `params`; with `where`,
// the index in `params` of each.
std::vector<at::Tensor> defined_grads(const std::vector<NamedParam>& params,
                                      std::vector<size_t>* where = nullptr);
// The squares, in double, of each tensor's fp32 norm, in order.
std::vector<double> squared_norms(std::vector<at::Tensor> tensors);
// Per-parameter squared gradient norms (fp32 sums, as double), in the
// order of `params`. A parameter without a gradient contributes 0.
std::vector<double> grad_squared_norms(const std::vector<NamedParam>& params);
// Sum squared norms in the order given (global FQN order: the caller orders
// them), take the root. fp64 accumulation keeps every layout's bits equal.
double total_norm(const std::vector<double>& squared_norms_in_fqn_order);
// min(1, max_norm / (norm + 1e-6)); 1 when max_norm <= 0 (no clipping).
double clip_coefficient(double total_norm, double max_norm);
// Multiply every gradient by clip_coefficient(total_norm, max_norm).
void scale_grads(const std::vector<NamedParam>& params, double total_norm,
                 double max_norm);
// Multiply every gradient by coef (nothing when coef == 1).
void multiply_grads(const std::vector<NamedParam>& params, double coef);

}  // namespace viaduct
