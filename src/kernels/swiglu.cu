// SwiGLU: silu(a) * b and its backward, on contiguous or pitched halves.
#include "kernels/common.cuh"
#include "kernels/swiglu.h"

namespace viaduct::cuda {
namespace {

__device__ __forceinline__ float sigmoid(float a) { return 1.f / (1.f + __expf(-a)); }

// Elementwise over `groups` groups of N values (see load_n).
// Rows of `width` values; a, b (and da, db) have `pitch` values between
// rows (pitch == width: contiguous; 2 width: the halves of one [rows, 2F]
// GEMM output, see Note [One w1/w3 projection]); y and dy are contiguous.
// width is a multiple of N, so a group never crosses a row.
__device__ __forceinline__ int64_t pitched(int64_t e, int64_t width, int64_t pitch) {
  return pitch == width ? e : (e / width) * pitch + e % width;
}

template <typename T, int N>
__global__ void swiglu_forward_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                      T* __restrict__ y, int64_t groups, int64_t width,
                                      int64_t pitch) {
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = pitched(g * N, width, pitch);
    float av[N], bv[N];
    load_n<T, N>(a, i, av);
    load_n<T, N>(b, i, bv);
#pragma unroll
    for (int k = 0; k < N; ++k) av[k] = av[k] * sigmoid(av[k]) * bv[k];
    store_n<T, N>(y, g * N, av);
  }
}

template <typename T, int N>
__global__ void swiglu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ a,
                                       const T* __restrict__ b, T* __restrict__ da,
                                       T* __restrict__ db, int64_t groups, int64_t width,
                                       int64_t pitch) {
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = pitched(g * N, width, pitch);
    float av[N], bv[N], gv[N], oa[N], ob[N];
    load_n<T, N>(a, i, av);
    load_n<T, N>(b, i, bv);
    load_n<T, N>(dy, g * N, gv);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float sg = sigmoid(av[k]);
      oa[k] = gv[k] * bv[k] * sg * (1.f + av[k] * (1.f - sg));
      ob[k] = gv[k] * av[k] * sg;
    }
    store_n<T, N>(da, i, oa);
    store_n<T, N>(db, i, ob);
  }
}

}  // namespace

cudaError_t swiglu_forward(DType dt, const void* a, const void* b, void* y, int64_t n,
                           cudaStream_t stream, int64_t width, int64_t pitch) {
  if (n == 0) return cudaSuccess;
  if (width == 0) width = pitch = n;
  if (width < 1 || pitch < width || n % width != 0) return cudaErrorInvalidValue;
  const bool vec = width % group_of(dt) == 0 && pitch % group_of(dt) == 0 && aligned16(a) &&
                   aligned16(b) && aligned16(y);
  VIADUCT_DISPATCH_VEC(dt, vec,
                       swiglu_forward_kernel<T, N><<<elementwise_blocks(n / N), kElemThreads, 0,
                                                     stream>>>(
                           static_cast<const T*>(a), static_cast<const T*>(b),
                           static_cast<T*>(y), n / N, width, pitch));
  return cudaGetLastError();
}

cudaError_t swiglu_backward(DType dt, const void* dy, const void* a, const void* b, void* da,
                            void* db, int64_t n, cudaStream_t stream, int64_t width,
                            int64_t pitch) {
  if (n == 0) return cudaSuccess;
  if (width == 0) width = pitch = n;
  if (width < 1 || pitch < width || n % width != 0) return cudaErrorInvalidValue;
  const bool vec = width % group_of(dt) == 0 && pitch % group_of(dt) == 0 && aligned16(dy) &&
                   aligned16(a) && aligned16(b) && aligned16(da) && aligned16(db);
  VIADUCT_DISPATCH_VEC(dt, vec,
                       swiglu_backward_kernel<T, N><<<elementwise_blocks(n / N), kElemThreads, 0,
                                                      stream>>>(
                           static_cast<const T*>(dy), static_cast<const T*>(a),
                           static_cast<const T*>(b), static_cast<T*>(da), static_cast<T*>(db),
                           n / N, width, pitch));
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
