// Row L2 normalisation launches (kernels/l2_norm.cu).
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

// y = scale * x * rsqrt(sum(x^2) + eps) over each row of d values: x [rows,
// d] of dt, y [rows, d] fp32 (KDA's q and k enter the recurrence in fp32).
cudaError_t l2_norm_forward(DType dt, const void* x, float* y, int64_t rows, int64_t d,
                            float eps, float scale, cudaStream_t stream);
// dx = scale * (r dy - r^3 x (dy . x)), r = rsqrt(sum(x^2) + eps); dy fp32,
// dx of dt.
cudaError_t l2_norm_backward(DType dt, const void* x, const float* dy, void* dx, int64_t rows,
                             int64_t d, float eps, float scale, cudaStream_t stream);

}  // namespace viaduct::cuda
