// Causal depthwise convolution + SiLU launches (kernels/short_conv.cu).
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

// The longest filter the kernels take.
constexpr int kShortConvMaxTaps = 8;
// Tokens per partial sum of the weight gradient.
constexpr int64_t kShortConvTokensPerPartial = 64;

// y[b, t, c] = silu(z), z = sum_{j < K} w[c, j] x[b, t - K + 1 + j, c] (x is
// zero before t = 0), j ascending; x, y [B, T, C] of dt, w [C, K] fp32,
// all arithmetic fp32. x's tokens lie xs >= C apart (a column slice of a
// wider product: x[b, t, c] at (b T + t) xs + c); y is contiguous. offsets
// (null: none): int32 [B, T], each token's offset in its document; x is
// zero before the document's first token too.
cudaError_t short_conv_silu_forward(DType dt, const void* x, int64_t xs, const float* w,
                                    const int32_t* offsets, void* y, int64_t B, int64_t T,
                                    int64_t C, int K, cudaStream_t stream);

// The partial sums the backward needs room for: [short_conv_partials(B, T), C, K] fp32.
inline int64_t short_conv_partials(int64_t B, int64_t T) {
  return B * ((T + kShortConvTokensPerPartial - 1) / kShortConvTokensPerPartial);
}

// From dy [B, T, C] of dt: dx [B, T, C] of dt and dw [C, K] fp32 (x as the
// forward read it; dy contiguous, dx's tokens dxs >= C apart: a column
// slice of a wider gradient, as x may be of a wider product). z is
// recomputed from x; partial (see above) is scratch.
// dw sums the partials of each span of kShortConvTokensPerPartial tokens
// in order: the same bits on every run.
cudaError_t short_conv_silu_backward(DType dt, const void* x, int64_t xs, const float* w,
                                     const int32_t* offsets, const void* dy, void* dx,
                                     int64_t dxs, float* partial, float* dw, int64_t B, int64_t T,
                                     int64_t C, int K, cudaStream_t stream);

// The convolution followed by the L2 norm of each head's head_dim channels
// (KDA's q and k: C = heads * head_dim, head_dim 32, 64 or 128): y [B, T,
// C] fp32 = scale * u / sqrt(sum over the head of u^2 + eps), u the
// convolution's output rounded to dt. The bits of short_conv_silu_forward
// then l2_norm_forward (kernels/l2_norm.h), without u in memory.
cudaError_t short_conv_silu_l2_forward(DType dt, const void* x, int64_t xs, const float* w,
                                       const int32_t* offsets, float* y, int64_t B, int64_t T,
                                       int64_t C, int K, int64_t head_dim, float eps,
                                       float scale, cudaStream_t stream);
// Its backward from dy [B, T, C] fp32: the bits of l2_norm_backward then
// short_conv_silu_backward (dx's tokens dxs apart, partial scratch, as
// there).
cudaError_t short_conv_silu_l2_backward(DType dt, const void* x, int64_t xs, const float* w,
                                        const int32_t* offsets, const float* dy, void* dx,
                                        int64_t dxs, float* partial, float* dw, int64_t B,
                                        int64_t T, int64_t C, int K, int64_t head_dim, float eps,
                                        float scale, cudaStream_t stream);

}  // namespace viaduct::cuda
