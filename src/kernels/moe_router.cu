// The MoE router's logits from bf16 tokens and fp32 weights, and their
// gradients.
#include <type_traits>

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
// experts in order, dw as per-part partial sums over the part's rows
// that the caller adds. Only the order
// of the fp32 sums differs from the GEMM's; nothing uses atomics.
//
// The weights are tiny ([E, D]) and every token reads all of them, so the
// forward's warp scores several tokens per load of the weights' chunk and
// dx's thread writes several tokens' columns per load. dw's thread owns
// a few columns and a group of up to 8 experts: each x word is unpacked
// once for all the group's experts (not once per expert's warp), and the
// thread has many rows' loads in flight. The sums keep their order (each
// output's terms in the same sequence), so the bits do not depend on how
// many tokens share a load.
constexpr int kVec = 8;            // bf16 values in 16 bytes
constexpr int kExpertChunk = 8;    // experts a warp's lanes sum at once
constexpr int kRouterWarps = 4;    // warps a forward block has
constexpr int kTokensPerWarp = 4;  // tokens a forward warp scores per load of the weights
constexpr int kDxTokens = 4;       // tokens a dx thread writes per load of the weights
constexpr int kPartRows = 256;     // rows a dw part sums
constexpr int kDwCols = 4;         // columns a dw thread sums: one word of x a row (2 or 4)
constexpr int kDwExperts = 8;      // experts a dw thread sums
constexpr int kDwRowsInFlight = 16;  // rows whose x words a dw thread loads together
constexpr int kDwThreads = 64;     // a dw block's threads

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

// Block (p, b, q), numbered with q fastest: part p's rows [p kPartRows,
// (p + 1) kPartRows), the experts [q kDwExperts, (q + 1) kDwExperts), and
// thread t of column block b the kDwCols columns of word b kDwThreads + t.
// The part's logits of those experts are staged in shared memory once;
// each (expert, column) sum then runs over the part's rows in order,
// kDwRowsInFlight rows' x words loaded together before any is used. The
// blocks of one part and column block differ only in q and run side by
// side, so where E > kDwExperts the later reads of x find it in L2.
__global__ void __launch_bounds__(kDwThreads)
    router_dw_kernel(const float* __restrict__ dl, const __nv_bfloat16* __restrict__ x,
                     int64_t N, int64_t D, int E, float* __restrict__ part) {
  static_assert(kDwExperts == 8, "a row's staged logits are read as two float4");
  static_assert(kDwCols == 2 || kDwCols == 4, "a thread's columns are one 4- or 8-byte word");
  using XWord = std::conditional_t<kDwCols == 4, uint2, unsigned>;
  __shared__ alignas(16) float gs[kPartRows][kDwExperts];
  const int64_t words = D / kDwCols;
  const int64_t col_blocks = (words + kDwThreads - 1) / kDwThreads;
  const int groups = (E + kDwExperts - 1) / kDwExperts;
  const int q = static_cast<int>(blockIdx.x % groups);
  const int64_t pb = blockIdx.x / groups;
  const int64_t p = pb / col_blocks;
  const int64_t w = (pb % col_blocks) * kDwThreads + threadIdx.x;
  const int e0 = q * kDwExperts;
  const int ne = E - e0 < kDwExperts ? E - e0 : kDwExperts;
  const int64_t first = p * kPartRows;
  const int rows = static_cast<int>(N - first < kPartRows ? N - first : kPartRows);
  for (int j = threadIdx.x; j < rows * kDwExperts; j += kDwThreads) {
    const int r = j / kDwExperts, e = j % kDwExperts;
    gs[r][e] = e < ne ? __ldg(dl + (first + r) * E + e0 + e) : 0.f;
  }
  __syncthreads();
  if (w >= words) return;
  float acc[kDwExperts][kDwCols];
#pragma unroll
  for (int e = 0; e < kDwExperts; ++e) {
#pragma unroll
    for (int k = 0; k < kDwCols; ++k) acc[e][k] = 0.f;
  }
  const __nv_bfloat16* xc = x + first * D + w * kDwCols;
  for (int r0 = 0; r0 < rows; r0 += kDwRowsInFlight) {
    XWord xw[kDwRowsInFlight];
#pragma unroll
    for (int u = 0; u < kDwRowsInFlight; ++u) {
      xw[u] = r0 + u < rows ? __ldg(reinterpret_cast<const XWord*>(xc + (r0 + u) * D)) : XWord{};
    }
#pragma unroll
    for (int u = 0; u < kDwRowsInFlight; ++u) {
      if (r0 + u < rows) {
        const __nv_bfloat16* xe = reinterpret_cast<const __nv_bfloat16*>(&xw[u]);
        float xv[kDwCols];
#pragma unroll
        for (int k = 0; k < kDwCols; ++k) xv[k] = load(xe, k);
        const float4 g_lo = *reinterpret_cast<const float4*>(&gs[r0 + u][0]);
        const float4 g_hi = *reinterpret_cast<const float4*>(&gs[r0 + u][4]);
        const float g[kDwExperts] = {g_lo.x, g_lo.y, g_lo.z, g_lo.w,
                                     g_hi.x, g_hi.y, g_hi.z, g_hi.w};
#pragma unroll
        for (int e = 0; e < kDwExperts; ++e) {
          if (e < ne) {
#pragma unroll
            for (int k = 0; k < kDwCols; ++k) acc[e][k] = __fmaf_rn(g[e], xv[k], acc[e][k]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int e = 0; e < kDwExperts; ++e) {
    if (e < ne) {
      float* out = part + (p * E + e0 + e) * D + w * kDwCols;
      store_n<float, kDwCols>(out, 0, acc[e]);
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
  const int64_t blocks = moe_router_backward_parts(N) *
                         ((D / kDwCols + kDwThreads - 1) / kDwThreads) *
                         ((E + kDwExperts - 1) / kDwExperts);
  router_dw_kernel<<<static_cast<unsigned>(blocks), kDwThreads, 0, stream>>>(
      dlogits, static_cast<const __nv_bfloat16*>(x), N, D, E, dw_partial);
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
