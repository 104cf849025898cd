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
// fp32 arithmetic: the forward one warp per token (E dots over D, each
// lane's strided partial sums added by the warp in a fixed order), dx one
// thread per 8 columns summing over the experts in order, dw as per-block
// partial sums over the block's rows that the caller adds. Only the order
// of the fp32 sums differs from the GEMM's; nothing uses atomics.
constexpr int kVec = 8;           // bf16 values in 16 bytes
constexpr int kExpertChunk = 8;   // experts a warp's lanes sum at once
constexpr int kRouterWarps = 8;   // tokens a forward block takes
constexpr int kPartRows = 256;    // rows a dw part sums

__global__ void __launch_bounds__(kRouterWarps * 32)
    router_forward_kernel(const __nv_bfloat16* __restrict__ x, const float* __restrict__ w,
                          int64_t N, int64_t D, int E, float* __restrict__ logits) {
  const int64_t n = blockIdx.x * static_cast<int64_t>(kRouterWarps) + (threadIdx.x >> 5);
  if (n >= N) return;  // a whole warp leaves together
  const int lane = threadIdx.x & 31;
  const int64_t vecs = D / kVec;
  const __nv_bfloat16* xr = x + n * D;
  for (int e0 = 0; e0 < E; e0 += kExpertChunk) {
    const int ec = E - e0 < kExpertChunk ? E - e0 : kExpertChunk;
    float acc[kExpertChunk];
#pragma unroll
    for (int e = 0; e < kExpertChunk; ++e) acc[e] = 0.f;
    for (int64_t c = lane; c < vecs; c += 32) {
      float xv[kVec];
      load_n<__nv_bfloat16, kVec>(xr, c * kVec, xv);
#pragma unroll
      for (int e = 0; e < kExpertChunk; ++e) {
        if (e < ec) {
          float wv[4], wu[4];
          load_n<float, 4>(w + (e0 + e) * D, c * kVec, wv);
          load_n<float, 4>(w + (e0 + e) * D, c * kVec + 4, wu);
#pragma unroll
          for (int k = 0; k < 4; ++k) acc[e] = __fmaf_rn(xv[k], wv[k], acc[e]);
#pragma unroll
          for (int k = 0; k < 4; ++k) acc[e] = __fmaf_rn(xv[4 + k], wu[k], acc[e]);
        }
      }
    }
#pragma unroll
    for (int e = 0; e < kExpertChunk; ++e) {
      const float total = warp_sum(acc[e]);
      if (lane == 0 && e < ec) logits[n * E + e0 + e] = total;
    }
  }
}

__global__ void router_dx_kernel(const float* __restrict__ dl, const float* __restrict__ w,
                                 int64_t N, int64_t D, int E, __nv_bfloat16* __restrict__ dx) {
  const int64_t vecs = D / kVec;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < N * vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / vecs, c = i - n * vecs;
    float acc[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) acc[k] = 0.f;
    for (int e = 0; e < E; ++e) {
      const float g = dl[n * E + e];
      float wv[4], wu[4];
      load_n<float, 4>(w + e * D, c * kVec, wv);
      load_n<float, 4>(w + e * D, c * kVec + 4, wu);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        acc[k] = __fmaf_rn(g, wv[k], acc[k]);
        acc[4 + k] = __fmaf_rn(g, wu[k], acc[4 + k]);
      }
    }
    store_n<__nv_bfloat16, kVec>(dx, n * D + c * kVec, acc);
  }
}

// Block (p, y): rows [p kPartRows, (p + 1) kPartRows) of part p; each
// thread one (expert, 8 columns) pair of the part.
__global__ void router_dw_kernel(const float* __restrict__ dl, const __nv_bfloat16* __restrict__ x,
                                 int64_t N, int64_t D, int E, float* __restrict__ part) {
  const int64_t vecs = D / kVec;
  const int64_t t = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= E * vecs) return;
  const int64_t e = t / vecs, c = t - e * vecs;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kPartRows;
  const int64_t last = first + kPartRows < N ? first + kPartRows : N;
  float lo[4] = {0.f, 0.f, 0.f, 0.f}, hi[4] = {0.f, 0.f, 0.f, 0.f};
  // Unrolled so that several rows' loads are in flight at once (one row at
  // a time waits out each load's latency); the sums still run in row order.
#pragma unroll 8
  for (int64_t n = first; n < last; ++n) {
    const float g = dl[n * E + e];
    float xv[kVec];
    load_n<__nv_bfloat16, kVec>(x, n * D + c * kVec, xv);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      lo[k] = __fmaf_rn(g, xv[k], lo[k]);
      hi[k] = __fmaf_rn(g, xv[4 + k], hi[k]);
    }
  }
  float* out = part + (static_cast<int64_t>(blockIdx.x) * E + e) * D + c * kVec;
  store_n<float, 4>(out, 0, lo);
  store_n<float, 4>(out, 4, hi);
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
  const auto blocks = static_cast<unsigned>((N + kRouterWarps - 1) / kRouterWarps);
  router_forward_kernel<<<blocks, kRouterWarps * 32, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), w, N, D, E, logits);
  return cudaGetLastError();
}

int64_t moe_router_backward_parts(int64_t N) {
  const int64_t parts = (N + kPartRows - 1) / kPartRows;
  return parts < 1 ? 1 : parts;
}

cudaError_t moe_router_backward(const float* dlogits, const void* x, const float* w, int64_t N,
                                int64_t D, int E, void* dx, float* dw_partial,
                                cudaStream_t stream) {
  if (!shapes_ok(x, w, D, E) || !aligned16(dx) || !aligned16(dw_partial)) {
    return cudaErrorInvalidValue;
  }
  const int64_t vecs = D / kVec;
  if (N > 0) {
    router_dx_kernel<<<elementwise_blocks(N * vecs), kElemThreads, 0, stream>>>(
        dlogits, w, N, D, E, static_cast<__nv_bfloat16*>(dx));
  }
  const int64_t parts = moe_router_backward_parts(N);
  const dim3 grid(static_cast<unsigned>(parts),
                  static_cast<unsigned>((E * vecs + kElemThreads - 1) / kElemThreads));
  router_dw_kernel<<<grid, kElemThreads, 0, stream>>>(
      dlogits, static_cast<const __nv_bfloat16*>(x), N, D, E, dw_partial);
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
