// Row L2 normalisation (KDA's q and k): a warp per row, the row's sums by a
// fixed butterfly, fp32 throughout.
#include "kernels/common.cuh"
#include "kernels/l2_norm.h"

namespace viaduct::cuda {
namespace {

constexpr int kRowsPerBlock = kRowThreads / 32;

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    forward_kernel(const T* __restrict__ x, float* __restrict__ y, int64_t rows, int64_t d,
                   float eps, float scale) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kRowsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const T* xr = x + row * d;
  float ss = 0.f, unused = 0.f;
  for (int64_t c = lane; c < d; c += 32) l2_sums(load(xr, c), 0.f, ss, unused);
  const float r = rsqrtf(warp_sum(ss) + eps);
  float* yr = y + row * d;
  for (int64_t c = lane; c < d; c += 32) yr[c] = __fmul_rn(__fmul_rn(load(xr, c), r), scale);
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    backward_kernel(const T* __restrict__ x, const float* __restrict__ dy, T* __restrict__ dx,
                    int64_t rows, int64_t d, float eps, float scale) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kRowsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const T* xr = x + row * d;
  const float* gr = dy + row * d;
  float ss = 0.f, dot = 0.f;
  for (int64_t c = lane; c < d; c += 32) l2_sums(load(xr, c), gr[c], ss, dot);
  const float r = rsqrtf(warp_sum(ss) + eps);
  dot = warp_sum(dot);
  const float r3dot = __fmul_rn(__fmul_rn(__fmul_rn(r, r), r), dot);
  T* out = dx + row * d;
  for (int64_t c = lane; c < d; c += 32) {
    store(out, c, l2_input_grad(r, gr[c], load(xr, c), r3dot, scale));
  }
}

unsigned blocks_for(int64_t rows) {
  return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
}

}  // namespace

cudaError_t l2_norm_forward(DType dt, const void* x, float* y, int64_t rows, int64_t d,
                            float eps, float scale, cudaStream_t stream) {
  if (rows == 0 || d == 0) return cudaSuccess;
  VIADUCT_DISPATCH(dt, forward_kernel<T><<<blocks_for(rows), kRowThreads, 0, stream>>>(
                           static_cast<const T*>(x), y, rows, d, eps, scale));
  return cudaGetLastError();
}

cudaError_t l2_norm_backward(DType dt, const void* x, const float* dy, void* dx, int64_t rows,
                             int64_t d, float eps, float scale, cudaStream_t stream) {
  if (rows == 0 || d == 0) return cudaSuccess;
  VIADUCT_DISPATCH(dt, backward_kernel<T><<<blocks_for(rows), kRowThreads, 0, stream>>>(
                           static_cast<const T*>(x), dy, static_cast<T*>(dx), rows, d, eps,
                           scale));
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
