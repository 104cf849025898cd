// RMSNorm forward (optionally with the residual add before it) and backward.
#include "kernels/common.cuh"
#include "kernels/rms_norm.h"

namespace viaduct::cuda {
namespace {

// Rows are read in groups of N values (16 bytes when the launcher found the
// rows aligned, else N = 1).
// With res (see Note [Residual add inside the norm]): the normalised row is
// h = x + res, rounded to T as ATen's add rounds, and h is written too.
template <typename T, int N>
__global__ void rms_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ res,
                                        const float* __restrict__ w, T* __restrict__ h,
                                        T* __restrict__ y, float* __restrict__ rstd,
                                        int64_t dim, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * dim;
  T* yr = y + row * dim;
  float ss = 0.f;
  for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < dim; j += blockDim.x * N) {
    float v[N];
    load_n<T, N>(xr, j, v);
    if (res != nullptr) {
      float rv[N];
      load_n<T, N>(res + row * dim, j, rv);
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = round_as<T>(v[k] + rv[k]);
      store_n<T, N>(h + row * dim, j, v);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) ss += v[k] * v[k];
  }

  ss = block_sum(ss, scratch);
  const float r = rsqrtf(ss / static_cast<float>(dim) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < dim; j += blockDim.x * N) {
    float v[N], wv[N];
    load_n<T, N>(xr, j, v);
    if (res != nullptr) {  // h again from its inputs (no read back of h)
      float rv[N];
      load_n<T, N>(res + row * dim, j, rv);
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = round_as<T>(v[k] + rv[k]);
    }
    load_n<float, N>(w, j, wv);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = (v[k] * r) * wv[k];
    store_n<T, N>(yr, j, v);
  }
}

// With dres (see Note [Residual add inside the norm]): dx = dres + the norm's
// dx rounded to T, the sum autograd formed for h's two uses, same bits.
// `dr` is dres's group, already loaded.
template <typename T, int N>
__device__ __forceinline__ void add_loaded_residual_grad(const float (&dr)[N], float (&out)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = dr[k] + round_as<T>(out[k]);
}
template <typename T, int N>
__device__ __forceinline__ void add_residual_grad(const T* dres, int64_t row, int64_t dim,
                                                  int64_t j, float (&out)[N]) {
  if (dres == nullptr) return;
  float dr[N];
  load_n<T, N>(dres + row * dim, j, dr);
  add_loaded_residual_grad<T, N>(dr, out);
}

template <typename T, int N>
__global__ void rms_norm_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                         const float* __restrict__ w,
                                         const float* __restrict__ rstd,
                                         const T* __restrict__ dres, T* __restrict__ dx,
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
    for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < dim; j += blockDim.x * N) {
      float g[N], xv[N], wv[N];
      load_n<T, N>(dyr, j, g);
      load_n<T, N>(xr, j, xv);
      load_n<float, N>(w, j, wv);
#pragma unroll
      for (int k = 0; k < N; ++k) s += g[k] * wv[k] * xv[k];
    }
    s = block_sum(s, scratch);
    const float c = r * r * r * s / static_cast<float>(dim);
    for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < dim; j += blockDim.x * N) {
      float g[N], xv[N], wv[N], out[N], pw[N];
      load_n<T, N>(dyr, j, g);
      load_n<T, N>(xr, j, xv);
      load_n<float, N>(w, j, wv);
      if (!first) load_n<float, N>(part, j, pw);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        out[k] = r * g[k] * wv[k] - xv[k] * c;
        const float d = g[k] * xv[k] * r;
        pw[k] = first ? d : pw[k] + d;  // this block alone owns `part`
      }
      add_residual_grad<T, N>(dres, row, dim, j, out);
      store_n<T, N>(dxr, j, out);
      store_n<float, N>(part, j, pw);
    }
    first = false;
  }
  if (first) {  // more parts than rows: this part is empty
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) part[j] = 0.f;
  }
}

// The same arithmetic as rms_norm_backward_kernel, in the same order, for
// rows of at most ITERS * blockDim.x * N elements: a thread keeps its slice of
// dy and x in registers between the two passes over a row and its slice of
// the weight gradient across the block's rows, so each element is read once
// and the block's part is written once (the loop form reads dy and x twice
// and reads and writes its part on every row).
template <typename T, int N, int ITERS>
__global__ void rms_norm_backward_reg_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                             const float* __restrict__ w,
                                             const float* __restrict__ rstd,
                                             const T* __restrict__ dres, T* __restrict__ dx,
                                             float* __restrict__ dw_partial, int64_t rows,
                                             int64_t dim) {
  __shared__ float scratch[32];
  float* part = dw_partial + static_cast<int64_t>(blockIdx.x) * dim;
  float pw[ITERS][N];
  bool first = true;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* dyr = dy + row * dim;
    const T* xr = x + row * dim;
    T* dxr = dx + row * dim;
    const float r = rstd[row];
    float g[ITERS][N], xv[ITERS][N], dr[ITERS][N];
    float s = 0.f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int64_t j = (threadIdx.x + static_cast<int64_t>(it) * blockDim.x) * N;
      if (j < dim) {
        float wv[N];
        load_n<T, N>(dyr, j, g[it]);
        load_n<T, N>(xr, j, xv[it]);
        // dres is loaded with dy and x, so its latency overlaps theirs and
        // the block's sum instead of following them.
        if (dres != nullptr) load_n<T, N>(dres + row * dim, j, dr[it]);
        load_n<float, N>(w, j, wv);
#pragma unroll
        for (int k = 0; k < N; ++k) s += g[it][k] * wv[k] * xv[it][k];
      }
    }
    s = block_sum(s, scratch);
    const float c = r * r * r * s / static_cast<float>(dim);
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int64_t j = (threadIdx.x + static_cast<int64_t>(it) * blockDim.x) * N;
      if (j < dim) {
        float wv[N], out[N];
        load_n<float, N>(w, j, wv);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          out[k] = r * g[it][k] * wv[k] - xv[it][k] * c;
          const float d = g[it][k] * xv[it][k] * r;
          pw[it][k] = first ? d : pw[it][k] + d;
        }
        if (dres != nullptr) add_loaded_residual_grad<T, N>(dr[it], out);
        store_n<T, N>(dxr, j, out);
      }
    }
    first = false;
  }
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int64_t j = (threadIdx.x + static_cast<int64_t>(it) * blockDim.x) * N;
    if (j < dim) {
      if (first) {  // more parts than rows: this part is empty
#pragma unroll
        for (int k = 0; k < N; ++k) pw[it][k] = 0.f;
      }
      store_n<float, N>(part, j, pw[it]);
    }
  }
}

}  // namespace

cudaError_t rms_norm_forward(DType dt, const void* x, const void* res, const float* w,
                             void* h, void* y, float* rstd, int64_t rows, int64_t dim, float eps,
                             cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if ((res == nullptr) != (h == nullptr)) return cudaErrorInvalidValue;
  const bool vec = dim % group_of(dt) == 0 && aligned16(x) && aligned16(y) && aligned16(w) &&
                   aligned16(res) && aligned16(h);
  VIADUCT_DISPATCH_VEC(dt, vec,
                       rms_norm_forward_kernel<T, N><<<static_cast<unsigned>(rows), kRowThreads,
                                                       0, stream>>>(
                           static_cast<const T*>(x), static_cast<const T*>(res), w,
                           static_cast<T*>(h), static_cast<T*>(y), rstd, dim, eps));
  return cudaGetLastError();
}

cudaError_t rms_norm_backward(DType dt, const void* dy, const void* x, const float* w,
                              const float* rstd, const void* dres, void* dx, float* dw_partial,
                              int64_t rows, int64_t dim, cudaStream_t stream) {
  const auto parts = static_cast<unsigned>(norm_backward_parts(rows));
  const bool vec = dim % group_of(dt) == 0 && aligned16(dy) && aligned16(x) && aligned16(w) &&
                   aligned16(dx) && aligned16(dw_partial) && aligned16(dres);
  // Rows of up to 2 slices per thread take the register form (4 slices of 8
  // bf16 need 128 registers a thread: too few blocks per SM); the kernels
  // share one signature.
  VIADUCT_DISPATCH_VEC(
      dt, vec, const int64_t per_pass = static_cast<int64_t>(kRowThreads) * N;
      auto kernel = rms_norm_backward_kernel<T, N>;
      if (dim <= per_pass) {
        kernel = rms_norm_backward_reg_kernel<T, N, 1>;
      } else if (dim <= 2 * per_pass) {
        kernel = rms_norm_backward_reg_kernel<T, N, 2>;
      }
      kernel<<<parts, kRowThreads, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), w, rstd,
          static_cast<const T*>(dres), static_cast<T*>(dx), dw_partial, rows, dim));
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
