// The MoE router's logits from bf16 tokens and fp32 weights, and their
// gradients.
#include "kernels/common.cuh"
#include "kernels/moe_router.h"

namespace viaduct::cuda {
namespace {

// Note [Router logits from bf16 tokens]
// The router scores tokens in fp32 (a bf16 logit would round the top-k
// choice into ties). In ATen that meant a fp32 copy of the layer's bf16
// input (written, read by the GEMM, and kept for the backward: twice the
// input's bytes per MoE layer), an fp32 input gradient and its cast back to
// bf16. Here the kernels read the bf16 tokens as they are and do the same
// fp32 arithmetic: the forward a warp per few tokens (E dots over D per
// token, each lane's strided partial sums added by the warp in a fixed
// order), dx a thread per 8 columns of a few tokens summing over the
// experts in order, dw as per-block partial sums over the block's rows
// that the caller adds. Only the order
// of the fp32 sums differs from the GEMM's; nothing uses atomics.
//
// The weights are tiny ([E, D]) and every token reads all of them, so the
// forward's warp scores several tokens per load of the weights' chunk and
// dx's thread writes several tokens' columns per load; dw stages each
// tile of token rows in shared memory once for all the experts' warps
// (one read of x from memory instead of one per expert). The sums keep
// their order (each output's terms in the same sequence), so the bits do
// not depend on how many tokens share a load.
constexpr int kVec = 8;            // bf16 values in 16 bytes
constexpr int kExpertChunk = 8;    // experts a warp's lanes sum at once
constexpr int kRouterWarps = 4;    // warps a forward block has
constexpr int kTokensPerWarp = 4;  // tokens a forward warp scores per load of the weights
constexpr int kDxTokens = 4;       // tokens a dx thread writes per load of the weights
constexpr int kPartRows = 256;     // rows a dw part sums
constexpr int kDwTileRows = 32;    // rows a dw block stages at once
constexpr int kDwChunks = 32;      // 8-column chunks a dw block covers: one a lane
constexpr int kDwWarps = 8;        // a dw block's warps; warp j takes experts j, j + 8, ...
constexpr int kDwSlots = kMoeRouterMaxExperts / kDwWarps;  // experts a dw thread sums at most

// 8 fp32 values at p + i as two 16-byte loads (i a multiple of 4, p 16-byte aligned).
__device__ __forceinline__ void load8(const float* p, int64_t i, float (&out)[kVec]) {
  float lo[4], hi[4];
  load_n<float, 4>(p, i, lo);
  load_n<float, 4>(p, i + 4, hi);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    out[k] = lo[k];
    out[4 + k] = hi[k];
  }
}

__global__ void __launch_bounds__(kRouterWarps * 32)
    router_forward_kernel(const __nv_bfloat16* __restrict__ x, const float* __restrict__ w,
                          int64_t N, int64_t D, int E, float* __restrict__ logits) {
  const int64_t n0 =
      (blockIdx.x * static_cast<int64_t>(kRouterWarps) + (threadIdx.x >> 5)) * kTokensPerWarp;
  if (n0 >= N) return;  // a whole warp leaves together
  const int lane = threadIdx.x & 31;
  const int64_t vecs = D / kVec;
  const int nt = N - n0 < kTokensPerWarp ? static_cast<int>(N - n0) : kTokensPerWarp;
  for (int e0 = 0; e0 < E; e0 += kExpertChunk) {
    const int ec = E - e0 < kExpertChunk ? E - e0 : kExpertChunk;
    float acc[kTokensPerWarp][kExpertChunk];
#pragma unroll
    for (int t = 0; t < kTokensPerWarp; ++t) {
#pragma unroll
      for (int e = 0; e < kExpertChunk; ++e) acc[t][e] = 0.f;
    }
    for (int64_t c = lane; c < vecs; c += 32) {
      float wv[kExpertChunk][kVec];
#pragma unroll
      for (int e = 0; e < kExpertChunk; ++e) {
        if (e < ec) load8(w + (e0 + e) * D, c * kVec, wv[e]);
      }
#pragma unroll
      for (int t = 0; t < kTokensPerWarp; ++t) {
        if (t < nt) {
          float xv[kVec];
          load_n<__nv_bfloat16, kVec>(x + (n0 + t) * D, c * kVec, xv);
#pragma unroll
          for (int e = 0; e < kExpertChunk; ++e) {
            if (e < ec) {
#pragma unroll
              for (int k = 0; k < kVec; ++k) acc[t][e] = __fmaf_rn(xv[k], wv[e][k], acc[t][e]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kTokensPerWarp; ++t) {
#pragma unroll
      for (int e = 0; e < kExpertChunk; ++e) {
        const float total = warp_sum(acc[t][e]);
        if (lane == 0 && t < nt && e < ec) logits[(n0 + t) * E + e0 + e] = total;
      }
    }
  }
}

// Thread i: the 8 columns i % vecs of tokens kDxTokens (i / vecs) onwards.
// add_a, add_b: the other consumers' gradients of x, or null.
__global__ void router_dx_kernel(const float* __restrict__ dl, const float* __restrict__ w,
                                 int64_t N, int64_t D, int E,
                                 const __nv_bfloat16* __restrict__ add_a,
                                 const __nv_bfloat16* __restrict__ add_b,
                                 __nv_bfloat16* __restrict__ dx) {
  const int64_t vecs = D / kVec;
  const int64_t groups = (N + kDxTokens - 1) / kDxTokens;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < groups * vecs; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t gi = i / vecs, c = i - gi * vecs;
    const int64_t n0 = gi * kDxTokens;
    const int nt = N - n0 < kDxTokens ? static_cast<int>(N - n0) : kDxTokens;
    float acc[kDxTokens][kVec];
#pragma unroll
    for (int t = 0; t < kDxTokens; ++t) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc[t][k] = 0.f;
    }
    for (int e = 0; e < E; ++e) {
      float wv[kVec];
      load8(w + e * D, c * kVec, wv);
#pragma unroll
      for (int t = 0; t < kDxTokens; ++t) {
        if (t < nt) {
          const float g = dl[(n0 + t) * E + e];
#pragma unroll
          for (int k = 0; k < kVec; ++k) acc[t][k] = __fmaf_rn(g, wv[k], acc[t][k]);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kDxTokens; ++t) {
      if (t < nt) {
        // See Note [The router's backward sums x's gradient].
        const int64_t off = (n0 + t) * D + c * kVec;
        if (add_a != nullptr) {
          float s[kVec];
          load_n<__nv_bfloat16, kVec>(add_a, off, s);
          if (add_b != nullptr) {
            float b[kVec];
            load_n<__nv_bfloat16, kVec>(add_b, off, b);
#pragma unroll
            for (int k = 0; k < kVec; ++k) s[k] = round_as<__nv_bfloat16>(s[k] + b[k]);
          }
#pragma unroll
          for (int k = 0; k < kVec; ++k) acc[t][k] = s[k] + round_as<__nv_bfloat16>(acc[t][k]);
        }
        store_n<__nv_bfloat16, kVec>(dx, off, acc[t]);
      }
    }
  }
}

// Block (p, q): part p's rows [p kPartRows, (p + 1) kPartRows) and the
// column chunks [q kDwChunks, (q + 1) kDwChunks), lane l chunk q kDwChunks
// + l; warp j the experts j, j + kDwWarps, ... Each tile of rows (x's
// chunks and the rows' dl) is staged in shared memory once; every
// (expert, column) sum runs over the part's rows in order. The next tile's
// words are loaded into registers while the warps sum the current one, so
// a block waits on memory once, not once a tile.
constexpr int kDwStageWords = kDwTileRows * kDwChunks / (kDwWarps * 32);  // x words a thread stages
constexpr int kDwStageLogits = kDwTileRows * kMoeRouterMaxExperts / (kDwWarps * 32);
static_assert(kDwTileRows * kDwChunks % (kDwWarps * 32) == 0, "a tile's words split evenly");
static_assert(kDwTileRows * kMoeRouterMaxExperts % (kDwWarps * 32) == 0,
              "a tile's logits split evenly");
__global__ void __launch_bounds__(kDwWarps * 32)
    router_dw_kernel(const float* __restrict__ dl, const __nv_bfloat16* __restrict__ x,
                     int64_t N, int64_t D, int E, float* __restrict__ part) {
  __shared__ uint4 xs[kDwTileRows][kDwChunks];
  __shared__ float gs[kDwTileRows][kMoeRouterMaxExperts];
  const int64_t vecs = D / kVec;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t chunk0 = static_cast<int64_t>(blockIdx.y) * kDwChunks;
  const int64_t c = chunk0 + lane;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kPartRows;
  const int64_t last = first + kPartRows < N ? first + kPartRows : N;
  float acc[kDwSlots][kVec];
#pragma unroll
  for (int s = 0; s < kDwSlots; ++s) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) acc[s][k] = 0.f;
  }
  // A tile's words as this thread stages them: x word j = threadIdx.x + i
  // kDwWarps 32 (row j / kDwChunks, chunk j % kDwChunks), logit j alike
  // (row j / E, expert j % E); zeros past the rows and columns.
  uint4 xw[kDwStageWords];
  float gw[kDwStageLogits];
  auto tile_rows = [&](int64_t r0) {
    return last - r0 < kDwTileRows ? static_cast<int>(last - r0) : kDwTileRows;
  };
  auto load_tile = [&](int64_t r0) {
    const int rows = tile_rows(r0);
#pragma unroll
    for (int i = 0; i < kDwStageWords; ++i) {
      const int j = threadIdx.x + i * kDwWarps * 32, r = j / kDwChunks, cc = j % kDwChunks;
      xw[i] = r < rows && chunk0 + cc < vecs
                  ? __ldg(reinterpret_cast<const uint4*>(x + (r0 + r) * D + (chunk0 + cc) * kVec))
                  : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < kDwStageLogits; ++i) {
      const int j = threadIdx.x + i * kDwWarps * 32;
      gw[i] = j < rows * E ? __ldg(dl + r0 * E + j) : 0.f;
    }
  };
  if (first < last) load_tile(first);
  for (int64_t r0 = first; r0 < last; r0 += kDwTileRows) {
    const int rows = tile_rows(r0);
    __syncthreads();  // the previous tile's reads are done
#pragma unroll
    for (int i = 0; i < kDwStageWords; ++i) {
      const int j = threadIdx.x + i * kDwWarps * 32;
      xs[j / kDwChunks][j % kDwChunks] = xw[i];
    }
#pragma unroll
    for (int i = 0; i < kDwStageLogits; ++i) {
      const int j = threadIdx.x + i * kDwWarps * 32;
      if (j < rows * E) gs[j / E][j % E] = gw[i];
    }
    __syncthreads();
    if (r0 + kDwTileRows < last) load_tile(r0 + kDwTileRows);
    if (c < vecs) {
      for (int r = 0; r < rows; ++r) {
        float xv[kVec];
        load_n<__nv_bfloat16, kVec>(reinterpret_cast<const __nv_bfloat16*>(&xs[r][lane]), 0,
                                    xv);
#pragma unroll
        for (int s = 0; s < kDwSlots; ++s) {
          const int e = warp + kDwWarps * s;
          if (e < E) {
            const float g = gs[r][e];
#pragma unroll
            for (int k = 0; k < kVec; ++k) acc[s][k] = __fmaf_rn(g, xv[k], acc[s][k]);
          }
        }
      }
    }
  }
  if (c >= vecs) return;
#pragma unroll
  for (int s = 0; s < kDwSlots; ++s) {
    const int e = warp + kDwWarps * s;
    if (e < E) {
      float* out = part + (static_cast<int64_t>(blockIdx.x) * E + e) * D + c * kVec;
      float lo[4], hi[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        lo[k] = acc[s][k];
        hi[k] = acc[s][4 + k];
      }
      store_n<float, 4>(out, 0, lo);
      store_n<float, 4>(out, 4, hi);
    }
  }
}

bool shapes_ok(const void* x, const float* w, int64_t D, int E) {
  return D > 0 && D % kVec == 0 && E >= 1 && E <= kMoeRouterMaxExperts && aligned16(x) &&
         aligned16(w);
}

}  // namespace

cudaError_t moe_router_forward(const void* x, const float* w, int64_t N, int64_t D, int E,
                               float* logits, cudaStream_t stream) {
  if (!shapes_ok(x, w, D, E)) return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  constexpr int per_block = kRouterWarps * kTokensPerWarp;
  const auto blocks = static_cast<unsigned>((N + per_block - 1) / per_block);
  router_forward_kernel<<<blocks, kRouterWarps * 32, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), w, N, D, E, logits);
  return cudaGetLastError();
}

int64_t moe_router_backward_parts(int64_t N) {
  const int64_t parts = (N + kPartRows - 1) / kPartRows;
  return parts < 1 ? 1 : parts;
}

cudaError_t moe_router_backward(const float* dlogits, const void* x, const float* w, int64_t N,
                                int64_t D, int E, const void* add_a, const void* add_b,
                                void* dx, float* dw_partial, cudaStream_t stream) {
  if (!shapes_ok(x, w, D, E) || !aligned16(dx) || !aligned16(dw_partial) ||
      !aligned16(add_a) || !aligned16(add_b) || (add_a == nullptr && add_b != nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int64_t vecs = D / kVec;
  if (N > 0) {
    const int64_t groups = (N + kDxTokens - 1) / kDxTokens;
    router_dx_kernel<<<elementwise_blocks(groups * vecs), kElemThreads, 0, stream>>>(
        dlogits, w, N, D, E, static_cast<const __nv_bfloat16*>(add_a),
        static_cast<const __nv_bfloat16*>(add_b), static_cast<__nv_bfloat16*>(dx));
  }
  const int64_t parts = moe_router_backward_parts(N);
  const dim3 grid(static_cast<unsigned>(parts),
                  static_cast<unsigned>((vecs + kDwChunks - 1) / kDwChunks));
  router_dw_kernel<<<grid, kDwWarps * 32, 0, stream>>>(
      dlogits, static_cast<const __nv_bfloat16*>(x), N, D, E, dw_partial);
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
