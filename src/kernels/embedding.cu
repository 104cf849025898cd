// The embedding table's gradient: each token's output-gradient rows summed
// in row order, without the host round trip of ATen's sort-based form
// (which fetches the number of distinct tokens to size its launches).
//
// One block per sorted position; only the block at the first position of a
// token's run works: it finds the run's end by binary search and sums the
// run's rows, a thread per column (four with float4 loads), adding them in
// increasing row order. Every sum has a fixed order, so the bits do not
// depend on the run, the launch or the layout.
#include "kernels/common.cuh"
#include "kernels/embedding.h"

namespace viaduct::cuda {
namespace {

// The first position in [lo, n) of `sorted` (ascending) holding a token
// greater than tok.
__device__ int64_t run_end(const int64_t* __restrict__ sorted, int64_t lo, int64_t n, int64_t tok) {
  int64_t hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (sorted[mid] <= tok) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

template <bool kVec>
__global__ void __launch_bounds__(kRowThreads)
    embedding_backward_kernel(const int64_t* __restrict__ sorted, const int64_t* __restrict__ order,
                              const float* __restrict__ grad, float* __restrict__ dw, int64_t n,
                              int64_t d, int64_t vocab) {
  const int64_t i = blockIdx.x;
  const int64_t tok = sorted[i];
  if ((i > 0 && sorted[i - 1] == tok) || tok < 0 || tok >= vocab) return;
  __shared__ int64_t end_s;
  if (threadIdx.x == 0) end_s = run_end(sorted, i + 1, n, tok);
  __syncthreads();
  const int64_t end = end_s;
  float* out = dw + tok * d;
  if constexpr (kVec) {
    const int64_t d4 = d / 4;
    for (int64_t c = threadIdx.x; c < d4; c += blockDim.x) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int64_t j = i; j < end; ++j) {
        const float4 g = reinterpret_cast<const float4*>(grad + order[j] * d)[c];
        acc.x += g.x;
        acc.y += g.y;
        acc.z += g.z;
        acc.w += g.w;
      }
      reinterpret_cast<float4*>(out)[c] = acc;
    }
  } else {
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      float acc = 0.f;
      for (int64_t j = i; j < end; ++j) acc += grad[order[j] * d + c];
      out[c] = acc;
    }
  }
}

}  // namespace

cudaError_t embedding_backward(const int64_t* sorted, const int64_t* order, const float* grad,
                               float* dw, int64_t n, int64_t d, int64_t vocab,
                               cudaStream_t stream) {
  if (n == 0 || d == 0) return cudaSuccess;
  const bool vec = d % 4 == 0 && aligned16(grad) && aligned16(dw);
  const auto blocks = static_cast<unsigned>(n);
  if (vec) {
    embedding_backward_kernel<true><<<blocks, kRowThreads, 0, stream>>>(sorted, order, grad, dw, n, d,
                                                                     vocab);
  } else {
    embedding_backward_kernel<false><<<blocks, kRowThreads, 0, stream>>>(sorted, order, grad, dw, n,
                                                                      d, vocab);
  }
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
