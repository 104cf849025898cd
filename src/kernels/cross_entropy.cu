// Per-row cross-entropy that overwrites the logits with their gradient.
#include "kernels/common.cuh"
#include "kernels/cross_entropy.h"

namespace viaduct::cuda {
namespace {

template <typename T, int N>
__global__ void cross_entropy_kernel(T* __restrict__ logits, const int64_t* __restrict__ targets,
                                     float* __restrict__ row_loss, int64_t vocab,
                                     int64_t ignore_index) {
  __shared__ MaxSum scratch[32];
  const int64_t row = blockIdx.x;
  T* z = logits + row * vocab;
  const int64_t t = targets[row];
  if (t == ignore_index) {
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) store(z, j, 0.f);
    if (threadIdx.x == 0) row_loss[row] = 0.f;
    return;
  }
  MaxSum ms{-INFINITY, 0.f};
  for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < vocab; j += blockDim.x * N) {
    float v[N];
    load_n<T, N>(z, j, v);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (v[k] > ms.m) {  // one exp per logit: rescale the sum only on a new max
        ms.s = ms.s * __expf(ms.m - v[k]) + 1.f;
        ms.m = v[k];
      } else {
        ms.s += __expf(v[k] - ms.m);
      }
    }
  }
  ms = block_max_sum(ms, scratch);
  const float lse = ms.m + logf(ms.s);
  const bool valid = t >= 0 && t < vocab;
  if (threadIdx.x == 0) row_loss[row] = valid ? lse - load(z, t) : NAN;
  __syncthreads();  // z[t] is read above before it is overwritten below
  for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < vocab; j += blockDim.x * N) {
    float v[N];
    load_n<T, N>(z, j, v);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = __expf(v[k] - lse) - (j + k == t ? 1.f : 0.f);
    store_n<T, N>(z, j, v);
  }
}

}  // namespace

cudaError_t cross_entropy_forward_backward(DType dt, void* logits, const int64_t* targets,
                                           float* row_loss, int64_t rows, int64_t vocab,
                                           int64_t ignore_index, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const bool vec = vocab % group_of(dt) == 0 && aligned16(logits);
  VIADUCT_DISPATCH_VEC(dt, vec,
                       cross_entropy_kernel<T, N><<<static_cast<unsigned>(rows), kLossThreads, 0,
                                                    stream>>>(
                           static_cast<T*>(logits), targets, row_loss, vocab, ignore_index));
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
