// Block AttnRes read launches (kernels/attn_res_read.cu).
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

// Block AttnRes read (see Note [AttnRes read without keys], ops/attn_res_read.cpp)
// over n <= kMaxReadSources sources, each a contiguous [rows, dim] tensor of
// the same dtype; u = norm weight * query, fp32 [dim]. Forward: per row,
// rstd_i = rsqrt(mean(v_i^2) + eps), dot_i = v_i . u, alpha = softmax_i(
// rstd_i dot_i), out = sum_i alpha_i v_i (in source order); writes rstd,
// dot, alpha as fp32 [n, rows]. Backward: from g = d out, writes dv_i =
// alpha_i g + dd_i u - dr_i v_i (dd_i = dlogit_i rstd_i, dr_i = dlogit_i
// dot_i rstd_i^3 / dim, dlogit_i = alpha_i (g.v_i - sum_j alpha_j g.v_j))
// and du_partial[p, :] = the sum over the rows block p handles of
// sum_i dd_i v_i (the caller sums the parts). One warp a row (see Note [Fused
// AttnRes read, warp per row]).
constexpr int kMaxReadSources = 64;
struct ReadSources {
  const void* p[kMaxReadSources];
};
struct ReadGrads {
  void* p[kMaxReadSources];
};
// The RMSNorm that takes the read's output (see Note [AttnRes read with its
// norm], kernels/attn_res_read.cu), when the launches get one: weight w
// [dim] fp32 and eps; the forward writes out = norm(h) instead of h and the
// norm's rstd [rows]; the backward takes dy, the gradient of norm(h),
// instead of h's, and writes the weight's gradient as dw_partial rows (as
// du_partial). The backward runs in two passes over the sources for up to
// 5 of them (see Note [Read with its norm in two passes]), in three for more.
struct ReadNorm {
  const float* w = nullptr;
  float eps = 0.f;
  float* rstd = nullptr;  // forward: written; backward: read
  const void* dy = nullptr;
  float* dw_partial = nullptr;
};
// Whether the read with its norm runs for these sources (the register
// form: 16-byte aligned rows of at most 2048 bf16 / 1024 fp32).
bool attn_res_read_norm_fits(DType dt, const ReadSources& src, int n, int64_t dim);
// nrm: null, or the norm (attn_res_read_norm_fits).
cudaError_t attn_res_read_forward(DType dt, const ReadSources& src, int n, const float* u,
                                  void* out, float* rstd, float* dot, float* alpha, int64_t rows,
                                  int64_t dim, float eps, cudaStream_t stream,
                                  const ReadNorm* nrm = nullptr);
// How many partial rows attn_res_read_backward writes to du_partial.
int64_t attn_res_read_backward_parts(int64_t rows);
// acc.p[i], when not null: dsrc.p[i] receives acc.p[i] + the gradient
// rounded to the dtype (the two may be the same buffer).
cudaError_t attn_res_read_backward(DType dt, const ReadSources& src, const ReadSources& acc,
                                   const ReadGrads& dsrc, int n, const void* g, const float* u,
                                   const float* rstd, const float* dot, const float* alpha,
                                   float* du_partial, int64_t rows, int64_t dim,
                                   cudaStream_t stream, const ReadNorm* nrm = nullptr);

// out[s, c] = the sum over p of partial[s, p, c], for fp32 partial rows
// [sets, parts, dim] (see Note [Summing the read's partial rows]); in a fixed
// order, bitwise reproducible. With prod: also prod->out_a[c] = out[0, c] *
// prod->a[c] and prod->out_b[c] = out[0, c] * prod->b[c].
struct PartsProducts {
  const float* a = nullptr;
  const float* b = nullptr;
  float* out_a = nullptr;
  float* out_b = nullptr;
};
cudaError_t sum_parts(const float* partial, int64_t parts, int64_t dim, int sets, float* out,
                      cudaStream_t stream, const PartsProducts* prod = nullptr);

}  // namespace viaduct::cuda
