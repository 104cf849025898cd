// AdamW's update on viaduct's CUDA kernel (train/optimizer.cpp owns the
// optimizer, its state and the ATen forms it falls back to).
#pragma once

#include <torch/torch.h>

#include <vector>

#include "ops/options.h"

namespace viaduct::ops {

// One parameter's tensors for the update: the parameter (its .grad()
// defined), the two moments, and its weight decay.
struct AdamWParam {
  at::Tensor param, exp_avg, exp_avg_sq;
  double weight_decay = 0.0;
};
struct AdamWStep {
  double lr = 0.0, beta1 = 0.0, beta2 = 0.0, eps = 0.0;
  double bias_corr1 = 1.0, bias_corr2 = 1.0;  // 1 - beta_i^step
  // The clip coefficient (see Note [Clip folded into AdamW]), or with scale_dev
  // read on the device (see Note [Clip coefficient on the device], ops/clip.h).
  double grad_scale = 1.0;
  at::Tensor scale_dev;
};

// Whether viaduct's AdamW kernel runs for parameters like p.
bool adamw_kernel_runs(const at::Tensor& p, const KernelOptions& k);
// The update of every parameter in place on the kernel (adamw_kernel_runs):
// every tensor that suits it in one launch (see Note [AdamW over many
// tensors in one launch], kernels/adamw.cu), each weight's bf16 copy written in the same
// pass where k's weight cache holds one (see Note [Low-precision weight
// cache], kernels/weight_cache.h), version counters bumped.
void adamw_kernel_step_(const std::vector<AdamWParam>& params, const AdamWStep& s,
                        const KernelOptions& k);

}  // namespace viaduct::ops
