// RMSNorm launches (kernels/rms_norm.cu).
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

// y = x * rsqrt(mean(x^2) + eps) * w per row; rstd[row] = that rsqrt.
// x, y: [rows, dim]; w: [dim]; rstd: [rows]. With res and h (both or
// neither): h = x + res rounded to dt, written to h, and normalised instead
// of x.
cudaError_t rms_norm_forward(DType dt, const void* x, const void* res, const float* w,
                             void* h, void* y, float* rstd, int64_t rows, int64_t dim,
                             float eps, cudaStream_t stream);
// dx = rstd * (g - x * rstd^2 * mean(g * x)) with g = dy * w, and
// dw_partial[p, :] = sum over the rows block p handles of dy * x * rstd,
// norm_backward_parts(rows) parts (the caller sums them: dw =
// dw_partial.sum(0)). dres, when not
// null ([rows, dim]): dx = dres + dx rounded to dt (the gradient of a
// normalised h = x + res that is also used elsewhere). Rows of up to 2
// slices a thread take the register form (a thread's row slices kept in
// registers), longer rows the loop form.
cudaError_t rms_norm_backward(DType dt, const void* dy, const void* x,
                              const float* w, const float* rstd, const void* dres,
                              void* dx, float* dw_partial, int64_t rows, int64_t dim,
                              cudaStream_t stream);

}  // namespace viaduct::cuda
