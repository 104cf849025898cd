// RoPE and repeated-heads launches (kernels/rope.cu).
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

// Rotary embedding on interleaved pairs (x[2i], x[2i+1]); y: [B, T, H, hd]
// with token pitch yT and head pitch yH elements (element [b, t, h, d] at
// (b T + t) yT + h yH + d; yT = H hd, yH = hd: contiguous), a head's
// channels contiguous; x read with element strides (sB, sT, sH, 1); cos, sin:
// [>= T, hd / 2] (row t used for position t). inverse = true rotates by
// -theta (the backward). Output head h rotates the fp32 sum of x's heads
// (h / div) * mul + r, r < cnt: (1, 1, 1) a plain rotation of x [B, T, H,
// hd]; (rep, 1, 1) x [B, T, H / rep, hd] with each head written rep times;
// (1, rep, rep) x [B, T, H * rep, hd] with each run of rep heads summed.
// cos == sin == nullptr: the same without the rotation (copies and sums).
cudaError_t rope(DType dt, const void* x, const float* cos, const float* sin,
                 void* y, int64_t B, int64_t T, int64_t H, int64_t hd, int64_t sB,
                 int64_t sT, int64_t sH, bool inverse, int64_t div, int64_t mul, int64_t cnt,
                 cudaStream_t stream, int64_t yT, int64_t yH);

}  // namespace viaduct::cuda
