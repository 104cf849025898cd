// The KDA layer's two gates around its recurrence (kernels/kda_gates.cu):
// the per-channel log-decay from its low-rank projection, and the output's
// per-head RMSNorm times a sigmoid gate.
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

// The channels of the gated norm's rows the kernels take: a multiple of 32
// up to this (a warp per row, the row in registers).
constexpr int64_t kGatedNormMaxDim = 256;

// g[r, c] = -exp(A_log[c / D]) * softplus(f[r, c] + dt_bias[c]) over rows
// r and channels c < H D; f of type dt, dt_bias [H D] and A_log [H] fp32,
// g fp32. softplus(z) = z past 20, else log1p(e^z) (ATen's threshold).
cudaError_t kda_decay_forward(DType dt, const void* f, const float* dt_bias, const float* A_log,
                              float* g, int64_t rows, int64_t H, int64_t D, cudaStream_t stream);

// The rows' partial sums the backward writes: [kda_decay_parts(rows), H D] each.
int64_t kda_decay_parts(int64_t rows);

// From dg [rows, H D] fp32: df (type dt) = dz, dz = dg a softplus'(z) with
// a = -exp(A_log) and z = f + dt_bias; dbias_part[p, c] = the sum of dz and
// gs_part[p, c] = the sum of dg softplus(z) over the rows of part p, in row
// order (the caller sums the parts; dA_log[h] = a_h times the sum of gs
// over the head's channels).
cudaError_t kda_decay_backward(DType dt, const void* f, const float* dt_bias,
                               const float* A_log, const float* dg, void* df, float* dbias_part,
                               float* gs_part, int64_t rows, int64_t H, int64_t D,
                               cudaStream_t stream);

// y = x rstd w sigmoid(gl) per row of D, x fp32 [rows, D], gl and y of type
// dt, w [D] fp32, rstd[row] = rsqrt(mean(x^2) + eps), all arithmetic fp32.
cudaError_t gated_rms_norm_forward(DType dt, const float* x, const void* gl, const float* w,
                                   void* y, float* rstd, int64_t rows, int64_t D, float eps,
                                   cudaStream_t stream);

// The parts of the weight's gradient the backward writes: [gated_rms_norm_parts(rows), D].
int64_t gated_rms_norm_parts(int64_t rows);

// Where a row of a [B, T, H, D] tensor goes in a per-head layout: with
// per_head 0 (the default) row r stays r; else row (b T + t) H + h goes to
// (b H + h) per_head + t, per_head >= T rows a head (KDA's chunk layout,
// [B H, N C, D]: see KdaShape, kernels/kda.h).
struct ChunkRows {
  int64_t T = 0, H = 0, per_head = 0;
#ifdef __CUDACC__
  __host__ __device__
#endif
  int64_t of(int64_t r) const {
    if (per_head == 0) return r;
    const int64_t h = r % H, bt = r / H;
    return (bt / T * H + h) * per_head + bt % T;
  }
};

// From dy (type dt): with s = sigmoid(gl), n = x rstd w and u = dy s,
// dgl = dy n s (1 - s) (type dt), dx = rstd (u w - x rstd^2 mean(u w x))
// (fp32, row r at dx_rows.of(r)), and dw_part[p, :] = the sum of u x rstd
// over part p's rows.
cudaError_t gated_rms_norm_backward(DType dt, const float* x, const void* gl, const float* w,
                                    const float* rstd, const void* dy, float* dx, void* dgl,
                                    float* dw_part, int64_t rows, int64_t D, ChunkRows dx_rows,
                                    cudaStream_t stream);

}  // namespace viaduct::cuda
