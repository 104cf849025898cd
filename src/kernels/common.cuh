// Device helpers every kernel file shares: dtype loads and stores, 16-byte
// groups, block and warp sums, the launch constants and the dispatch on
// dtype and vector width. CUDA only (nvcc); included by kernels/<op>.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {
namespace {

constexpr int kRowThreads = 256;
constexpr int kLossThreads = 1024;
constexpr int kElemThreads = 256;

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);  // round to nearest even, as ATen casts
}
// v rounded to T and back: what storing v as T and loading it gives.
template <typename T>
__device__ __forceinline__ float round_as(float v) {
  if constexpr (sizeof(T) == 2) {
    return __bfloat162float(__float2bfloat16_rn(v));
  } else {
    return v;
  }
}

// N consecutive values from p + i as floats: one 16-byte access when N
// values of T fill 16 bytes (the caller guarantees alignment), else scalars.
template <typename T, int N>
__device__ __forceinline__ void load_n(const T* p, int64_t i, float (&out)[N]) {
  if constexpr (N * sizeof(T) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p + i);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = load(e, k);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = load(p, i + k);
  }
}
template <typename T, int N>
__device__ __forceinline__ void store_n(T* p, int64_t i, const float (&v)[N]) {
  if constexpr (N * sizeof(T) == 16) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int k = 0; k < N; ++k) store(e, k, v[k]);
    *reinterpret_cast<uint4*>(p + i) = raw;
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) store(p, i + k, v[k]);
  }
}
// v[k] := p[i + k] + v[k] rounded to T: the sum autograd forms when it adds
// a gradient stored as T into an accumulated one (see Note [AttnRes block
// gradients in place], model/attn_res.h); the caller stores the result as T.
template <typename T, int N>
__device__ __forceinline__ void add_rounded(const T* p, int64_t i, float (&v)[N]) {
  float a[N];
  load_n<T, N>(p, i, a);
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = a[k] + round_as<T>(v[k]);
}

// The L2 norm's per-element terms (kernels/l2_norm.cu, and the short
// convolution fused with it): the running sums of v^2 and g v, and an
// element's input gradient scale (r g - v r^3 dot), each rounding spelled
// out so that every kernel that uses them forms the same bits (no fused
// multiply-add chosen differently per kernel).
__device__ __forceinline__ void l2_sums(float v, float g, float& ss, float& dot) {
  ss = __fmaf_rn(v, v, ss);
  dot = __fmaf_rn(g, v, dot);
}
__device__ __forceinline__ float l2_input_grad(float r, float g, float v, float r3dot,
                                               float scale) {
  return __fmul_rn(scale, __fsub_rn(__fmul_rn(r, g), __fmul_rn(v, r3dot)));
}

// cp.async: 16 bytes from global to shared memory without passing through
// registers; commit closes this thread's group of copies so far, and the
// wait returns once all its committed groups have landed. The wait is a
// compiler memory barrier, so the thread's reads of what it copied stay
// after it (other threads' copies need a barrier besides).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// Sum over the warp by a butterfly: every lane ends with the same bits
// (each step adds the same two values, in either order).
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block, in a fixed order; every thread gets the result.
// `scratch` holds one float per warp. blockDim.x is a multiple of 32.
__device__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

// (max, sum of exp(x - max)) pairs: the online softmax's running state.
struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  if (a.m == -INFINITY) return b;
  if (b.m == -INFINITY) return a;
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}
__device__ MaxSum block_max_sum(MaxSum v, MaxSum* scratch) {
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
    v = combine(v, other);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  MaxSum total{-INFINITY, 0.f};
  for (int w = 0; w < warps; ++w) total = combine(total, scratch[w]);
  return total;
}

// Lets `kernel` launch with `bytes` of dynamic shared memory (past the 48 KB
// a launch gets without asking).
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

int elementwise_blocks(int64_t n) {
  const int64_t want = (n + kElemThreads - 1) / kElemThreads;
  return static_cast<int>(want < 65536 ? (want > 0 ? want : 1) : 65536);
}

}  // namespace

// Runs the statement with T the element type and N the group size: 16
// bytes' worth when `vec` (every pointer 16-byte aligned and every row
// length a multiple of the group), else 1.
#define VIADUCT_DISPATCH_VEC(dt, vec, ...)             \
  if ((dt) == DType::kFloat32) {                       \
    using T = float;                                   \
    if (vec) {                                         \
      constexpr int N = 4;                             \
      __VA_ARGS__;                                     \
    } else {                                           \
      constexpr int N = 1;                             \
      __VA_ARGS__;                                     \
    }                                                  \
  } else {                                             \
    using T = __nv_bfloat16;                           \
    if (vec) {                                         \
      constexpr int N = 8;                             \
      __VA_ARGS__;                                     \
    } else {                                           \
      constexpr int N = 1;                             \
      __VA_ARGS__;                                     \
    }                                                  \
  }
#define VIADUCT_DISPATCH(dt, ...) \
  if ((dt) == DType::kFloat32) {    \
    using T = float;                \
    __VA_ARGS__;                    \
  } else {                          \
    using T = __nv_bfloat16;        \
    __VA_ARGS__;                    \
  }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
inline int64_t group_of(DType dt) { return dt == DType::kFloat32 ? 4 : 8; }

}  // namespace viaduct::cuda
