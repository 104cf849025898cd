// LayerNorm forward and backward in one pass each over a row (bf16 or fp32
// rows, fp32 statistics, weights and arithmetic). Where it replaces ATen's
// form (the activation cast to fp32, layer_norm, the cast back, and the
// three again in the backward), each direction reads and writes the rows
// once.
#include "kernels/common.cuh"
#include "kernels/layer_norm.h"

namespace viaduct::cuda {
namespace {

// Row `row`'s values j .. j + N - 1 of the normalised input: x, or with a
// residual h = x + res rounded to T as the add rounds it (written to h on
// the first pass, recomputed from x and res on the later ones: the same
// bits, no read back of h).
template <typename T, int N>
__device__ __forceinline__ void input_at(const T* __restrict__ x, const T* __restrict__ res,
                                         int64_t at, int64_t j, float (&v)[N]) {
  load_n<T, N>(x + at, j, v);
  if (res != nullptr) {
    float rv[N];
    load_n<T, N>(res + at, j, rv);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = round_as<T>(v[k] + rv[k]);
  }
}

// A block per row. The mean first, then the variance about it from a
// second read of the row (no cancellation of E[x^2] - mean^2), both block
// sums in a fixed order. With res (see Note [Residual add inside the norm],
// kernels/rms_norm_fn.cpp), the row is h = x + res, written to h.
template <typename T, int N>
__global__ void layer_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ res,
                                          const float* __restrict__ w,
                                          const float* __restrict__ b, T* __restrict__ h,
                                          T* __restrict__ y, float* __restrict__ mean,
                                          float* __restrict__ rstd, int64_t dim, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int64_t at = row * dim;
  T* yr = y + at;
  float s = 0.f;
  for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < dim; j += blockDim.x * N) {
    float v[N];
    input_at<T, N>(x, res, at, j, v);
    if (res != nullptr) store_n<T, N>(h + at, j, v);
#pragma unroll
    for (int k = 0; k < N; ++k) s += v[k];
  }
  const float mu = block_sum(s, scratch) / static_cast<float>(dim);
  float ss = 0.f;
  for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < dim; j += blockDim.x * N) {
    float v[N];
    input_at<T, N>(x, res, at, j, v);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float d = v[k] - mu;
      ss += d * d;
    }
  }
  const float r = rsqrtf(block_sum(ss, scratch) / static_cast<float>(dim) + eps);
  if (threadIdx.x == 0) {
    mean[row] = mu;
    rstd[row] = r;
  }
  for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < dim; j += blockDim.x * N) {
    float v[N], wv[N], bv[N];
    input_at<T, N>(x, res, at, j, v);
    load_n<float, N>(w, j, wv);
    load_n<float, N>(b, j, bv);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = (v[k] - mu) * r * wv[k] + bv[k];
    store_n<T, N>(yr, j, v);
  }
}

// The same arithmetic as layer_norm_forward_kernel, in the same order, for
// rows of at most ITERS * blockDim.x * N elements: a thread keeps its
// slices of the row in registers across the three passes, so x (and res)
// are read once, not three times (and h written once, as there). A block
// of fewer threads than kRowThreads (the row's width rounded up to warps)
// sums the same terms: the warps it leaves out added zeros.
template <typename T, int N, int ITERS>
__global__ void layer_norm_forward_reg_kernel(const T* __restrict__ x, const T* __restrict__ res,
                                              const float* __restrict__ w,
                                              const float* __restrict__ b, T* __restrict__ h,
                                              T* __restrict__ y, float* __restrict__ mean,
                                              float* __restrict__ rstd, int64_t dim, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int64_t at = row * dim;
  float v[ITERS][N];
  float s = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int64_t j = (threadIdx.x + static_cast<int64_t>(it) * blockDim.x) * N;
    if (j < dim) {
      input_at<T, N>(x, res, at, j, v[it]);
      if (res != nullptr) store_n<T, N>(h + at, j, v[it]);
#pragma unroll
      for (int k = 0; k < N; ++k) s += v[it][k];
    }
  }
  const float mu = block_sum(s, scratch) / static_cast<float>(dim);
  float ss = 0.f;
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int64_t j = (threadIdx.x + static_cast<int64_t>(it) * blockDim.x) * N;
    if (j < dim) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float d = v[it][k] - mu;
        ss += d * d;
      }
    }
  }
  const float r = rsqrtf(block_sum(ss, scratch) / static_cast<float>(dim) + eps);
  if (threadIdx.x == 0) {
    mean[row] = mu;
    rstd[row] = r;
  }
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int64_t j = (threadIdx.x + static_cast<int64_t>(it) * blockDim.x) * N;
    if (j < dim) {
      float wv[N], bv[N], out[N];
      load_n<float, N>(w, j, wv);
      load_n<float, N>(b, j, bv);
#pragma unroll
      for (int k = 0; k < N; ++k) out[k] = (v[it][k] - mu) * r * wv[k] + bv[k];
      store_n<T, N>(y + at, j, out);
    }
  }
}

// Rows in a grid stride, each block summing its rows' weight and bias
// gradients into its own part (no atomics; the caller adds the parts).
// With dres: dx = dres + the norm's dx rounded to T, the sum autograd
// formed for h's two uses (same bits).
template <typename T, int N>
__global__ void layer_norm_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                           const float* __restrict__ w,
                                           const float* __restrict__ mean,
                                           const float* __restrict__ rstd,
                                           const T* __restrict__ dres, T* __restrict__ dx,
                                           float* __restrict__ dw_partial,
                                           float* __restrict__ db_partial, int64_t rows,
                                           int64_t dim) {
  __shared__ float scratch[32];
  float* pw = dw_partial + static_cast<int64_t>(blockIdx.x) * dim;
  float* pb = db_partial + static_cast<int64_t>(blockIdx.x) * dim;
  bool first = true;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* dyr = dy + row * dim;
    const T* xr = x + row * dim;
    T* dxr = dx + row * dim;
    const float mu = mean[row], r = rstd[row];
    float sg = 0.f, sgx = 0.f;
    for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < dim; j += blockDim.x * N) {
      float g[N], xv[N], wv[N];
      load_n<T, N>(dyr, j, g);
      load_n<T, N>(xr, j, xv);
      load_n<float, N>(w, j, wv);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float gw = g[k] * wv[k];
        sg += gw;
        sgx += gw * ((xv[k] - mu) * r);
      }
    }
    const float mg = block_sum(sg, scratch) / static_cast<float>(dim);
    const float mgx = block_sum(sgx, scratch) / static_cast<float>(dim);
    for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < dim; j += blockDim.x * N) {
      float g[N], xv[N], wv[N], out[N], aw[N], ab[N];
      load_n<T, N>(dyr, j, g);
      load_n<T, N>(xr, j, xv);
      load_n<float, N>(w, j, wv);
      if (!first) {
        load_n<float, N>(pw, j, aw);
        load_n<float, N>(pb, j, ab);
      }
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float xh = (xv[k] - mu) * r;
        out[k] = r * (g[k] * wv[k] - mg - xh * mgx);
        aw[k] = first ? g[k] * xh : aw[k] + g[k] * xh;  // this block alone owns its parts
        ab[k] = first ? g[k] : ab[k] + g[k];
      }
      if (dres != nullptr) {
        float dr[N];
        load_n<T, N>(dres + row * dim, j, dr);
#pragma unroll
        for (int k = 0; k < N; ++k) out[k] = dr[k] + round_as<T>(out[k]);
      }
      store_n<T, N>(dxr, j, out);
      store_n<float, N>(pw, j, aw);
      store_n<float, N>(pb, j, ab);
    }
    first = false;
  }
  if (first) {  // more parts than rows: this block's parts are empty
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
      pw[j] = 0.f;
      pb[j] = 0.f;
    }
  }
}

// The same arithmetic as layer_norm_backward_kernel, in the same order, for
// rows of at most ITERS * blockDim.x * N elements (see
// rms_norm_backward_reg_kernel, kernels/rms_norm.cu): dy and x stay in
// registers between the two passes over a row, and so do the thread's
// slices of the block's weight and bias gradient parts across its rows,
// written once at the end instead of read and written on every row.
template <typename T, int N, int ITERS>
__global__ void layer_norm_backward_reg_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                               const float* __restrict__ w,
                                               const float* __restrict__ mean,
                                               const float* __restrict__ rstd,
                                               const T* __restrict__ dres, T* __restrict__ dx,
                                               float* __restrict__ dw_partial,
                                               float* __restrict__ db_partial, int64_t rows,
                                               int64_t dim) {
  __shared__ float scratch[32];
  float aw[ITERS][N], ab[ITERS][N];
  bool first = true;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float mu = mean[row], r = rstd[row];
    float g[ITERS][N], xh[ITERS][N];
    float sg = 0.f, sgx = 0.f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int64_t j = (threadIdx.x + static_cast<int64_t>(it) * blockDim.x) * N;
      if (j < dim) {
        float xv[N], wv[N];
        load_n<T, N>(dy + row * dim, j, g[it]);
        load_n<T, N>(x + row * dim, j, xv);
        load_n<float, N>(w, j, wv);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const float gw = g[it][k] * wv[k];
          xh[it][k] = (xv[k] - mu) * r;
          sg += gw;
          sgx += gw * xh[it][k];
        }
      }
    }
    const float mg = block_sum(sg, scratch) / static_cast<float>(dim);
    const float mgx = block_sum(sgx, scratch) / static_cast<float>(dim);
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int64_t j = (threadIdx.x + static_cast<int64_t>(it) * blockDim.x) * N;
      if (j < dim) {
        float wv[N], out[N];
        load_n<float, N>(w, j, wv);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          out[k] = r * (g[it][k] * wv[k] - mg - xh[it][k] * mgx);
          aw[it][k] = first ? g[it][k] * xh[it][k] : aw[it][k] + g[it][k] * xh[it][k];
          ab[it][k] = first ? g[it][k] : ab[it][k] + g[it][k];
        }
        if (dres != nullptr) add_rounded<T, N>(dres + row * dim, j, out);
        store_n<T, N>(dx + row * dim, j, out);
      }
    }
    first = false;
  }
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int64_t j = (threadIdx.x + static_cast<int64_t>(it) * blockDim.x) * N;
    if (j < dim) {
      if (first) {  // more parts than rows: this block's parts are empty
#pragma unroll
        for (int k = 0; k < N; ++k) aw[it][k] = ab[it][k] = 0.f;
      }
      store_n<float, N>(dw_partial + static_cast<int64_t>(blockIdx.x) * dim, j, aw[it]);
      store_n<float, N>(db_partial + static_cast<int64_t>(blockIdx.x) * dim, j, ab[it]);
    }
  }
}

// Threads for a row of `dim` in slices of n: kRowThreads, or for a row one
// pass of them covers, the slices rounded up to whole warps.
unsigned row_threads(int64_t dim, int n) {
  const int64_t slices = (dim + n - 1) / n;
  if (slices >= kRowThreads) return kRowThreads;
  return static_cast<unsigned>((slices + 31) / 32 * 32);
}

}  // namespace

cudaError_t layer_norm_forward(DType dt, const void* x, const void* res, const float* w,
                               const float* b, void* h, void* y, float* mean, float* rstd,
                               int64_t rows, int64_t dim, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (dim <= 0 || (res == nullptr) != (h == nullptr)) return cudaErrorInvalidValue;
  const bool vec = dim % group_of(dt) == 0 && aligned16(x) && aligned16(y) && aligned16(w) &&
                   aligned16(b) && aligned16(res) && aligned16(h);
  // Rows of up to 2 slices a thread take the register form (the kernels
  // share one signature).
  VIADUCT_DISPATCH_VEC(
      dt, vec, const int64_t per_pass = static_cast<int64_t>(kRowThreads) * N;
      auto kernel = layer_norm_forward_kernel<T, N>;
      if (dim <= per_pass) {
        kernel = layer_norm_forward_reg_kernel<T, N, 1>;
      } else if (dim <= 2 * per_pass) {
        kernel = layer_norm_forward_reg_kernel<T, N, 2>;
      }
      kernel<<<static_cast<unsigned>(rows), row_threads(dim, N), 0, stream>>>(
          static_cast<const T*>(x), static_cast<const T*>(res), w, b, static_cast<T*>(h),
          static_cast<T*>(y), mean, rstd, dim, eps));
  return cudaGetLastError();
}

cudaError_t layer_norm_backward(DType dt, const void* dy, const void* x, const float* w,
                                const float* mean, const float* rstd, const void* dres,
                                void* dx, float* dw_partial, float* db_partial, int64_t rows,
                                int64_t dim, cudaStream_t stream) {
  if (dim <= 0) return cudaErrorInvalidValue;
  const auto parts = static_cast<unsigned>(norm_backward_parts(rows));
  const bool vec = dim % group_of(dt) == 0 && aligned16(dy) && aligned16(x) && aligned16(w) &&
                   aligned16(dx) && aligned16(dw_partial) && aligned16(db_partial) &&
                   aligned16(dres);
  // Rows of up to 2 slices a thread take the register form, as RMSNorm's
  // backward (kernels/rms_norm.cu); the kernels share one signature.
  VIADUCT_DISPATCH_VEC(
      dt, vec, const int64_t per_pass = static_cast<int64_t>(kRowThreads) * N;
      auto kernel = layer_norm_backward_kernel<T, N>;
      if (dim <= per_pass) {
        kernel = layer_norm_backward_reg_kernel<T, N, 1>;
      } else if (dim <= 2 * per_pass) {
        kernel = layer_norm_backward_reg_kernel<T, N, 2>;
      }
      kernel<<<parts, row_threads(dim, N), 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), w, mean, rstd,
          static_cast<const T*>(dres), static_cast<T*>(dx), dw_partial, db_partial, rows, dim));
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
