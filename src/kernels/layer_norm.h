// LayerNorm launches (kernels/layer_norm.cu).
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

// y = (x - mean) * rstd * w + b per row, in fp32 from x of type dt, written
// as dt; mean[row] and rstd[row] = rsqrt(var + eps) (the biased variance,
// as LayerNorm's). x, y: [rows, dim]; w, b: [dim] fp32.
cudaError_t layer_norm_forward(DType dt, const void* x, const float* w, const float* b, void* y,
                               float* mean, float* rstd, int64_t rows, int64_t dim, float eps,
                               cudaStream_t stream);
// With xhat = (x - mean) * rstd and g = dy * w: dx = rstd * (g - mean(g) -
// xhat * mean(g * xhat)); dw_partial[p, :] and db_partial[p, :] = sums over
// the rows block p handles of dy * xhat and dy, norm_backward_parts(rows)
// parts each (the caller sums them).
cudaError_t layer_norm_backward(DType dt, const void* dy, const void* x, const float* w,
                                const float* mean, const float* rstd, void* dx,
                                float* dw_partial, float* db_partial, int64_t rows, int64_t dim,
                                cudaStream_t stream);

}  // namespace viaduct::cuda
