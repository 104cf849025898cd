// LayerNorm (gpt2's norms).
#pragma once

#include <torch/torch.h>

#include "ops/options.h"

namespace viaduct::ops {

// (x - mean) * rsqrt(var + eps) * weight + bias over the last dim, in fp32
// (fp64 for fp64 x), returned in x's dtype; weight, bias: [D]. One kernel
// each way where the kernels run, else ATen's layer_norm on x cast up.
at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      double eps, const KernelOptions& k);
// (h, layer_norm(h)) for h = x + res: one kernel each way where the kernels
// run (the bits of the add and the norm kernel), the two ops elsewhere.
std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& res,
                                                 const at::Tensor& weight,
                                                 const at::Tensor& bias, double eps,
                                                 const KernelOptions& k);

}  // namespace viaduct::ops
