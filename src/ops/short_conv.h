// KDA's short convolution: a causal depthwise filter over time, then SiLU.
#pragma once

#include <torch/torch.h>

#include "ops/documents.h"
#include "ops/options.h"

namespace viaduct::ops {

// y[b, t, c] = silu(sum_{j < K} weight[c, j] x[b, t - K + 1 + j, c]), x zero
// before the sequence; x [B, T, C], weight [C, K] (the fp32 master). Where
// viaduct's kernels run, one kernel forward and the weight in fp32; the
// ATen form adds the K shifted products in fp32 (fp64 for fp64 x), then
// silu, then x's dtype. With
// `documents` (see Note [Document boundaries], ops/documents.h) x is zero
// before each document's first token instead.
at::Tensor short_conv_silu(const at::Tensor& x, const at::Tensor& weight, const KernelOptions& k,
                           const Documents* documents = nullptr);

}  // namespace viaduct::ops
