// The MoE's token rows into padded expert groups and back, one pass each way.
#include "kernels/common.cuh"
#include "kernels/moe_permute.h"

namespace viaduct::cuda {
namespace {

// Note [MoE rows moved in one pass]
// The grouped experts read their rows from a buffer of padded groups and
// write their outputs in the same order (the buffer's layout:
// see Note [MoE dispatch into padded groups], ops/moe.h). In ATen the way in was three passes over N K rows --
// the token copies materialised (expand + reshape), a zero fill of the
// buffer, an index_copy into it -- and the way out three more: a gather of
// the N K output rows, their product with the gates, the sum over K. Here
// each direction is one pass: moe_permute reads each buffer row from its
// token (or writes zeros), moe_combine reads a token's K rows and sums
// them gated. The arithmetic is the ATen form's: copies are bits; each
// gated product is rounded to bf16 before it is added, the K terms are
// added in ascending j in fp32 and rounded once, as ATen's bf16 sum over
// a small dimension adds them. The gradients are the same passes read
// backwards: dx sums a token's K buffer rows, dys scales each buffer row
// by its gate, and each gate's gradient is a warp's fixed-order sum over D
// (the one value whose order differs from ATen's reduction). No atomics:
// every output element has one writer.
constexpr int kVec = 8;  // bf16 values in 16 bytes

__global__ void permute_kernel(const uint4* __restrict__ x, const int64_t* __restrict__ row_slot,
                               int64_t rows, int64_t vecs, int K, uint4* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / vecs, c = i - r * vecs;
    const int64_t s = row_slot[r];
    out[i] = s >= 0 ? x[(s / K) * vecs + c] : make_uint4(0u, 0u, 0u, 0u);
  }
}

__global__ void permute_backward_kernel(const __nv_bfloat16* __restrict__ dout,
                                        const int64_t* __restrict__ pos, int64_t N, int64_t vecs,
                                        int K, __nv_bfloat16* __restrict__ dx) {
  const int64_t D = vecs * kVec;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < N * vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / vecs, c = i - n * vecs;
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
    for (int j = 0; j < K; ++j) {
      const int64_t at = pos[n * K + j] * D + c * kVec;
      float v[kVec];
      load_n<__nv_bfloat16, kVec>(dout, at, v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] = __fadd_rn(acc[e], v[e]);
    }
    store_n<__nv_bfloat16, kVec>(dx, n * D + c * kVec, acc);
  }
}

__global__ void combine_kernel(const __nv_bfloat16* __restrict__ ys,
                               const int64_t* __restrict__ pos,
                               const __nv_bfloat16* __restrict__ g,
                               const __nv_bfloat16* __restrict__ base, int64_t N, int64_t vecs,
                               int K, __nv_bfloat16* __restrict__ out) {
  const int64_t D = vecs * kVec;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < N * vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / vecs, c = i - n * vecs;
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
    for (int j = 0; j < K; ++j) {
      const int64_t s = n * K + j;
      const float gate = __bfloat162float(g[s]);
      float v[kVec];
      load_n<__nv_bfloat16, kVec>(ys, pos[s] * D + c * kVec, v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        acc[e] = __fadd_rn(acc[e], round_as<__nv_bfloat16>(__fmul_rn(v[e], gate)));
      }
    }
    if (base != nullptr) {  // the sum rounded as stored, then the add's fp32 sum
      float b[kVec];
      load_n<__nv_bfloat16, kVec>(base, n * D + c * kVec, b);
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] = __fadd_rn(round_as<__nv_bfloat16>(acc[e]), b[e]);
    }
    store_n<__nv_bfloat16, kVec>(out, n * D + c * kVec, acc);
  }
}

// The rows no slot fills (each group's padding): zeros, the gradient of
// rows the combine never read.
__global__ void zero_padding_rows_kernel(const int64_t* __restrict__ row_slot, int64_t rows,
                                         int64_t vecs, uint4* __restrict__ dys) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (row_slot[i / vecs] < 0) dys[i] = make_uint4(0u, 0u, 0u, 0u);
  }
}

// One warp per slot: its row's gradient, dout times the gate rounded to
// bf16, and its gate's gradient, from one read of dout's row and the
// expert's row for both.
constexpr int kGateWarps = 8;
__global__ void __launch_bounds__(kGateWarps * 32)
    combine_backward_kernel(const __nv_bfloat16* __restrict__ dout,
                            const __nv_bfloat16* __restrict__ ys,
                            const __nv_bfloat16* __restrict__ g, const int64_t* __restrict__ pos,
                            int64_t slots, int64_t vecs, int K, __nv_bfloat16* __restrict__ dys,
                            float* __restrict__ dg) {
  const int64_t s = blockIdx.x * static_cast<int64_t>(kGateWarps) + (threadIdx.x >> 5);
  if (s >= slots) return;  // a whole warp leaves together
  const int lane = threadIdx.x & 31;
  const int64_t D = vecs * kVec;
  const __nv_bfloat16* a = dout + (s / K) * D;
  const int64_t row = pos[s];
  const __nv_bfloat16* b = ys + row * D;
  __nv_bfloat16* out = dys + row * D;
  const float gate = __bfloat162float(g[s]);
  float part = 0.f;
  for (int64_t c = lane; c < vecs; c += 32) {
    float u[kVec], v[kVec], d[kVec];
    load_n<__nv_bfloat16, kVec>(a, c * kVec, u);
    load_n<__nv_bfloat16, kVec>(b, c * kVec, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      part = __fadd_rn(part, round_as<__nv_bfloat16>(__fmul_rn(u[e], v[e])));
      d[e] = __fmul_rn(u[e], gate);
    }
    store_n<__nv_bfloat16, kVec>(out, c * kVec, d);
  }
  const float total = warp_sum(part);
  if (lane == 0) dg[s] = round_as<__nv_bfloat16>(total);
}

bool rows_ok(const void* p, int64_t D) { return D > 0 && D % kVec == 0 && aligned16(p); }

}  // namespace

cudaError_t moe_permute(const void* x, const int64_t* row_slot, int64_t rows, int64_t D, int K,
                        void* out, cudaStream_t stream) {
  if (!rows_ok(x, D) || !aligned16(out) || K < 1) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const int64_t vecs = D / kVec;
  permute_kernel<<<elementwise_blocks(rows * vecs), kElemThreads, 0, stream>>>(
      static_cast<const uint4*>(x), row_slot, rows, vecs, K, static_cast<uint4*>(out));
  return cudaGetLastError();
}

cudaError_t moe_permute_backward(const void* dout, const int64_t* pos, int64_t N, int64_t D,
                                 int K, void* dx, cudaStream_t stream) {
  if (!rows_ok(dout, D) || !aligned16(dx) || K < 1) {
    return cudaErrorInvalidValue;
  }
  if (N == 0) return cudaSuccess;
  const int64_t vecs = D / kVec;
  permute_backward_kernel<<<elementwise_blocks(N * vecs), kElemThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(dout), pos, N, vecs, K, static_cast<__nv_bfloat16*>(dx));
  return cudaGetLastError();
}

cudaError_t moe_combine(const void* ys, const int64_t* pos, const void* g, const void* base,
                        int64_t N, int64_t D, int K, void* out, cudaStream_t stream) {
  if (!rows_ok(ys, D) || !aligned16(out) || !aligned16(base) || K < 1) {
    return cudaErrorInvalidValue;
  }
  if (N == 0) return cudaSuccess;
  const int64_t vecs = D / kVec;
  combine_kernel<<<elementwise_blocks(N * vecs), kElemThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(ys), pos, static_cast<const __nv_bfloat16*>(g),
      static_cast<const __nv_bfloat16*>(base), N, vecs, K, static_cast<__nv_bfloat16*>(out));
  return cudaGetLastError();
}

cudaError_t moe_combine_backward(const void* dout, const void* ys, const void* g,
                                 const int64_t* pos, const int64_t* row_slot, int64_t N,
                                 int64_t rows, int64_t D, int K, void* dys, float* dg,
                                 cudaStream_t stream) {
  if (!rows_ok(dout, D) || !rows_ok(ys, D) || !aligned16(dys) || K < 1) {
    return cudaErrorInvalidValue;
  }
  const int64_t vecs = D / kVec;
  if (rows > 0) {
    zero_padding_rows_kernel<<<elementwise_blocks(rows * vecs), kElemThreads, 0, stream>>>(
        row_slot, rows, vecs, static_cast<uint4*>(dys));
  }
  const int64_t slots = N * K;
  if (slots > 0) {
    const auto blocks = static_cast<unsigned>((slots + kGateWarps - 1) / kGateWarps);
    combine_backward_kernel<<<blocks, kGateWarps * 32, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(dout), static_cast<const __nv_bfloat16*>(ys),
        static_cast<const __nv_bfloat16*>(g), pos, slots, vecs, K,
        static_cast<__nv_bfloat16*>(dys), dg);
  }
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
