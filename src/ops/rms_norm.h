// RMSNorm, and the residual add with it (see Note [Residual add inside the
// norm], kernels/rms_norm_fn.cpp).
#pragma once

#include <torch/torch.h>

#include <utility>

#include "ops/options.h"

namespace viaduct::ops {

// x * rsqrt(mean(x^2, -1) + eps) * weight in fp32 (fp64 for fp64 x),
// returned in x's dtype. x: [..., D], weight: [D].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const KernelOptions& k);
// (h, rms_norm(h)) for h = x + res: one kernel each way where the kernels
// run, the two ops elsewhere; the same bits either way on the GPU.
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& res,
                                               const at::Tensor& weight, double eps,
                                               const KernelOptions& k);
// rms_norm(x) * sigmoid(gate_logits) in `out`: a normalised output gated
// by its own logits (KDA's output). x: [..., D] fp32 (fp64 in gradient
// checks), gate_logits of x's shape. One kernel each way where the
// kernels take it (out the logits' dtype); else rms_norm, the sigmoid of
// the logits in x's dtype, their product, and the cast to `out`.
at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                          const at::Tensor& gate_logits, at::ScalarType out,
                          const KernelOptions& k);

}  // namespace viaduct::ops
