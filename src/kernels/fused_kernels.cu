// CUDA kernels behind kernels/launchers.h. Compiled for sm_90a in the CUDA
// build only. Plain CUDA C++: one thread block per row for the row-wise
// kernels (norm, loss), grid-stride loops for the elementwise ones.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <mutex>
#include <vector>

#include "kernels/launchers.h"

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

// Sum over the block, in a fixed order; every thread gets the result.
// `scratch` holds one float per warp. blockDim.x is a multiple of 32.
__device__ float block_sum(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
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

template <typename T>
__global__ void rms_norm_forward_kernel(const T* __restrict__ x, const float* __restrict__ w,
                                        T* __restrict__ y, float* __restrict__ rstd,
                                        int64_t dim, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * dim;
  T* yr = y + row * dim;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
    const float v = load(xr, j);
    ss += v * v;
  }
  ss = block_sum(ss, scratch);
  const float r = rsqrtf(ss / static_cast<float>(dim) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
    store(yr, j, (load(xr, j) * r) * w[j]);
  }
}

template <typename T>
__global__ void rms_norm_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                         const float* __restrict__ w,
                                         const float* __restrict__ rstd, T* __restrict__ dx,
                                         float* __restrict__ dw_partial, int64_t rows,
                                         int64_t dim) {
  __shared__ float scratch[32];
  float* part = dw_partial + static_cast<int64_t>(blockIdx.x) * dim;
  bool first = true;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* dyr = dy + row * dim;
    const T* xr = x + row * dim;
    T* dxr = dx + row * dim;
    const float r = rstd[row];
    float s = 0.f;
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      s += load(dyr, j) * w[j] * load(xr, j);
    }
    s = block_sum(s, scratch);
    const float c = r * r * r * s / static_cast<float>(dim);
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      const float g = load(dyr, j), xv = load(xr, j);
      store(dxr, j, r * g * w[j] - xv * c);
      const float dw = g * xv * r;
      part[j] = first ? dw : part[j] + dw;  // this block alone owns `part`
    }
    first = false;
  }
  if (first) {  // more parts than rows: this part is empty
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) part[j] = 0.f;
  }
}

template <typename T>
__global__ void rope_kernel(const T* __restrict__ x, const float* __restrict__ cos_t,
                            const float* __restrict__ sin_t, T* __restrict__ y,
                            int64_t pairs, int64_t T_len, int64_t H, int64_t half,
                            float sign) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < pairs;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = p % half;
    const int64_t t = (p / half / H) % T_len;
    const float c = cos_t[t * half + i], s = sign * sin_t[t * half + i];
    const float x0 = load(x, 2 * p), x1 = load(x, 2 * p + 1);
    store(y, 2 * p, x0 * c - x1 * s);
    store(y, 2 * p + 1, x0 * s + x1 * c);
  }
}

__device__ __forceinline__ float sigmoid(float a) { return 1.f / (1.f + expf(-a)); }

template <typename T>
__global__ void swiglu_forward_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                      T* __restrict__ y, int64_t n) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float av = load(a, k);
    store(y, k, av * sigmoid(av) * load(b, k));
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ a,
                                       const T* __restrict__ b, T* __restrict__ da,
                                       T* __restrict__ db, int64_t n) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float av = load(a, k), bv = load(b, k), g = load(dy, k);
    const float sg = sigmoid(av);
    store(da, k, g * bv * sg * (1.f + av * (1.f - sg)));
    store(db, k, g * av * sg);
  }
}

template <typename T>
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
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float v = load(z, j);
    if (v > ms.m) {  // one exp per logit: rescale the sum only on a new max
      ms.s = ms.s * expf(ms.m - v) + 1.f;
      ms.m = v;
    } else {
      ms.s += expf(v - ms.m);
    }
  }
  ms = block_max_sum(ms, scratch);
  const float lse = ms.m + logf(ms.s);
  const bool valid = t >= 0 && t < vocab;
  if (threadIdx.x == 0) row_loss[row] = valid ? lse - load(z, t) : NAN;
  __syncthreads();  // z[t] is read above before it is overwritten below
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    store(z, j, expf(load(z, j) - lse) - (j == t ? 1.f : 0.f));
  }
}

int elementwise_blocks(int64_t n) {
  const int64_t want = (n + kElemThreads - 1) / kElemThreads;
  return static_cast<int>(want < 65536 ? (want > 0 ? want : 1) : 65536);
}

}  // namespace

bool device_supported(int device) {
  static std::mutex mu;
  static std::vector<int> cached;  // -1 unknown, 0 no, 1 yes
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0) return false;
  if (static_cast<size_t>(device) >= cached.size()) cached.resize(device + 1, -1);
  if (cached[device] < 0) {
    int major = 0, minor = 0;
    const bool ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess;
    cached[device] = ok && major == 9 && minor == 0 ? 1 : 0;
  }
  return cached[device] == 1;
}

#define VIADUCT_DISPATCH(dt, ...)                     \
  if ((dt) == DType::kFloat32) {                      \
    using T = float;                                  \
    __VA_ARGS__;                                      \
  } else {                                            \
    using T = __nv_bfloat16;                          \
    __VA_ARGS__;                                      \
  }

cudaError_t rms_norm_forward(DType dt, const void* x, const float* w, void* y, float* rstd,
                             int64_t rows, int64_t dim, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  VIADUCT_DISPATCH(dt, rms_norm_forward_kernel<T><<<static_cast<unsigned>(rows), kRowThreads, 0,
                                                    stream>>>(
                           static_cast<const T*>(x), w, static_cast<T*>(y), rstd, dim, eps));
  return cudaGetLastError();
}

int64_t rms_norm_backward_parts(int64_t rows) { return rows < 528 ? (rows > 0 ? rows : 1) : 528; }

cudaError_t rms_norm_backward(DType dt, const void* dy, const void* x, const float* w,
                              const float* rstd, void* dx, float* dw_partial, int64_t rows,
                              int64_t dim, cudaStream_t stream) {
  const auto parts = static_cast<unsigned>(rms_norm_backward_parts(rows));
  VIADUCT_DISPATCH(dt, rms_norm_backward_kernel<T><<<parts, kRowThreads, 0, stream>>>(
                           static_cast<const T*>(dy), static_cast<const T*>(x), w, rstd,
                           static_cast<T*>(dx), dw_partial, rows, dim));
  return cudaGetLastError();
}

cudaError_t rope(DType dt, const void* x, const float* cos, const float* sin, void* y, int64_t B,
                 int64_t T_len, int64_t H, int64_t hd, bool inverse, cudaStream_t stream) {
  const int64_t pairs = B * T_len * H * (hd / 2);
  if (pairs == 0) return cudaSuccess;
  const float sign = inverse ? -1.f : 1.f;
  VIADUCT_DISPATCH(dt, rope_kernel<T><<<elementwise_blocks(pairs), kElemThreads, 0, stream>>>(
                           static_cast<const T*>(x), cos, sin, static_cast<T*>(y), pairs, T_len,
                           H, hd / 2, sign));
  return cudaGetLastError();
}

cudaError_t swiglu_forward(DType dt, const void* a, const void* b, void* y, int64_t n,
                           cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  VIADUCT_DISPATCH(dt, swiglu_forward_kernel<T><<<elementwise_blocks(n), kElemThreads, 0,
                                                  stream>>>(
                           static_cast<const T*>(a), static_cast<const T*>(b),
                           static_cast<T*>(y), n));
  return cudaGetLastError();
}

cudaError_t swiglu_backward(DType dt, const void* dy, const void* a, const void* b, void* da,
                            void* db, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  VIADUCT_DISPATCH(dt, swiglu_backward_kernel<T><<<elementwise_blocks(n), kElemThreads, 0,
                                                   stream>>>(
                           static_cast<const T*>(dy), static_cast<const T*>(a),
                           static_cast<const T*>(b), static_cast<T*>(da), static_cast<T*>(db),
                           n));
  return cudaGetLastError();
}

cudaError_t cross_entropy_forward_backward(DType dt, void* logits, const int64_t* targets,
                                           float* row_loss, int64_t rows, int64_t vocab,
                                           int64_t ignore_index, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  VIADUCT_DISPATCH(dt, cross_entropy_kernel<T><<<static_cast<unsigned>(rows), kLossThreads, 0,
                                                 stream>>>(
                           static_cast<T*>(logits), targets, row_loss, vocab, ignore_index));
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
