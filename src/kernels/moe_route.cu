// MoE routing kernels: the top-k choice per token (a warp a token) and the
// dispatch into padded expert groups (a count pass and a placement pass).
#include "kernels/moe_route.h"

#include <cuda_runtime.h>

#include <algorithm>

namespace viaduct::cuda {
namespace {

constexpr int kTopkThreads = 256;
constexpr int kPerLane = kMoeTopkMaxExperts / 32;

// A float's bits made monotone as unsigned integers (a radix sort's key):
// negatives flipped whole, positives with the sign bit set.
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// (key, expert) pairs: a larger key wins, then the lower expert id.
__device__ __forceinline__ bool beats(uint32_t ka, int ea, uint32_t kb, int eb) {
  return ka > kb || (ka == kb && ea < eb);
}

__global__ void __launch_bounds__(kTopkThreads)
    topk_kernel(const float* __restrict__ scores, const float* __restrict__ bias, int64_t N,
                int E, int K, int64_t* __restrict__ idx) {
  const int lane = threadIdx.x % 32;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * (kTopkThreads / 32) + threadIdx.x / 32;
  if (n >= N) return;
  uint32_t key[kPerLane];
  bool taken[kPerLane];
#pragma unroll
  for (int m = 0; m < kPerLane; ++m) {
    const int e = lane + 32 * m;
    taken[m] = e >= E;
    key[m] = e < E ? order_key(scores[n * E + e] + bias[e]) : 0u;
  }
  for (int r = 0; r < K; ++r) {
    // This lane's best untaken expert, then the warp's.
    uint32_t bk = 0;
    int be = -1;
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      const int e = lane + 32 * m;
      if (!taken[m] && (be < 0 || beats(key[m], e, bk, be))) {
        bk = key[m];
        be = e;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const uint32_t ok = __shfl_xor_sync(0xffffffffu, bk, off);
      const int oe = __shfl_xor_sync(0xffffffffu, be, off);
      if (oe >= 0 && (be < 0 || beats(ok, oe, bk, be))) {
        bk = ok;
        be = oe;
      }
    }
    if (lane == 0) idx[n * K + r] = be;
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) taken[m] = taken[m] || be == lane + 32 * m;
  }
}

// Pass 1, a block per kMoeDispatchBlock slots: each slot's rank among the
// block's earlier slots of its expert (a warp's by matching lanes, then the
// earlier warps' counts) and the block's count per expert.
__global__ void __launch_bounds__(kMoeDispatchBlock)
    dispatch_count_kernel(const int64_t* __restrict__ expert, int64_t S, int E,
                          int32_t* __restrict__ rank, int32_t* __restrict__ hist) {
  extern __shared__ int32_t warp_counts[];  // [32 warps][E]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int i = tid; i < 32 * E; i += kMoeDispatchBlock) warp_counts[i] = 0;
  __syncthreads();
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kMoeDispatchBlock + tid;
  const int e = s < S ? static_cast<int>(expert[s]) : -1;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int in_warp = __popc(peers & ((1u << lane) - 1u));
  if (e >= 0 && in_warp == 0) warp_counts[warp * E + e] = __popc(peers);
  __syncthreads();
  // Exclusive sums over the warps, per expert, in warp order.
  for (int x = tid; x < E; x += kMoeDispatchBlock) {
    int32_t acc = 0;
    for (int w = 0; w < 32; ++w) {
      const int32_t c = warp_counts[w * E + x];
      warp_counts[w * E + x] = acc;
      acc += c;
    }
    hist[static_cast<int64_t>(blockIdx.x) * E + x] = acc;
  }
  __syncthreads();
  if (e >= 0) rank[s] = warp_counts[warp * E + e] + in_warp;
}

// Pass 2, the same blocks: each expert's slots in earlier blocks and in
// all, the padded groups' starts (one thread, experts in order), and each
// slot's row. Block 0 also writes counts and offs.
__global__ void __launch_bounds__(kMoeDispatchBlock)
    dispatch_place_kernel(const int64_t* __restrict__ expert, int64_t S, int E, int align,
                          int64_t blocks, const int32_t* __restrict__ rank,
                          const int32_t* __restrict__ hist, int64_t* __restrict__ counts,
                          int32_t* __restrict__ offs, int64_t* __restrict__ pos,
                          int64_t* __restrict__ row_slot) {
  extern __shared__ int64_t base[];  // [E]: the group's start plus the earlier blocks' slots
  int64_t* total = base + E;        // [E]
  const int tid = threadIdx.x;
  for (int x = tid; x < E; x += kMoeDispatchBlock) {
    int64_t before = 0, all = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c = hist[b * E + x];
      if (b < blockIdx.x) before += c;
      all += c;
    }
    base[x] = before;
    total[x] = all;
  }
  __syncthreads();
  if (tid == 0) {
    int64_t end = 0;
    for (int x = 0; x < E; ++x) {
      const int64_t padded = total[x] > 0 ? (total[x] + align - 1) / align * align : align;
      base[x] += end;
      end += padded;
      if (blockIdx.x == 0) {
        counts[x] = total[x];
        offs[x] = static_cast<int32_t>(end);
      }
    }
  }
  __syncthreads();
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kMoeDispatchBlock + tid;
  if (s < S) {
    const int64_t row = base[expert[s]] + rank[s];
    pos[s] = row;
    row_slot[row] = s;  // rows are distinct: a permutation's inverse, no races
  }
}

}  // namespace

cudaError_t moe_topk(const float* scores, const float* bias, int64_t N, int E, int K,
                     int64_t* idx, cudaStream_t stream) {
  if (E < 1 || E > kMoeTopkMaxExperts || K < 1 || K > E) return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  constexpr int per_block = kTopkThreads / 32;
  const auto blocks = static_cast<unsigned>((N + per_block - 1) / per_block);
  topk_kernel<<<blocks, kTopkThreads, 0, stream>>>(scores, bias, N, E, K, idx);
  return cudaGetLastError();
}

cudaError_t moe_dispatch(const int64_t* expert, int64_t S, int E, int align, int32_t* rank,
                         int32_t* hist, int64_t* counts, int32_t* offs, int64_t* pos,
                         int64_t* row_slot, cudaStream_t stream) {
  if (E < 1 || align < 1) return cudaErrorInvalidValue;
  // Every row -1 (all bytes 0xFF) first; the placement writes the slots'.
  if (auto e = cudaMemsetAsync(row_slot, 0xFF, sizeof(int64_t) * moe_dispatch_rows(S, E, align),
                               stream);
      e != cudaSuccess) {
    return e;
  }
  // At least one block, so that no slots still give counts and groups.
  const int64_t blocks = std::max<int64_t>(1, (S + kMoeDispatchBlock - 1) / kMoeDispatchBlock);
  const size_t count_smem = sizeof(int32_t) * 32 * E;
  if (count_smem > 48 * 1024) {
    if (auto e = cudaFuncSetAttribute(dispatch_count_kernel,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(count_smem));
        e != cudaSuccess) {
      return e;
    }
  }
  dispatch_count_kernel<<<static_cast<unsigned>(blocks), kMoeDispatchBlock, count_smem, stream>>>(
      expert, S, E, rank, hist);
  dispatch_place_kernel<<<static_cast<unsigned>(blocks), kMoeDispatchBlock,
                          sizeof(int64_t) * 2 * E, stream>>>(expert, S, E, align, blocks, rank,
                                                             hist, counts, offs, pos,
                                                             row_slot);
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
