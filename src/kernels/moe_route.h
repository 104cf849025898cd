// MoE routing launches (kernels/moe_route.cu): the top-k choice of experts
// and the permutation of the chosen slots into padded expert groups.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace viaduct::cuda {

// The most experts moe_topk takes (eight per lane of a warp).
constexpr int kMoeTopkMaxExperts = 256;

// idx [N, K] (int64): for each row of scores [N, E] (fp32), the K experts
// of the largest scores[n, e] + bias[e], largest first; among equal sums
// the lower expert id first. Sums are ordered as a radix sort of floats
// orders them (their bits made monotone: -0 below +0), which is how a
// stable descending sort of the same sums on the GPU orders them.
// K <= E <= kMoeTopkMaxExperts.
cudaError_t moe_topk(const float* scores, const float* bias, int64_t N, int E, int K,
                     int64_t* idx, cudaStream_t stream);

// The blocks moe_dispatch's scratch is sized by: ceil(S / kMoeDispatchBlock).
constexpr int kMoeDispatchBlock = 1024;

// The rows the padded groups of S slots over E experts can take at most:
// every group rounded up by less than align, an empty one align rows.
constexpr int64_t moe_dispatch_rows(int64_t S, int64_t E, int64_t align) {
  return S + align * E;
}

// Slot s of expert[s] (S slots, int64 ids in [0, E)) goes to row pos[s]:
// expert e's slots fill a group of rows padded to a multiple of align (at
// least align rows) in slot order, the groups in expert order. Writes
// counts [E] (int64: slots per expert), offs [E] (int32: each group's end
// row), pos [S] (int64) and its inverse row_slot [moe_dispatch_rows(S, E,
// align)] (int64: each row's slot, -1 for padding and unused rows).
// Scratch: rank [S] and hist [blocks, E] (int32). Integer counts only, so
// the result does not depend on scheduling.
cudaError_t moe_dispatch(const int64_t* expert, int64_t S, int E, int align, int32_t* rank,
                         int32_t* hist, int64_t* counts, int32_t* offs, int64_t* pos,
                         int64_t* row_slot, cudaStream_t stream);

}  // namespace viaduct::cuda
