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
// The convolution, then l2_normalize (ops/l2_norm.h) of each head's
// head_dim channels: [B, T, C / head_dim, head_dim] in fp32 (fp64 for fp64
// x). One kernel each way where the kernels take the shape (the bits of
// the two kernels, the convolution's output never stored); else the two
// ops.
at::Tensor short_conv_silu_l2(const at::Tensor& x, const at::Tensor& weight, int64_t head_dim,
                              double eps, double scale, const KernelOptions& k,
                              const Documents* documents = nullptr);

}  // namespace viaduct::ops
