// The linear layer of mixed precision (see Note [Mixed precision],
// model/layers.h): y = x W^T (+ b) with the fp32 master weight cast to x's
// dtype.
#pragma once

#include <torch/torch.h>

#include "ops/options.h"

namespace viaduct::ops {

// y = x W^T (+ b), with W cast to x's dtype (where the kernels run, the
// cast comes from the weight cache, see Note [Low-precision weight cache]).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                  const KernelOptions& k);
// The same with W the concatenation of `w` along dim 0 (one GEMM for
// several projections of x); each part gets its own gradient.
at::Tensor linear_parts(const at::Tensor& x, at::TensorList w, const at::Tensor& b,
                        const KernelOptions& k);
// Whether linear_parts(x, w, ...) takes the fp32-weight-gradient form (Note
// [Linear with an fp32 weight gradient], ops/linear.cpp): bf16 x where the
// kernels run, fp32 2-D weights that require grad.
bool mixed_linear_applies(const at::Tensor& x, at::TensorList w, const KernelOptions& k);

}  // namespace viaduct::ops
