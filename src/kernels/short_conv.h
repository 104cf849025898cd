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
// forward read it; dy, dx contiguous). z is recomputed from x; dz [B, T,
// C] fp32 and partial (see above) are scratch.
// dw sums the partials of each span of kShortConvTokensPerPartial tokens
// in order: the same bits on every run.
cudaError_t short_conv_silu_backward(DType dt, const void* x, int64_t xs, const float* w,
                                     const int32_t* offsets, const void* dy, float* dz, void* dx,
                                     float* partial, float* dw, int64_t B, int64_t T, int64_t C,
                                     int K, cudaStream_t stream);

}  // namespace viaduct::cuda
