// The linear layer of mixed precision (see Note [Mixed precision],
// model/layers.h): y = x W^T (+ b) with the fp32 master weight cast to x's
// dtype; and the attention's q, k, v projections.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "ops/options.h"

namespace viaduct::ops {

// y = x W^T (+ b), with W cast to x's dtype (where the kernels run, the
// cast comes from k's weight cache: see Note [Low-precision weight cache],
// kernels/weight_cache.h).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                  const KernelOptions& k);
// The same with W the concatenation of `w` along dim 0 (one GEMM for
// several projections of x); each part gets its own gradient.
at::Tensor linear_parts(const at::Tensor& x, at::TensorList w, const at::Tensor& b,
                        const KernelOptions& k);
// Whether linear_parts(x, w, ...) takes the fp32-weight-gradient form
// (see Note [Linear with an fp32 weight gradient], ops/linear.cpp): bf16 x
// where the kernels run, fp32 2-D weights that require grad.
bool mixed_linear_applies(const at::Tensor& x, at::TensorList w, const KernelOptions& k);

// Several projections of the same x [..., D], one output per weight
// [out_i, D], with a bias each (b: one per weight, or none). Where the
// kernels run, one GEMM over the concatenated weights (and biases) whose
// output is split into strided views; else one linear per weight.
// `parts` (optional) splits the outputs finer: widths that run over the
// weights' rows in order, each weight's rows a run of consecutive parts;
// the fused path's parts are all views of the one product (their
// gradients go straight into its gradient), elsewhere narrows of each
// weight's output. See Note [One GEMM for the projections of one input]
// (ops/linear.cpp).
std::vector<at::Tensor> linear_split(const at::Tensor& x, at::TensorList w,
                                     const KernelOptions& k, at::TensorList b = {},
                                     const std::vector<int64_t>& parts = {});

// The attention's projections of x [B, T, D]: q [B, T, H, hd], k and v
// [B, T, KV, hd] from wq [H hd, D], wk and wv [KV hd, D] and their biases
// (all three or none: undefined), H and KV from the weights' rows. Where
// the kernels run, one GEMM, biases included (kept as `packed`); else three
// linears.
// See Note [One GEMM for the projections of one input] (ops/linear.cpp).
struct QkvProjection {
  at::Tensor q, k, v;
  // The one GEMM's product [B, T, (H + 2 KV) hd] that q, k and v are slices
  // of; undefined where three linears ran.
  at::Tensor packed;
};
QkvProjection qkv_projection(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& wk,
                             const at::Tensor& wv, const at::Tensor& bq, const at::Tensor& bk,
                             const at::Tensor& bv, int64_t head_dim, const KernelOptions& k);

}  // namespace viaduct::ops
