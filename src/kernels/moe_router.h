// The MoE router's logits from bf16 tokens and fp32 weights
// (kernels/moe_router.cu; see Note [Router logits from bf16 tokens]).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace viaduct::cuda {

// The most experts the router kernels take.
constexpr int kMoeRouterMaxExperts = 64;

// logits [N, E] fp32 = x [N, D] (bf16, as fp32) times w [E, D] (fp32)
// transposed, each dot in fp32 in a fixed order. D a multiple of 8, x and w
// 16-byte aligned, E <= kMoeRouterMaxExperts.
cudaError_t moe_router_forward(const void* x, const float* w, int64_t N, int64_t D, int E,
                               float* logits, cudaStream_t stream);
// How many partial rows moe_router_backward writes to dw_partial.
int64_t moe_router_backward_parts(int64_t N);
// dx [N, D] bf16 = dlogits [N, E] times w, each element a sum over e in
// ascending order, rounded once, plus the gradients of x's other consumers
// when given (bf16 [N, D], 16-byte aligned, null for none; see Note [The
// router's backward sums x's gradient]): with one, a + r; with two,
// (a + b) + r, each sum rounded to bf16, r the router's own term rounded.
// dw_partial [parts, E, D] fp32: part p the sum over its rows of
// dlogits[n, e] x[n, d] (the caller adds the parts).
cudaError_t moe_router_backward(const float* dlogits, const void* x, const float* w, int64_t N,
                                int64_t D, int E, const void* add_a, const void* add_b,
                                void* dx, float* dw_partial, cudaStream_t stream);

}  // namespace viaduct::cuda
