// LayerNorm launches (kernels/layer_norm.cu).
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

// y = (x - mean) * rstd * w + b per row, in fp32 from x of type dt, written
// as dt; mean[row] and rstd[row] = rsqrt(var + eps) (the biased variance,
// as LayerNorm's). x, y: [rows, dim]; w, b: [dim] fp32. With res (and h;
// both null or neither): the row normalised is h = x + res rounded to dt,
// written to h.
cudaError_t layer_norm_forward(DType dt, const void* x, const void* res, const float* w,
                               const float* b, void* h, void* y, float* mean, float* rstd,
                               int64_t rows, int64_t dim, float eps, cudaStream_t stream);
// With xhat = (x - mean) * rstd and g = dy * w: dx = rstd * (g - mean(g) -
// xhat * mean(g * xhat)); dw_partial[p, :] and db_partial[p, :] = sums over
// the rows block p handles of dy * xhat and dy, norm_backward_parts(rows)
// parts each (the caller sums them). dres (null: none) [rows, dim]: added
// to dx after dx is rounded to dt (the residual's gradient, h's other use).
cudaError_t layer_norm_backward(DType dt, const void* dy, const void* x, const float* w,
                                const float* mean, const float* rstd, const void* dres,
                                void* dx, float* dw_partial, float* db_partial, int64_t rows,
                                int64_t dim, cudaStream_t stream);

}  // namespace viaduct::cuda
