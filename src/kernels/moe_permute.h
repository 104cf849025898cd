// MoE permute and combine launches (kernels/moe_permute.cu): the token rows
// into their experts' padded groups and the experts' rows back into each
// token's gated sum, one pass each way (see Note [MoE rows moved in one
// pass], kernels/moe_permute.cu). bf16 rows of D values, D a multiple of
// 8, every row pointer 16-byte aligned.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace viaduct::cuda {

// out [rows, D]: row r = x[row_slot[r] / K], or zeros where row_slot[r] < 0
// (a padding row). x [N, D]. Copies bits.
cudaError_t moe_permute(const void* x, const int64_t* row_slot, int64_t rows, int64_t D, int K,
                        void* out, cudaStream_t stream);
// dx [N, D]: dx[n] = sum over j < K, ascending, of dout[pos[n K + j]], in
// fp32, rounded once (the gradient of moe_permute).
cudaError_t moe_permute_backward(const void* dout, const int64_t* pos, int64_t N, int64_t D,
                                 int K, void* dx, cudaStream_t stream);
// out [N, D]: out[n] = sum over j ascending of bf16(ys[pos[n K + j]] * g[n K + j])
// in fp32, rounded once. ys [rows, D], g [N K] bf16. With base [N, D]
// (null: none): out[n] = bf16(bf16(that sum) + base[n]), the bits of the
// sum followed by an add of base.
cudaError_t moe_combine(const void* ys, const int64_t* pos, const void* g, const void* base,
                        int64_t N, int64_t D, int K, void* out, cudaStream_t stream);
// The gradients of moe_combine: dys [rows, D], row r = bf16(dout[s / K] *
// g[s]) for s = row_slot[r], zeros where s < 0; dg [N K] fp32: the bf16
// rounding of sum_d bf16(dout[s / K, d] * ys[pos[s], d]), each slot's sum
// over D in a fixed order.
cudaError_t moe_combine_backward(const void* dout, const void* ys, const void* g,
                                 const int64_t* pos, const int64_t* row_slot, int64_t N,
                                 int64_t rows, int64_t D, int K, void* dys, float* dg,
                                 cudaStream_t stream);

}  // namespace viaduct::cuda
