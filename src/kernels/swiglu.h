// SwiGLU launches (kernels/swiglu.cu).
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

// y = silu(a) * b, elementwise over n values. With width > 0: n / width
// rows of `width` values, y contiguous, a and b (da and db) `pitch` values
// apart from row to row (the halves of one [rows, 2 width] GEMM output:
// pitch = 2 width; see Note [One w1/w3 projection]); width 0: all contiguous.
cudaError_t swiglu_forward(DType dt, const void* a, const void* b, void* y,
                           int64_t n, cudaStream_t stream, int64_t width = 0, int64_t pitch = 0);
// da = dy * b * silu'(a), db = dy * silu(a); dy contiguous, a, b, da, db
// as swiglu_forward's a and b.
cudaError_t swiglu_backward(DType dt, const void* dy, const void* a,
                            const void* b, void* da, void* db, int64_t n,
                            cudaStream_t stream, int64_t width = 0, int64_t pitch = 0);

}  // namespace viaduct::cuda
