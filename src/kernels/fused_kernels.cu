// CUDA kernels behind kernels/launchers.h. Compiled for sm_90a in the CUDA
// build only. Plain CUDA C++: one thread block per row for the row-wise
// kernels (norm, loss), grid-stride loops for the elementwise ones.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
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
// a gradient stored as T into an accumulated one (Note [AttnRes block
// gradients in place], model/attn_res.h); the caller stores the result as T.
template <typename T, int N>
__device__ __forceinline__ void add_rounded(const T* p, int64_t i, float (&v)[N]) {
  float a[N];
  load_n<T, N>(p, i, a);
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = a[k] + round_as<T>(v[k]);
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

// Rows are read in groups of N values (16 bytes when the launcher found the
// rows aligned, else N = 1).
// With res (Note [Residual add inside the norm]): the normalised row is
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

// With dres (Note [Residual add inside the norm]): dx = dres + the norm's
// dx rounded to T, the sum autograd formed for h's two uses, same bits.
template <typename T, int N>
__device__ __forceinline__ void add_residual_grad(const T* dres, int64_t row, int64_t dim,
                                                  int64_t j, float (&out)[N]) {
  if (dres == nullptr) return;
  float dr[N];
  load_n<T, N>(dres + row * dim, j, dr);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = dr[k] + round_as<T>(out[k]);
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
    float g[ITERS][N], xv[ITERS][N];
    float s = 0.f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int64_t j = (threadIdx.x + static_cast<int64_t>(it) * blockDim.x) * N;
      if (j < dim) {
        float wv[N];
        load_n<T, N>(dyr, j, g[it]);
        load_n<T, N>(xr, j, xv[it]);
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
        add_residual_grad<T, N>(dres, row, dim, j, out);
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

// x is read through strides (sB, sT, sH; the last dim is contiguous) so the
// backward can rotate SDPA's transposed gradient without a copy; y is
// contiguous [B, T, H, hd]. Each thread rotates N / 2 pairs. Output head h
// reads the sum of input heads (h / div) * mul + r for r < cnt (in that
// order, in fp32): (1, 1, 1) is a plain rotation; (rep, 1, 1) writes each
// input head rep times (grouped KV heads repeated for attention); (1, rep,
// rep) sums rep heads (the repeat's backward).
// cos_t == nullptr: no rotation (the heads copied or summed as above; v's
// grouped heads repeated for attention, Note [Repeated heads without a
// gather]).
template <typename T, int N>
__global__ void rope_kernel(const T* __restrict__ x, const float* __restrict__ cos_t,
                            const float* __restrict__ sin_t, T* __restrict__ y, int64_t groups,
                            int64_t T_len, int64_t H, int64_t half, int64_t sB, int64_t sT,
                            int64_t sH, float sign, int64_t div, int64_t mul, int64_t cnt) {
  const int64_t per_head = 2 * half / N;  // groups in one head vector
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t d = (g % per_head) * N;  // first element in the head vector
    int64_t rest = g / per_head;
    const int64_t h = rest % H;
    rest /= H;
    const int64_t t = rest % T_len;
    const int64_t b = rest / T_len;
    const int64_t src = (h / div) * mul;
    float v[N], o[N];
    load_n<T, N>(x, b * sB + t * sT + src * sH + d, v);
    for (int64_t r = 1; r < cnt; ++r) {
      float u[N];
      load_n<T, N>(x, b * sB + t * sT + (src + r) * sH + d, u);
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] += u[k];
    }
    if (cos_t == nullptr) {  // no rotation: the heads copied or summed
#pragma unroll
      for (int k = 0; k < N; ++k) o[k] = v[k];
    } else {
#pragma unroll
      for (int k = 0; k < N; k += 2) {
        const int64_t i = t * half + (d + k) / 2;
        const float c = cos_t[i], sn = sign * sin_t[i];
        o[k] = v[k] * c - v[k + 1] * sn;
        o[k + 1] = v[k] * sn + v[k + 1] * c;
      }
    }
    store_n<T, N>(y, g * N, o);
  }
}

// A read's per-source row statistics over N columns, in column order:
// ss += x^2 (for rstd), dt += x . u (the logit's dot). Every read kernel's.
template <int N>
__device__ __forceinline__ void add_read_stats(const float (&x)[N], const float (&uu)[N],
                                               float& ss, float& dt) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    ss += x[k] * x[k];
    dt += x[k] * uu[k];
  }
}

// Note [Fused AttnRes read]: one block per row (token) at a time. Pass 1
// computes each source's (sum of squares, dot with u) with per-warp partials
// in shared memory (one barrier for all sources), the softmax over the n
// sources runs on one thread, pass 2 re-reads the sources (L2-resident) for
// the weighted sum. Every sum has a fixed order: threads' columns, then the
// warp's shuffle tree, then the warps in order; sources in order.
template <typename T, int N>
__global__ void attn_res_read_forward_kernel(ReadSources src, int n, const float* __restrict__ u,
                                             T* __restrict__ out, float* __restrict__ rstd,
                                             float* __restrict__ dot, float* __restrict__ alpha,
                                             int64_t rows, int64_t dim, float eps) {
  extern __shared__ float sm[];  // [warps][n][2] partials, then [n] alpha
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  float* part = sm;
  float* a_sh = sm + warps * n * 2;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    for (int i = 0; i < n; ++i) {
      const T* v = static_cast<const T*>(src.p[i]) + row * dim;
      float ss = 0.f, dt = 0.f;
      for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < dim; j += blockDim.x * N) {
        float x[N], uu[N];
        load_n<T, N>(v, j, x);
        load_n<float, N>(u, j, uu);
        add_read_stats(x, uu, ss, dt);
      }
      for (int o = 16; o > 0; o >>= 1) {
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
        dt += __shfl_xor_sync(0xffffffffu, dt, o);
      }
      if (lane == 0) {
        part[(warp * n + i) * 2] = ss;
        part[(warp * n + i) * 2 + 1] = dt;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float m = -INFINITY;
      for (int i = 0; i < n; ++i) {
        float ss = 0.f, dt = 0.f;
        for (int w = 0; w < warps; ++w) {
          ss += part[(w * n + i) * 2];
          dt += part[(w * n + i) * 2 + 1];
        }
        const float r = rsqrtf(ss / static_cast<float>(dim) + eps);
        rstd[i * rows + row] = r;
        dot[i * rows + row] = dt;
        a_sh[i] = r * dt;  // the logit, for now
        m = fmaxf(m, r * dt);
      }
      float z = 0.f;
      for (int i = 0; i < n; ++i) {
        a_sh[i] = expf(a_sh[i] - m);
        z += a_sh[i];
      }
      for (int i = 0; i < n; ++i) {
        a_sh[i] /= z;
        alpha[i * rows + row] = a_sh[i];
      }
    }
    __syncthreads();
    T* o = out + row * dim;
    for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < dim; j += blockDim.x * N) {
      float acc[N];
      for (int i = 0; i < n; ++i) {
        float x[N];
        load_n<T, N>(static_cast<const T*>(src.p[i]) + row * dim, j, x);
        const float a = a_sh[i];
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] = i == 0 ? a * x[k] : acc[k] + a * x[k];
      }
      store_n<T, N>(o, j, acc);
    }
    __syncthreads();  // a_sh and part are rewritten by the next row
  }
}

template <typename T, int N>
__global__ void attn_res_read_backward_kernel(ReadSources src, ReadGrads dsrc, int n,
                                              const T* __restrict__ g,
                                              const float* __restrict__ u,
                                              const float* __restrict__ rstd,
                                              const float* __restrict__ dot,
                                              const float* __restrict__ alpha,
                                              float* __restrict__ du_partial, int64_t rows,
                                              int64_t dim) {
  extern __shared__ float sm[];  // [warps][n] partials, then [n] x 3 coefficients
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  float* part = sm;
  float* al = sm + warps * n;  // alpha_i
  float* dd = al + n;          // dlogit_i rstd_i
  float* dr = dd + n;          // dlogit_i dot_i rstd_i^3 / dim
  float* du = du_partial + static_cast<int64_t>(blockIdx.x) * dim;
  bool first = true;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* gr = g + row * dim;
    for (int i = 0; i < n; ++i) {
      const T* v = static_cast<const T*>(src.p[i]) + row * dim;
      float s = 0.f;
      for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < dim; j += blockDim.x * N) {
        float x[N], gg[N];
        load_n<T, N>(v, j, x);
        load_n<T, N>(gr, j, gg);
#pragma unroll
        for (int k = 0; k < N; ++k) s += gg[k] * x[k];
      }
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) part[warp * n + i] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float mean = 0.f;  // sum_j alpha_j dalpha_j
      for (int i = 0; i < n; ++i) {
        float da = 0.f;
        for (int w = 0; w < warps; ++w) da += part[w * n + i];
        al[i] = alpha[i * rows + row];
        dd[i] = da;  // dalpha_i, for now
        mean += al[i] * da;
      }
      for (int i = 0; i < n; ++i) {
        const float r = rstd[i * rows + row];
        const float dl = al[i] * (dd[i] - mean);
        dd[i] = dl * r;
        dr[i] = dl * dot[i * rows + row] * r * r * r / static_cast<float>(dim);
      }
    }
    __syncthreads();
    for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < dim; j += blockDim.x * N) {
      float gg[N], uu[N], acc[N];
      load_n<T, N>(gr, j, gg);
      load_n<float, N>(u, j, uu);
      if (!first) load_n<float, N>(du, j, acc);
      for (int i = 0; i < n; ++i) {
        float x[N], dv[N];
        load_n<T, N>(static_cast<const T*>(src.p[i]) + row * dim, j, x);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          dv[k] = al[i] * gg[k] + dd[i] * uu[k] - dr[i] * x[k];
          const float c = dd[i] * x[k];
          acc[k] = (first && i == 0) ? c : acc[k] + c;
        }
        store_n<T, N>(static_cast<T*>(dsrc.p[i]) + row * dim, j, dv);
      }
      store_n<float, N>(du, j, acc);  // this block alone owns its part
    }
    first = false;
    __syncthreads();  // the coefficients are rewritten by the next row
  }
  if (first) {  // more parts than rows: this part is empty
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) du[j] = 0.f;
  }
}

// Note [Fused AttnRes read, warp per row]: the read's second form (on by
// default; VIADUCT_DISABLE_KERNELS=attn_res_read_v2 goes back to the
// block-per-row kernels above). The block-per-row form is latency-bound:
// each row waits on two block barriers and a softmax that one thread runs
// while the other 255 idle, so few loads are in flight (on an H200 at 8192
// rows x 2048 bf16: 97 us forward and 157 us backward a read, against ~32
// and ~56 us of memory traffic at 4 TB/s). Here a warp owns a row, blocks
// of kReadWarps independent warps, and no block barrier sits on a row's
// path. A sum over the row is the lane's columns in order, then a shuffle
// butterfly (warp_sum), which leaves the same bits in every lane, so every
// lane runs the n-source softmax itself; per-source scalars of the row are
// spread over the lanes (LaneSlots). Rows of up to kReadWords 16-byte words
// a lane (dim <= 2048 in bf16, 1024 in fp32; rows read in words, see
// VIADUCT_DISPATCH_VEC) stay in registers:
//  - forward: each source is read once. An online softmax (running max m,
//    rescaled sum z) accumulates sum_i exp(logit_i - m) v_i in registers;
//    out = that / z, alpha_i = exp(logit_i - m) / z. Traffic: n + 1 rows,
//    the roofline's.
//  - backward: g stays in registers; pass 1 reads the sources for g . v_i,
//    each lane computes the coefficients of the sources in its slots, and
//    pass 2 re-reads the sources (mostly from L2) for dv_i. du accumulates
//    per warp over its rows in shared memory (in registers it would cost
//    a block per SM); the block adds its warps' sums in warp order and
//    writes one du_partial row (kReadRowsPerPart rows a part).
// Longer rows take the loop forms: the forward's second pass re-reads the
// sources for the alpha-weighted sum; the backward finds each warp's row's
// coefficients, then the whole block walks its kReadWarps rows by column
// groups, adding du into its du_partial row (one barrier pair per
// kReadWarps rows). Every sum has a fixed order (lane columns, butterfly,
// sources, each warp's rows, warps), so runs are bitwise reproducible; the
// statistics are the same bits in both forms, the outputs agree with the
// block-per-row kernels to rounding, not bitwise. Expected, not yet
// measured: 16 warps an SM forward and 12 backward with a source's 4 KiB
// slice of a row in flight per warp, enough to stream near the roofline:
// about 40 us forward and 70-80 us backward at the shape above, 2x or more
// over the block-per-row form.
constexpr int kReadWarps = 4;         // rows in flight per block
constexpr int kReadWords = 8;         // register forms: 16-byte words of a row per lane
// Backward: rows per block, so per du_partial row. Fewer rows a block
// shorten the tail of the last wave of blocks; more shrink du_partial.
constexpr int kReadRowsPerPart = 8;
// Register caps of the register forms (4 and 3 blocks of kReadWarps warps
// an SM, no spills at sm_90a): the forward holds sum_i e_i v_i
// (kReadWords * 16 / sizeof(T) floats a lane) and a source's slice, the
// backward g's and a source's slices (du is in shared memory).
constexpr int kReadForwardBlocksPerSM = 4;
constexpr int kReadBackwardBlocksPerSM = 3;
// The form that adds into slots (Note [AttnRes block gradients in place])
// holds a slot's slice too.
constexpr int kReadBackwardAccBlocksPerSM = 2;
// Note [AttnRes read with its norm]: every AttnRes read in kimi_k3 feeds
// an RMSNorm (attention_norm, ffn_norm, the final norm) and nothing else,
// so the register forms can take that norm in too (ReadNorm). Forward: h is
// rounded to T in registers as it would be stored, and y = (h r) w is
// written instead of h (rms_norm_forward_kernel's arithmetic; r's sum runs
// in the read's lane order, so y may differ from the two kernels' by an
// ulp). Backward: h is formed again from the sources with the saved
// statistics, the same online-softmax steps and roundings (OnlineStep), the
// norm's backward gives g rounded to T in registers, and the read's two
// passes follow as before; the norm weight's gradient is summed like du.
// Saved: the norm's rstd per row instead of h. Traffic per read: the two
// ops move h out and back in forward (2 rows) and h, dh out, dh in
// backward (3 rows) that this form does not, at one more pass over the
// sources in backward (from L2 where it stays). Predicted at the k3gemm
// shape: ~50 us a read, ~3 ms a step, and h's 32 MiB a read not kept.
// Measured on an H200 (bench/NOTES.md, session 7): 2.07 GiB less, the step
// +0.6% (g in shared memory; +1.5% with g in registers, which spilled).
// Now h's sums wait in shared memory too and dy is loaded where used: 158
// registers (197 with slots), no spills; the step level with the two ops or
// 0.3% faster (session 8), so on by default (model.attn_res_fused_norm).
// As a kernel it still takes as long as the two ops (latency-bound: three
// dependent passes over the sources a row at 8 warps an SM).
static_assert(kMaxReadSources <= 64, "LaneSlots hold two sources a lane");

// Sum over the warp by a butterfly: every lane ends with the same bits
// (each step adds the same two values, in either order).
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One float per source of a row, spread over a warp: source i's in lane
// i % 32, slot i / 32. get() is a shuffle, so every lane must call it.
struct LaneSlots {
  float s0 = 0.f, s1 = 0.f;
  __device__ __forceinline__ void set(int i, int lane, float v) {
    if (lane == (i & 31)) {
      if (i < 32) {
        s0 = v;
      } else {
        s1 = v;
      }
    }
  }
  __device__ __forceinline__ float get(int i) const {
    return __shfl_sync(0xffffffffu, i < 32 ? s0 : s1, i & 31);
  }
};

// N values of T as loaded, unconverted (a bf16 row slice kept between
// passes takes half the registers of its floats).
template <typename T, int N, bool kWord = N * sizeof(T) == 16>
struct Packed {
  T v[N];
};
template <typename T, int N>
struct Packed<T, N, true> {
  uint4 w;
};
template <typename T, int N>
__device__ __forceinline__ Packed<T, N> load_packed(const T* p, int64_t i) {
  Packed<T, N> r;
  if constexpr (N * sizeof(T) == 16) {
    r.w = *reinterpret_cast<const uint4*>(p + i);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) r.v[k] = p[i + k];
  }
  return r;
}
template <typename T, int N>
__device__ __forceinline__ void unpack(const Packed<T, N>& r, float (&out)[N]) {
  if constexpr (N * sizeof(T) == 16) {
    const T* e = reinterpret_cast<const T*>(&r.w);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = load(e, k);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = load(r.v, k);
  }
}
// A lane's ITERS words of a row, from p (the row's base plus the lane's
// offset); words at or past the row's end (rem: the lane's columns left)
// are not loaded. All loads are issued before any is used.
template <typename T, int N, int ITERS>
__device__ __forceinline__ void load_slices(const T* p, int rem, Packed<T, N> (&out)[ITERS]) {
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    if (it * 32 * N < rem) out[it] = load_packed<T, N>(p, it * 32 * N);
  }
}
// Makes a held word opaque to the compiler: without it, the floats of a
// slice unpacked twice (or in a loop) are kept live from the first unpack,
// twice the registers of the packed bf16.
template <typename T, int N>
__device__ __forceinline__ void keep_packed(Packed<T, N>& r) {
  static_assert(N * sizeof(T) == 16, "register forms hold 16-byte words");
  asm volatile("" : "+r"(r.w.x), "+r"(r.w.y), "+r"(r.w.z), "+r"(r.w.w));
}
// N floats from p + i, 16 bytes at a time when N is a multiple of 4 (the
// caller guarantees alignment), else one at a time.
template <int N>
__device__ __forceinline__ void load_f32(const float* p, int64_t i, float (&out)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int q = 0; q < N / 4; ++q) {
      const float4 w = *reinterpret_cast<const float4*>(p + i + 4 * q);
      out[4 * q] = w.x;
      out[4 * q + 1] = w.y;
      out[4 * q + 2] = w.z;
      out[4 * q + 3] = w.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = p[i + k];
  }
}

// The warp's row's logit for source i from the lanes' partial sums; writes
// its rstd and dot.
__device__ __forceinline__ float read_logit(float ss, float dt, int i, int lane, int64_t row,
                                           int64_t rows, int64_t dim, float eps,
                                           float* __restrict__ rstd, float* __restrict__ dot) {
  ss = warp_sum(ss);
  dt = warp_sum(dt);
  const float r = rsqrtf(ss / static_cast<float>(dim) + eps);
  if (lane == 0) {
    rstd[i * rows + row] = r;
    dot[i * rows + row] = dt;
  }
  return r * dt;
}

// One step of the online softmax's weighted sum, with its roundings spelt
// out (no contraction left to the compiler): the read-with-norm backward
// forms the forward's h again from the same statistics, bit for bit.
struct OnlineStep {
  float scale, e;
};
__device__ __forceinline__ OnlineStep online_step(float& m, float& z, float l) {
  const float m_new = fmaxf(m, l);
  const OnlineStep st{expf(m - m_new), expf(l - m_new)};  // scale = 0 for the first
  z = __fmaf_rn(z, st.scale, st.e);
  m = m_new;
  return st;
}
__device__ __forceinline__ float online_acc(float acc, const OnlineStep& st, float x) {
  return __fmaf_rn(st.e, x, __fmul_rn(acc, st.scale));
}

// N values rounded to T, packed as the loads pack them.
template <typename T, int N>
__device__ __forceinline__ Packed<T, N> pack_n(const float (&v)[N]) {
  static_assert(N * sizeof(T) == 16, "register forms hold 16-byte words");
  Packed<T, N> r;
  T* e = reinterpret_cast<T*>(&r.w);
#pragma unroll
  for (int k = 0; k < N; ++k) store(e, k, v[k]);
  return r;
}

// Register form: dim <= 32 * N * ITERS. Lane columns: lane * N + it * 32 * N
// + k (constant offsets from a per-row base; `rem` bounds a partial row).
// kNorm (Note [AttnRes read with its norm]): out is norm(h), not h.
template <typename T, int N, int ITERS, bool kNorm>
__global__ void __launch_bounds__(kReadWarps * 32, kReadForwardBlocksPerSM)
    attn_res_read_forward_warp_kernel(ReadSources src, int n, const float* __restrict__ u,
                                      T* __restrict__ out, float* __restrict__ rstd,
                                      float* __restrict__ dot, float* __restrict__ alpha,
                                      int64_t rows, int64_t dim, float eps, ReadNorm nrm) {
  constexpr int kStride = 32 * N;
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kReadWarps + (threadIdx.x >> 5);
  if (row >= rows) return;  // the whole warp; nothing below waits on the block
  const int64_t base = row * dim + lane * N;
  const int rem = static_cast<int>(dim) - lane * N;  // this lane's columns: it * kStride < rem
  const float* ul = u + lane * N;
  float acc[ITERS][N];  // sum_i exp(logit_i - m) v_i
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
#pragma unroll
    for (int k = 0; k < N; ++k) acc[it][k] = 0.f;
  }
  float m = -INFINITY, z = 0.f;
  LaneSlots logit;
  for (int i = 0; i < n; ++i) {
    const T* v = static_cast<const T*>(src.p[i]) + base;
    Packed<T, N> x[ITERS];
    // Every load of the slice in flight at once.
    load_slices<T, N, ITERS>(v, rem, x);
    float ss = 0.f, dt = 0.f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      if (it * kStride < rem) {
        float xf[N], uu[N];
        unpack(x[it], xf);
        load_f32<N>(ul, it * kStride, uu);
        add_read_stats(xf, uu, ss, dt);
      }
    }
    const float l = read_logit(ss, dt, i, lane, row, rows, dim, eps, rstd, dot);
    logit.set(i, lane, l);
    const OnlineStep st = online_step(m, z, l);
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      if (it * kStride < rem) {
        float xf[N];
        keep_packed(x[it]);
        unpack(x[it], xf);
#pragma unroll
        for (int k = 0; k < N; ++k) acc[it][k] = online_acc(acc[it][k], st, xf[k]);
      }
    }
  }
  if (lane < n) alpha[lane * rows + row] = expf(logit.s0 - m) / z;
  if (lane + 32 < n) alpha[(lane + 32) * rows + row] = expf(logit.s1 - m) / z;
  const float inv_z = 1.f / z;
  T* o = out + base;
  float ss = 0.f;  // kNorm: the norm's sum of squares of h as stored
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    if (it * kStride < rem) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        acc[it][k] = __fmul_rn(acc[it][k], inv_z);
        if constexpr (kNorm) {
          acc[it][k] = round_as<T>(acc[it][k]);
          ss += acc[it][k] * acc[it][k];
        }
      }
      if constexpr (!kNorm) store_n<T, N>(o, it * kStride, acc[it]);
    }
  }
  if constexpr (kNorm) {  // y = (h r) w, as rms_norm_forward_kernel forms it
    const float r = rsqrtf(warp_sum(ss) / static_cast<float>(dim) + nrm.eps);
    if (lane == 0) nrm.rstd[row] = r;
    const float* wl = nrm.w + lane * N;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      if (it * kStride < rem) {
        float wv[N];
        load_f32<N>(wl, it * kStride, wv);
#pragma unroll
        for (int k = 0; k < N; ++k) acc[it][k] = (acc[it][k] * r) * wv[k];
        store_n<T, N>(o, it * kStride, acc[it]);
      }
    }
  }
}

// Loop form, any dim: the same statistics (same order), then a second pass
// over the sources for sum_i alpha_i v_i.
template <typename T, int N>
__global__ void __launch_bounds__(kReadWarps * 32)
    attn_res_read_forward_warp_loop_kernel(ReadSources src, int n, const float* __restrict__ u,
                                           T* __restrict__ out, float* __restrict__ rstd,
                                           float* __restrict__ dot, float* __restrict__ alpha,
                                           int64_t rows, int64_t dim, float eps) {
  __shared__ float a_sh[kReadWarps][kMaxReadSources];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kReadWarps + warp;
  if (row >= rows) return;
  float m = -INFINITY, z = 0.f;
  LaneSlots logit;
  for (int i = 0; i < n; ++i) {
    const T* v = static_cast<const T*>(src.p[i]) + row * dim;
    float ss = 0.f, dt = 0.f;
    for (int64_t j = lane * static_cast<int64_t>(N); j < dim; j += 32 * N) {
      float x[N], uu[N];
      load_n<T, N>(v, j, x);
      load_f32<N>(u, j, uu);
      add_read_stats(x, uu, ss, dt);
    }
    const float l = read_logit(ss, dt, i, lane, row, rows, dim, eps, rstd, dot);
    logit.set(i, lane, l);
    online_step(m, z, l);  // the register form's statistics, bit for bit
  }
  if (lane < n) {
    a_sh[warp][lane] = expf(logit.s0 - m) / z;
    alpha[lane * rows + row] = a_sh[warp][lane];
  }
  if (lane + 32 < n) {
    a_sh[warp][lane + 32] = expf(logit.s1 - m) / z;
    alpha[(lane + 32) * rows + row] = a_sh[warp][lane + 32];
  }
  __syncwarp();
  T* o = out + row * dim;
  for (int64_t j = lane * static_cast<int64_t>(N); j < dim; j += 32 * N) {
    float acc[N];
    for (int i = 0; i < n; ++i) {
      float x[N];
      load_n<T, N>(static_cast<const T*>(src.p[i]) + row * dim, j, x);
      const float a = a_sh[warp][i];
#pragma unroll
      for (int k = 0; k < N; ++k) acc[k] = i == 0 ? a * x[k] : acc[k] + a * x[k];
    }
    store_n<T, N>(o, j, acc);
  }
}

// The backward's per-source coefficients of the warp's row (Note [Fused
// AttnRes read]'s formulas), for the sources in this lane's slots: pass 1
// (g . v_i for every source, in order) given the row's statistics.
struct ReadCoefficients {
  LaneSlots al, dd, dr;  // alpha_i; dlogit_i rstd_i; dlogit_i dot_i rstd_i^3 / dim
};
__device__ __forceinline__ ReadCoefficients read_coefficients(const LaneSlots& da, float mean,
                                                              const LaneSlots& al,
                                                              const LaneSlots& rs,
                                                              const LaneSlots& dt, int64_t dim) {
  ReadCoefficients c;
  c.al = al;
  const float dl0 = al.s0 * (da.s0 - mean), dl1 = al.s1 * (da.s1 - mean);
  c.dd.s0 = dl0 * rs.s0;
  c.dd.s1 = dl1 * rs.s1;
  c.dr.s0 = dl0 * dt.s0 * rs.s0 * rs.s0 * rs.s0 / static_cast<float>(dim);
  c.dr.s1 = dl1 * dt.s1 * rs.s1 * rs.s1 * rs.s1 / static_cast<float>(dim);
  return c;
}
// The row's forward statistics, source i in lane slot i.
__device__ __forceinline__ void load_read_stats(const float* __restrict__ stat, int n, int lane,
                                                int64_t row, int64_t rows, LaneSlots& out) {
  if (lane < n) out.s0 = stat[lane * rows + row];
  if (lane + 32 < n) out.s1 = stat[(lane + 32) * rows + row];
}

// A register-form backward block's part of a per-column sum: row
// blockIdx.x of `partial` = the warps' rows of `sh` added in warp order.
template <int N, int ITERS>
__device__ __forceinline__ void write_block_part(const float4 (*sh)[ITERS * (N / 4)][32],
                                                 float* __restrict__ partial, int64_t dim) {
  constexpr int kQuads = N / 4, kStride = 32 * N;
  float* part = partial + static_cast<int64_t>(blockIdx.x) * dim;
  for (int t = threadIdx.x; t < ITERS * kQuads * 32; t += blockDim.x) {
    const int l = t & 31, q = t >> 5;  // q = it * kQuads + quad
    const int col = l * N + (q / kQuads) * kStride + (q % kQuads) * 4;
    if (col < dim) {
      float4 sum = sh[0][q][l];
#pragma unroll
      for (int w = 1; w < kReadWarps; ++w) {
        const float4 d = sh[w][q][l];
        sum.x += d.x;
        sum.y += d.y;
        sum.z += d.z;
        sum.w += d.w;
      }
      *reinterpret_cast<float4*>(part + col) = sum;
    }
  }
}

// Register form: dim <= 32 * N * ITERS, columns as in the forward's. Warp w
// of block b takes rows b * kReadWarps + w + k * gridDim.x * kReadWarps.
//
// kNorm (Note [AttnRes read with its norm]): g is not loaded but formed from
// nrm.dy through the norm's backward, with h formed again from the sources
// as the forward formed it; the norm weight's gradient accumulates per warp
// in dynamic shared memory beside du's and leaves as nrm.dw_partial rows.
template <typename T, int N, int ITERS, bool kAcc, bool kNorm>
__global__ void __launch_bounds__(kReadWarps * 32, kAcc || kNorm ? kReadBackwardAccBlocksPerSM
                                                                  : kReadBackwardBlocksPerSM)
    attn_res_read_backward_warp_kernel(ReadSources src, ReadSources acc, ReadGrads dsrc, int n,
                                       const T* __restrict__ g, const float* __restrict__ u,
                                       const float* __restrict__ rstd,
                                       const float* __restrict__ dot,
                                       const float* __restrict__ alpha,
                                       float* __restrict__ du_partial, int64_t rows,
                                       int64_t dim, ReadNorm nrm) {
  constexpr int kStride = 32 * N, kQuads = N / 4;
  static_assert(N % 4 == 0, "du is held in float4s");
  // Each warp's du over its rows, in shared memory (registers hold g and a
  // source's slice): [warp][it * kQuads + q][lane] holds columns lane * N +
  // it * kStride + 4 q + (0..3), so a warp's accesses are contiguous.
  __shared__ float4 du_sh[kReadWarps][ITERS * kQuads][32];
  // kNorm: the norm weight's gradient, laid out as du_sh (the launch sizes it).
  extern __shared__ float4 dw_dyn[];
  float4(*dw_sh)[ITERS * kQuads][32] = reinterpret_cast<float4(*)[ITERS * kQuads][32]>(dw_dyn);
  // kNorm: h's fp32 sums after dw_sh, laid out alike; once slice `it`'s h
  // has been read for g, the slice's first float4 holds g's 16 bytes
  // (formed here, not loaded; in registers both would spill). A lane
  // touches only its own.
  float4(*h_sh)[ITERS * kQuads][32] = dw_sh + kReadWarps;
  // Stored and loaded as float4 (the sums' type), so the compiler keeps
  // each slice's h reads before its g write.
  auto store_g = [&](int it, const uint4& w) {
    h_sh[threadIdx.x >> 5][it * kQuads][threadIdx.x & 31] =
        make_float4(__uint_as_float(w.x), __uint_as_float(w.y), __uint_as_float(w.z),
                    __uint_as_float(w.w));
  };
  auto load_g = [&](int it) {
    const float4 f = h_sh[threadIdx.x >> 5][it * kQuads][threadIdx.x & 31];
    return make_uint4(__float_as_uint(f.x), __float_as_uint(f.y), __float_as_uint(f.z),
                      __float_as_uint(f.w));
  };
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rem = static_cast<int>(dim) - lane * N;  // this lane's columns: it * kStride < rem
  const float* ul = u + lane * N;
#pragma unroll
  for (int q = 0; q < ITERS * kQuads; ++q) {
    du_sh[warp][q][lane] = make_float4(0.f, 0.f, 0.f, 0.f);
    if constexpr (kNorm) dw_sh[warp][q][lane] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const int64_t step = static_cast<int64_t>(gridDim.x) * kReadWarps;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kReadWarps + warp; row < rows;
       row += step) {
    const int64_t base = row * dim + lane * N;
    Packed<T, N> gp[ITERS];
    // g's slice `it` as floats: from shared memory (kNorm) or registers.
    auto g_slice = [&](int it, float (&gf)[N]) {
      if constexpr (kNorm) {
        Packed<T, N> gw;
        gw.w = load_g(it);
        unpack(gw, gf);
      } else {
        keep_packed(gp[it]);
        unpack(gp[it], gf);
      }
    };
    LaneSlots al, rs, dt, da;
    load_read_stats(alpha, n, lane, row, rows, al);
    load_read_stats(rstd, n, lane, row, rows, rs);
    load_read_stats(dot, n, lane, row, rows, dt);
    if constexpr (kNorm) {
      // h as the forward stored it: the same online softmax over the same
      // logits (rstd_i dot_i, as read_logit formed them), same roundings;
      // the sums wait in shared memory (in registers they spill).
      float m = -INFINITY, z = 0.f;
#pragma unroll 1
      for (int i = 0; i < n; ++i) {
        const T* v = static_cast<const T*>(src.p[i]) + base;
        Packed<T, N> x[ITERS];
        load_slices<T, N, ITERS>(v, rem, x);
        const OnlineStep st = online_step(m, z, rs.get(i) * dt.get(i));
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
          if (it * kStride < rem) {
            float xf[N];
            unpack(x[it], xf);
#pragma unroll
            for (int q = 0; q < kQuads; ++q) {
              float4& hq = h_sh[warp][it * kQuads + q][lane];
              const float4 a = i == 0 ? make_float4(0.f, 0.f, 0.f, 0.f) : hq;
              hq = make_float4(online_acc(a.x, st, xf[4 * q]), online_acc(a.y, st, xf[4 * q + 1]),
                               online_acc(a.z, st, xf[4 * q + 2]),
                               online_acc(a.w, st, xf[4 * q + 3]));
            }
          }
        }
      }
      // h as stored (rounded to T), slice `it`, from the sums in shared
      // memory; dy's slices are loaded where used (the second time from
      // L1): held in registers, the two cost ~70 and spill.
      const float inv_z = 1.f / z;
      auto h_slice = [&](int it, float (&hf)[N]) {
#pragma unroll
        for (int q = 0; q < kQuads; ++q) {
          const float4 a = h_sh[warp][it * kQuads + q][lane];
          hf[4 * q] = round_as<T>(__fmul_rn(a.x, inv_z));
          hf[4 * q + 1] = round_as<T>(__fmul_rn(a.y, inv_z));
          hf[4 * q + 2] = round_as<T>(__fmul_rn(a.z, inv_z));
          hf[4 * q + 3] = round_as<T>(__fmul_rn(a.w, inv_z));
        }
      };
      // The norm's backward (rms_norm_backward_kernel's arithmetic): g =
      // r dy w - h r^3 (sum dy w h) / dim, rounded to T as that kernel
      // stores it; dw += dy h r.
      const T* dyr = static_cast<const T*>(nrm.dy) + base;
      const float* wl = nrm.w + lane * N;
      float s = 0.f;
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        if (it * kStride < rem) {
          float gf[N], hf[N], wv[N];
          load_n<T, N>(dyr, it * kStride, gf);
          h_slice(it, hf);
          load_f32<N>(wl, it * kStride, wv);
#pragma unroll
          for (int k = 0; k < N; ++k) s += gf[k] * wv[k] * hf[k];
        }
      }
      s = warp_sum(s);
      const float r = nrm.rstd[row];
      const float c = r * r * r * s / static_cast<float>(dim);
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        if (it * kStride < rem) {
          float gf[N], hf[N], wv[N], o[N];
          load_n<T, N>(dyr, it * kStride, gf);
          h_slice(it, hf);  // before g's word overwrites the slice's first sums
          load_f32<N>(wl, it * kStride, wv);
#pragma unroll
          for (int k = 0; k < N; ++k) o[k] = r * gf[k] * wv[k] - hf[k] * c;
          store_g(it, pack_n<T, N>(o).w);
#pragma unroll
          for (int q = 0; q < kQuads; ++q) {
            float4& d = dw_sh[warp][it * kQuads + q][lane];
            d.x += gf[4 * q] * hf[4 * q] * r;
            d.y += gf[4 * q + 1] * hf[4 * q + 1] * r;
            d.z += gf[4 * q + 2] * hf[4 * q + 2] * r;
            d.w += gf[4 * q + 3] * hf[4 * q + 3] * r;
          }
        }
      }
    } else {
      load_slices<T, N, ITERS>(g + base, rem, gp);
    }
    float mean = 0.f;  // sum_j alpha_j g . v_j
    for (int i = 0; i < n; ++i) {
      const T* v = static_cast<const T*>(src.p[i]) + base;
      Packed<T, N> x[ITERS];
      load_slices<T, N, ITERS>(v, rem, x);
      float s = 0.f;
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        if (it * kStride < rem) {
          float xf[N], gf[N];
          unpack(x[it], xf);
          g_slice(it, gf);
#pragma unroll
          for (int k = 0; k < N; ++k) s += gf[k] * xf[k];
        }
      }
      s = warp_sum(s);
      da.set(i, lane, s);
      mean += al.get(i) * s;
    }
    const ReadCoefficients c = read_coefficients(da, mean, al, rs, dt, dim);
    for (int i = 0; i < n; ++i) {
      const T* v = static_cast<const T*>(src.p[i]) + base;
      T* dv = static_cast<T*>(dsrc.p[i]) + base;
      const T* ap = acc.p[i] == nullptr ? nullptr : static_cast<const T*>(acc.p[i]) + base;
      const float a = c.al.get(i), cd = c.dd.get(i), cr = c.dr.get(i);
      Packed<T, N> x[ITERS];
      // The slot's words (kAcc): loaded with the source's, not one at a time
      // between stores (which the compiler must keep in order: dv may be the
      // slot itself).
      Packed<T, N> sw[kAcc ? ITERS : 1];
      // all loads before the first store (dv may alias)
      load_slices<T, N, ITERS>(v, rem, x);
      if constexpr (kAcc) {
        if (ap != nullptr) {
          load_slices<T, N, ITERS>(ap, rem, sw);
        }
      }
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        if (it * kStride < rem) {
          float xf[N], gf[N], uu[N], o[N];
          unpack(x[it], xf);
          g_slice(it, gf);
          load_f32<N>(ul, it * kStride, uu);
#pragma unroll
          for (int k = 0; k < N; ++k) o[k] = a * gf[k] + cd * uu[k] - cr * xf[k];
          if constexpr (kAcc) {
            if (ap != nullptr) {
              float sf[N];
              keep_packed(sw[it]);
              unpack(sw[it], sf);
#pragma unroll
              for (int k = 0; k < N; ++k) o[k] = sf[k] + round_as<T>(o[k]);
            }
          }
          store_n<T, N>(dv, it * kStride, o);
#pragma unroll
          for (int q = 0; q < kQuads; ++q) {
            float4& d = du_sh[warp][it * kQuads + q][lane];
            d.x += cd * xf[4 * q];
            d.y += cd * xf[4 * q + 1];
            d.z += cd * xf[4 * q + 2];
            d.w += cd * xf[4 * q + 3];
          }
        }
      }
    }
  }
  // The block's part: ((warp 0 + warp 1) + warp 2) + ... per column (every
  // warp comes here: no early exit above).
  __syncthreads();
  write_block_part<N, ITERS>(du_sh, du_partial, dim);
  if constexpr (kNorm) write_block_part<N, ITERS>(dw_sh, nrm.dw_partial, dim);
}

// Note [Read with its norm in two passes]
// The read-with-norm backward above makes three dependent passes over a
// row's sources: h again, the dots g . v_i, then the gradients. It takes as
// long as the two ops it replaces, although it moves fewer bytes (session
// 8: 0.452 against 0.426 ms, fwd+bwd of one read with 4 sources). Each pass
// waits on one source's loads at a time, and h's sums and du go through
// shared memory for every source. With the source count a template
// parameter (at most kReadNormPassMaxSources; more take the form above), a
// lane can hold a 16-byte word of every source at once. Then:
//  - pass 1 loads one slice of every source, with dy and the norm weight
//    w, and sums a_i = (dy w) . v_i and the Gram sums G_ij = v_i . v_j
//    (j <= i). There are no stores, so the compiler may run slices' loads
//    ahead.
//  - the row's scalars follow in registers. With h = sum_j alpha_j v_j,
//    s = (dy w) . h = sum_i alpha_i a_i, c = r^3 s / dim and
//    g = r dy w - c h (the norm's backward), g . v_i = r a_i - c sum_j
//    alpha_j G_ij. The read's coefficients come from those as before.
//  - pass 2 loads the slice of every source again (from L2), forms h and
//    g in registers, and writes every dv_i. It adds sum_i dd_i v_i into
//    du and dy h r into the norm weight's gradient once a slice, not once
//    a source. Slice it + 1's source words are loaded before slice it's
//    stores, which the compiler must otherwise keep in order, since dv_i
//    may be a slot.
// h and g are fp32 here, never rounded to T; the form above rounds both as
// the two ops store them. The results agree with the ops to rounding, not
// bit for bit, and runs stay bitwise reproducible (fixed orders
// throughout). VIADUCT_DISABLE_KERNELS=attn_res_read_norm_2pass goes back
// to the form above. Measured on an H200 (session 9, layer_bench, fwd+bwd
// of one read and its norm at 8192 x 2048): 0.187 / 0.254 / 0.273 ms with
// 1 / 2 / 3 blocks, against 0.236 / 0.342 / 0.354 ms in three passes; the
// K3 step's read backward kernels 8.6 ms against 13.6 ms, and its AttnRes
// overhead +2.0-2.3% against +4.3%.
constexpr int kReadNormPassMaxSources = 5;
// 3 blocks of kReadWarps an SM (du's and w's sums: 64 KiB of shared memory
// a block in bf16), so at most 168 registers.
constexpr int kReadNormPassBlocksPerSM = 3;

template <typename T, int N>
__device__ __forceinline__ Packed<T, N> load_packed_nc(const T* p, int64_t i) {
  static_assert(N * sizeof(T) == 16, "register forms hold 16-byte words");
  Packed<T, N> r;
  r.w = __ldg(reinterpret_cast<const uint4*>(p + i));
  return r;
}

template <typename T, int N, int ITERS, int NS, bool kAcc>
__global__ void __launch_bounds__(kReadWarps * 32, kReadNormPassBlocksPerSM)
    attn_res_read_norm_backward_2pass_kernel(ReadSources src, ReadSources acc, ReadGrads dsrc,
                                             const float* __restrict__ u,
                                             const float* __restrict__ rstd,
                                             const float* __restrict__ dot,
                                             const float* __restrict__ alpha,
                                             float* __restrict__ du_partial, int64_t rows,
                                             int64_t dim, ReadNorm nrm) {
  constexpr int kStride = 32 * N, kQuads = N / 4, kPairs = NS * (NS + 1) / 2;
  static_assert(N % 4 == 0 && N * sizeof(T) == 16, "the register form's words");
  // Per warp, over its rows, laid out as the three-pass form's.
  __shared__ float4 du_sh[kReadWarps][ITERS * kQuads][32];
  extern __shared__ float4 dw_dyn[];
  float4(*dw_sh)[ITERS * kQuads][32] = reinterpret_cast<float4(*)[ITERS * kQuads][32]>(dw_dyn);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rem = static_cast<int>(dim) - lane * N;  // this lane's columns: it * kStride < rem
  const float* ul = u + lane * N;
  const float* wl = nrm.w + lane * N;
  const float inv_dim = 1.f / static_cast<float>(dim);
#pragma unroll
  for (int q = 0; q < ITERS * kQuads; ++q) {
    du_sh[warp][q][lane] = make_float4(0.f, 0.f, 0.f, 0.f);
    dw_sh[warp][q][lane] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const int64_t step = static_cast<int64_t>(gridDim.x) * kReadWarps;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kReadWarps + warp; row < rows;
       row += step) {
    const int64_t base = row * dim + lane * N;
    const T* dyr = static_cast<const T*>(nrm.dy) + base;
    auto source = [&](int i) { return static_cast<const T*>(src.p[i]) + base; };
    // Pass 1: a_i and G_ij (pair p = i (i + 1) / 2 + j), lane sums.
    float a[NS], G[kPairs];
#pragma unroll
    for (int i = 0; i < NS; ++i) a[i] = 0.f;
#pragma unroll
    for (int p = 0; p < kPairs; ++p) G[p] = 0.f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      if (it * kStride < rem) {
        Packed<T, N> xw[NS];
#pragma unroll
        for (int i = 0; i < NS; ++i) xw[i] = load_packed_nc<T, N>(source(i), it * kStride);
        float yw[N], wv[N];
        unpack(load_packed_nc<T, N>(dyr, it * kStride), yw);
        load_f32<N>(wl, it * kStride, wv);
#pragma unroll
        for (int k = 0; k < N; ++k) yw[k] *= wv[k];
        float xf[NS][N];
#pragma unroll
        for (int i = 0; i < NS; ++i) unpack(xw[i], xf[i]);
#pragma unroll
        for (int i = 0; i < NS; ++i) {
#pragma unroll
          for (int k = 0; k < N; ++k) a[i] += yw[k] * xf[i][k];
#pragma unroll
          for (int j = 0; j <= i; ++j) {
#pragma unroll
            for (int k = 0; k < N; ++k) G[i * (i + 1) / 2 + j] += xf[i][k] * xf[j][k];
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < NS; ++i) a[i] = warp_sum(a[i]);
#pragma unroll
    for (int p = 0; p < kPairs; ++p) G[p] = warp_sum(G[p]);
    // The row's scalars (every lane the same bits).
    float al[NS], dd[NS], dr[NS];
#pragma unroll
    for (int i = 0; i < NS; ++i) al[i] = alpha[i * rows + row];
    const float r = nrm.rstd[row];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < NS; ++i) s += al[i] * a[i];
    const float c = r * r * r * s * inv_dim;
    float gv[NS], mean = 0.f;  // g . v_i; sum_i alpha_i g . v_i
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      float hv = 0.f;  // h . v_i
#pragma unroll
      for (int j = 0; j < NS; ++j) hv += al[j] * G[i >= j ? i * (i + 1) / 2 + j : j * (j + 1) / 2 + i];
      gv[i] = r * a[i] - c * hv;
      mean += al[i] * gv[i];
    }
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      const float rs = rstd[i * rows + row];
      const float dl = al[i] * (gv[i] - mean);
      dd[i] = dl * rs;
      dr[i] = dl * dot[i * rows + row] * rs * rs * rs * inv_dim;
    }
    // Pass 2, slice it + 1's source words loaded before slice it's stores.
    Packed<T, N> cur[NS];
    if (0 < rem) {
#pragma unroll
      for (int i = 0; i < NS; ++i) cur[i] = load_packed_nc<T, N>(source(i), 0);
    }
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      Packed<T, N> next[NS];
      if (it + 1 < ITERS && (it + 1) * kStride < rem) {
#pragma unroll
        for (int i = 0; i < NS; ++i) next[i] = load_packed_nc<T, N>(source(i), (it + 1) * kStride);
      }
      if (it * kStride < rem) {
        const int64_t col = it * kStride;
        // The slots' words of this slice: after slice it - 1's stores (a
        // slot may be the very dv written there), before this slice's.
        Packed<T, N> sw[kAcc ? NS : 1];
        if constexpr (kAcc) {
#pragma unroll
          for (int i = 0; i < NS; ++i) {
            if (acc.p[i] != nullptr) sw[i] = load_packed<T, N>(static_cast<const T*>(acc.p[i]) + base, col);
          }
        }
        float yf[N], wv[N], uu[N], h[N], g[N];
        unpack(load_packed_nc<T, N>(dyr, col), yf);
        load_f32<N>(wl, col, wv);
        load_f32<N>(ul, col, uu);
        float xf[NS][N];
#pragma unroll
        for (int i = 0; i < NS; ++i) unpack(cur[i], xf[i]);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          float hk = 0.f;
#pragma unroll
          for (int i = 0; i < NS; ++i) hk += al[i] * xf[i][k];
          h[k] = hk;
          g[k] = r * yf[k] * wv[k] - c * hk;
        }
#pragma unroll
        for (int i = 0; i < NS; ++i) {
          float o[N];
#pragma unroll
          for (int k = 0; k < N; ++k) o[k] = al[i] * g[k] + dd[i] * uu[k] - dr[i] * xf[i][k];
          if constexpr (kAcc) {
            if (acc.p[i] != nullptr) {
              float sf[N];
              unpack(sw[i], sf);
#pragma unroll
              for (int k = 0; k < N; ++k) o[k] = sf[k] + round_as<T>(o[k]);
            }
          }
          store_n<T, N>(static_cast<T*>(dsrc.p[i]) + base, col, o);
        }
#pragma unroll
        for (int q = 0; q < kQuads; ++q) {
          float4 d = du_sh[warp][it * kQuads + q][lane];
#pragma unroll
          for (int i = 0; i < NS; ++i) {
            d.x += dd[i] * xf[i][4 * q];
            d.y += dd[i] * xf[i][4 * q + 1];
            d.z += dd[i] * xf[i][4 * q + 2];
            d.w += dd[i] * xf[i][4 * q + 3];
          }
          du_sh[warp][it * kQuads + q][lane] = d;
          float4& e = dw_sh[warp][it * kQuads + q][lane];
          e.x += yf[4 * q] * h[4 * q] * r;
          e.y += yf[4 * q + 1] * h[4 * q + 1] * r;
          e.z += yf[4 * q + 2] * h[4 * q + 2] * r;
          e.w += yf[4 * q + 3] * h[4 * q + 3] * r;
        }
      }
#pragma unroll
      for (int i = 0; i < NS; ++i) cur[i] = next[i];
    }
  }
  __syncthreads();
  write_block_part<N, ITERS>(du_sh, du_partial, dim);
  write_block_part<N, ITERS>(dw_sh, nrm.dw_partial, dim);
}

// Loop form, any dim: each warp finds its row's coefficients (pass 1 as in
// the register form), then the block walks its kReadWarps rows by column
// groups (thread t: columns t * N + q * blockDim.x * N), adding du into its
// du_partial row, which only that thread touches.
template <typename T, int N>
__global__ void __launch_bounds__(kReadWarps * 32)
    attn_res_read_backward_warp_loop_kernel(ReadSources src, ReadSources acc, ReadGrads dsrc,
                                            int n,
                                            const T* __restrict__ g,
                                            const float* __restrict__ u,
                                            const float* __restrict__ rstd,
                                            const float* __restrict__ dot,
                                            const float* __restrict__ alpha,
                                            float* __restrict__ du_partial, int64_t rows,
                                            int64_t dim) {
  __shared__ float coef[kReadWarps][3][kMaxReadSources];  // each warp's row: al, dd, dr
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* part = du_partial + static_cast<int64_t>(blockIdx.x) * dim;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kReadWarps;
  bool first = true;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kReadWarps; base < rows; base += step) {
    const int64_t row = base + warp;
    if (row < rows) {
      const T* gr = g + row * dim;
      LaneSlots al, rs, dt, da;
      load_read_stats(alpha, n, lane, row, rows, al);
      load_read_stats(rstd, n, lane, row, rows, rs);
      load_read_stats(dot, n, lane, row, rows, dt);
      float mean = 0.f;
      for (int i = 0; i < n; ++i) {
        const T* v = static_cast<const T*>(src.p[i]) + row * dim;
        float s = 0.f;
        for (int64_t j = lane * static_cast<int64_t>(N); j < dim; j += 32 * N) {
          float x[N], gg[N];
          load_n<T, N>(v, j, x);
          load_n<T, N>(gr, j, gg);
#pragma unroll
          for (int k = 0; k < N; ++k) s += gg[k] * x[k];
        }
        s = warp_sum(s);
        da.set(i, lane, s);
        mean += al.get(i) * s;
      }
      const ReadCoefficients c = read_coefficients(da, mean, al, rs, dt, dim);
      if (lane < n) {
        coef[warp][0][lane] = c.al.s0;
        coef[warp][1][lane] = c.dd.s0;
        coef[warp][2][lane] = c.dr.s0;
      }
      if (lane + 32 < n) {
        coef[warp][0][lane + 32] = c.al.s1;
        coef[warp][1][lane + 32] = c.dd.s1;
        coef[warp][2][lane + 32] = c.dr.s1;
      }
    }
    __syncthreads();
    for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < dim; j += blockDim.x * N) {
      float uu[N], du[N];
      load_f32<N>(u, j, uu);
      if (first) {
#pragma unroll
        for (int k = 0; k < N; ++k) du[k] = 0.f;
      } else {
        load_f32<N>(part, j, du);
      }
      for (int w = 0; w < kReadWarps && base + w < rows; ++w) {
        const int64_t r = base + w;
        float gg[N];
        load_n<T, N>(g + r * dim, j, gg);
        for (int i = 0; i < n; ++i) {
          float x[N], o[N];
          load_n<T, N>(static_cast<const T*>(src.p[i]) + r * dim, j, x);
          const float a = coef[w][0][i], cd = coef[w][1][i], cr = coef[w][2][i];
#pragma unroll
          for (int k = 0; k < N; ++k) {
            o[k] = a * gg[k] + cd * uu[k] - cr * x[k];
            du[k] += cd * x[k];
          }
          if (acc.p[i] != nullptr) add_rounded<T, N>(static_cast<const T*>(acc.p[i]) + r * dim, j, o);
          store_n<T, N>(static_cast<T*>(dsrc.p[i]) + r * dim, j, o);
        }
      }
      store_n<float, N>(part, j, du);
    }
    first = false;
    __syncthreads();  // coef is rewritten by the next rows
  }
  if (first) {  // no rows for this block: its part is empty
    for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) part[j] = 0.f;
  }
}

__device__ __forceinline__ float sigmoid(float a) { return 1.f / (1.f + __expf(-a)); }

// Elementwise over `groups` groups of N values (see load_n).
// Rows of `width` values; a, b (and da, db) have `pitch` values between
// rows (pitch == width: contiguous; 2 width: the halves of one [rows, 2F]
// GEMM output, Note [One w1/w3 projection]); y and dy are contiguous.
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

// Note [Clip coefficient on the device]
// The clip coefficient needs the global gradient norm. Read on the host, it
// held the device idle between the backward and the optimizer: the host
// waited for the norm, then launched every AdamW update while the device
// ran them faster than they came (0.5 ms of the llama-1B step, 1.2 ms of
// the K3 step; bench/NOTES.md). Where one process holds the whole model,
// one thread on the device forms the norm and the coefficient instead, and
// the AdamW kernels read the coefficient from there. The host reads the
// norm (for the log and the finiteness check) after it has queued the
// updates. The arithmetic is the host's, in the host's order: squares of
// the fp32 norms and their sum in double, sqrt, max_norm / (norm + 1e-6)
// capped at 1, rounded to fp32, with no contraction. So the update has
// the same bits. A norm that is not finite makes the coefficient NaN, and
// the AdamW kernels then update nothing; the host raises the error it
// raised before.
__global__ void clip_scale_kernel(const float* __restrict__ norms, int64_t k, double max_norm,
                                  double* __restrict__ norm_out, float* __restrict__ scale_out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double s = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    const double v = norms[i];
    s = __dadd_rn(s, __dmul_rn(v, v));
  }
  const double norm = sqrt(s);
  double coef = 1.0;
  if (max_norm > 0) {
    coef = __ddiv_rn(max_norm, __dadd_rn(norm, 1e-6));
    if (!(coef < 1.0)) coef = 1.0;
  }
  norm_out[0] = norm;
  scale_out[0] = isfinite(norm) ? static_cast<float>(coef) : __int_as_float(0x7fc00000);
}

// Note [Small tensors in one AdamW launch]
// A model has many small parameters: every norm weight, and in kimi_k3 two
// [dim] tensors per AttnRes read (134 at the K3 benchmark shape). One
// launch each costs ~2 us of device time for a few KiB of work (session 6:
// the AttnRes model's AdamW took 0.26 ms more than the plain model's for
// its 134 more tensors). Up to kAdamWBatch tensors of at most
// kAdamWSmall values share one launch here: blockIdx.y picks the tensor,
// the x blocks stride over its values. Each value's arithmetic is
// adamw_kernel's, so the bits are the same as one launch per tensor.
constexpr int kAdamWBatch = 24;
struct AdamWBatch {
  AdamWItem item[kAdamWBatch];
  float decay[kAdamWBatch];  // 1 - lr * weight_decay, per tensor
};

// One AdamW update of `groups` groups of N values, grid-stride: the
// formulas of train/optimizer.cpp's loop in fp32. Both AdamW kernels run
// it, so one launch per tensor and the batched launches have the same bits.
template <int N>
__device__ __forceinline__ void adamw_groups(float* __restrict__ p, const float* __restrict__ g,
                                             float* __restrict__ m, float* __restrict__ v,
                                             __nv_bfloat16* __restrict__ low, int64_t groups,
                                             float decay, float beta1, float beta2,
                                             float step_size, float inv_bc2_sqrt, float eps,
                                             float grad_scale) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < groups;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float pv[N], gv[N], mv[N], vv[N];
    load_n<float, N>(p, k * N, pv);
    load_n<float, N>(g, k * N, gv);
    load_n<float, N>(m, k * N, mv);
    load_n<float, N>(v, k * N, vv);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      // The clip coefficient (Note [Clip folded into AdamW]) is rounded on
      // its own, as ATen's in-place multiply of the gradient rounds it.
      // Every operation is spelled with its rounding (the _rn intrinsics
      // become mul.rn/sub.rn, which ptxas may not fuse into an fma), so the
      // bits do not depend on how this function is scheduled inside each
      // kernel. Written as plain arithmetic, the PTX had contractible
      // mul.f32/sub.f32 and the two kernels' weights differed for the
      // tensors with weight decay (session 9, AdamWBatchHasTheBitsOfOneCallEach).
      gv[j] = __fmul_rn(gv[j], grad_scale);
      pv[j] = __fmul_rn(pv[j], decay);
      mv[j] = __fmaf_rn(1.f - beta1, __fsub_rn(gv[j], mv[j]), mv[j]);  // lerp toward g
      vv[j] = __fmaf_rn(__fmul_rn(1.f - beta2, gv[j]), gv[j], __fmul_rn(vv[j], beta2));
      const float den = __fmaf_rn(__fsqrt_rn(vv[j]), inv_bc2_sqrt, eps);
      pv[j] = __fsub_rn(pv[j], __fdiv_rn(__fmul_rn(step_size, mv[j]), den));
    }
    store_n<float, N>(p, k * N, pv);
    store_n<float, N>(m, k * N, mv);
    store_n<float, N>(v, k * N, vv);
    // Note [Low-precision weight cache]: the new weight's bf16 copy in the
    // same pass, rounded as a cast rounds.
    if (low != nullptr) store_n<__nv_bfloat16, N>(low, k * N, pv);
  }
}

// The clip coefficient an AdamW kernel applies: grad_scale, or with
// scale_dev the one formed on the device (Note [Clip coefficient on the
// device]), where NaN means the norm was not finite and nothing is updated.
__device__ __forceinline__ float adamw_scale(float grad_scale, const float* scale_dev) {
  return scale_dev != nullptr ? *scale_dev : grad_scale;
}

template <int N>
__global__ void adamw_kernel(float* __restrict__ p, const float* __restrict__ g,
                             float* __restrict__ m, float* __restrict__ v,
                             __nv_bfloat16* __restrict__ low, int64_t groups, float decay,
                             float beta1, float beta2, float step_size, float inv_bc2_sqrt,
                             float eps, float grad_scale, const float* __restrict__ scale_dev) {
  const float scale = adamw_scale(grad_scale, scale_dev);
  if (scale != scale) return;
  adamw_groups<N>(p, g, m, v, low, groups, decay, beta1, beta2, step_size, inv_bc2_sqrt, eps,
                  scale);
}

// Note [Small tensors in one AdamW launch]: the update of tensor
// blockIdx.y of the batch, values in groups of 4 (every item 16-byte
// aligned with a multiple of 4 values).
__global__ void adamw_batch_kernel(AdamWBatch batch, float beta1, float beta2, float step_size,
                                   float inv_bc2_sqrt, float eps, float grad_scale,
                                   const float* __restrict__ scale_dev) {
  const float scale = adamw_scale(grad_scale, scale_dev);
  if (scale != scale) return;
  const AdamWItem& it = batch.item[blockIdx.y];
  adamw_groups<4>(it.p, it.g, it.m, it.v, static_cast<__nv_bfloat16*>(it.low_bf16), it.n / 4,
                  batch.decay[blockIdx.y], beta1, beta2, step_size, inv_bc2_sqrt, eps, scale);
}

// Note [Summing the read's partial rows]
// The read's backward (and the norm's, when fused with it) leaves its
// weight-shaped gradients as fp32 partial rows, one per block of rows:
// [sets, parts, dim]. Summing them took an ATen reduction per set and two
// multiplies for the query's and the norm weight's gradients (du * w,
// du * q): four small launches a read, 67 reads a K3 step, ~0.9 ms in
// session 6's profile. One launch does it all: a block owns 32 columns of
// one set, its 32 warps take every 32nd part (lanes on consecutive
// columns, so each load is one 128-byte line), and warp 0 adds the 32 warp
// sums in warp order. The order is fixed, so runs are bitwise reproducible;
// it is not ATen's order, so the sums differ from `partial.sum(0)` in the
// last bits. With the products, set 0's sum s also gives a * s and b * s,
// rounded as the separate multiplies rounded.
constexpr int kSumPartsWarps = 32;
__global__ void __launch_bounds__(32 * kSumPartsWarps)
    sum_parts_kernel(const float* __restrict__ partial, int64_t parts, int64_t dim,
                     float* __restrict__ out, const float* __restrict__ mul_a,
                     const float* __restrict__ mul_b, float* __restrict__ out_a,
                     float* __restrict__ out_b) {
  __shared__ float warp_sums[kSumPartsWarps][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t set = blockIdx.y;
  const float* base = partial + set * parts * dim + c;
  float s = 0.f;
  if (c < dim) {
#pragma unroll 8
    for (int64_t p = threadIdx.y; p < parts; p += kSumPartsWarps) s += base[p * dim];
  }
  warp_sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || c >= dim) return;
  float t = 0.f;
  for (int w = 0; w < kSumPartsWarps; ++w) t += warp_sums[w][threadIdx.x];
  out[set * dim + c] = t;
  if (set == 0 && mul_a != nullptr) {
    out_a[c] = t * mul_a[c];
    out_b[c] = t * mul_b[c];
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

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
int64_t group_of(DType dt) { return dt == DType::kFloat32 ? 4 : 8; }

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

// Eight rows per block (a short serial chain per block, many blocks in
// flight), at most 4096 parts (16 MiB of fp32 partials at dim 1024).
int64_t rms_norm_backward_parts(int64_t rows) {
  const int64_t parts = (rows + 7) / 8;
  return parts < 1 ? 1 : (parts > 4096 ? 4096 : parts);
}

cudaError_t rms_norm_backward(DType dt, const void* dy, const void* x, const float* w,
                              const float* rstd, const void* dres, void* dx, float* dw_partial,
                              int64_t rows, int64_t dim, bool register_form,
                              cudaStream_t stream) {
  const auto parts = static_cast<unsigned>(rms_norm_backward_parts(rows));
  const bool vec = dim % group_of(dt) == 0 && aligned16(dy) && aligned16(x) && aligned16(w) &&
                   aligned16(dx) && aligned16(dw_partial) && aligned16(dres);
  // Rows of up to 2 slices per thread take the register form (4 slices of 8
  // bf16 need 128 registers a thread: too few blocks per SM); the kernels
  // share one signature.
  VIADUCT_DISPATCH_VEC(
      dt, vec, const int64_t per_pass = static_cast<int64_t>(kRowThreads) * N;
      auto kernel = rms_norm_backward_kernel<T, N>;
      if (register_form && dim <= per_pass) {
        kernel = rms_norm_backward_reg_kernel<T, N, 1>;
      } else if (register_form && dim <= 2 * per_pass) {
        kernel = rms_norm_backward_reg_kernel<T, N, 2>;
      }
      kernel<<<parts, kRowThreads, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), w, rstd,
          static_cast<const T*>(dres), static_cast<T*>(dx), dw_partial, rows, dim));
  return cudaGetLastError();
}

cudaError_t rope(DType dt, const void* x, const float* cos, const float* sin, void* y, int64_t B,
                 int64_t T_len, int64_t H, int64_t hd, int64_t sB, int64_t sT, int64_t sH,
                 bool inverse, int64_t div, int64_t mul, int64_t cnt, cudaStream_t stream) {
  const int64_t n = B * T_len * H * hd;
  if (n == 0) return cudaSuccess;
  if (div < 1 || mul < 1 || cnt < 1) return cudaErrorInvalidValue;
  const float sign = inverse ? -1.f : 1.f;
  const int64_t G = group_of(dt);
  const bool vec = hd % G == 0 && sB % G == 0 && sT % G == 0 && sH % G == 0 && aligned16(x) &&
                   aligned16(y);
  if (vec) {
    VIADUCT_DISPATCH(dt, constexpr int N = sizeof(T) == 2 ? 8 : 4;
                     rope_kernel<T, N><<<elementwise_blocks(n / N), kElemThreads, 0, stream>>>(
                         static_cast<const T*>(x), cos, sin, static_cast<T*>(y), n / N, T_len, H,
                         hd / 2, sB, sT, sH, sign, div, mul, cnt));
  } else {
    VIADUCT_DISPATCH(dt, rope_kernel<T, 2><<<elementwise_blocks(n / 2), kElemThreads, 0, stream>>>(
                             static_cast<const T*>(x), cos, sin, static_cast<T*>(y), n / 2, T_len,
                             H, hd / 2, sB, sT, sH, sign, div, mul, cnt));
  }
  return cudaGetLastError();
}

// Block per row: one part per block, up to 1024 blocks. Warp per row:
// kReadRowsPerPart rows a block, up to 1024 blocks (8 MiB of fp32 partials
// at dim 2048; each warp takes more rows beyond that).
int64_t attn_res_read_backward_parts(int64_t rows, bool warp_per_row) {
  const int64_t parts = warp_per_row ? (rows + kReadRowsPerPart - 1) / kReadRowsPerPart : rows;
  return parts < 1 ? 1 : (parts > 1024 ? 1024 : parts);
}

namespace {
// The forward's warp-per-row launch: the register form where a lane's words
// hold the row (rows read in 16-byte words, dim <= 32 * kReadWords * N; the
// only form with the norm), else the loop form.
template <typename T, int N>
cudaError_t launch_read_forward_warp(unsigned grid, cudaStream_t stream, const ReadSources& src,
                                     int n, const float* u, void* out, float* rstd, float* dot,
                                     float* alpha, int64_t rows, int64_t dim, float eps,
                                     const ReadNorm* nrm) {
  if constexpr (N * sizeof(T) == 16) {
    if (dim <= 32 * kReadWords * N) {
      auto kernel = nrm != nullptr ? attn_res_read_forward_warp_kernel<T, N, kReadWords, true>
                                   : attn_res_read_forward_warp_kernel<T, N, kReadWords, false>;
      kernel<<<grid, kReadWarps * 32, 0, stream>>>(src, n, u, static_cast<T*>(out), rstd, dot,
                                                   alpha, rows, dim, eps,
                                                   nrm != nullptr ? *nrm : ReadNorm{});
      return cudaGetLastError();
    }
  }
  if (nrm != nullptr) return cudaErrorNotSupported;
  attn_res_read_forward_warp_loop_kernel<T, N><<<grid, kReadWarps * 32, 0, stream>>>(
      src, n, u, static_cast<T*>(out), rstd, dot, alpha, rows, dim, eps);
  return cudaGetLastError();
}
// Note [Read with its norm in two passes]: the launch for n sources.
template <typename T, int N, int NS, bool kAcc>
cudaError_t launch_read_norm_2pass_kernel(unsigned grid, cudaStream_t stream,
                                          const ReadSources& src, const ReadSources& acc,
                                          const ReadGrads& dsrc, const float* u,
                                          const float* rstd, const float* dot,
                                          const float* alpha, float* du_partial, int64_t rows,
                                          int64_t dim, const ReadNorm& nrm) {
  auto kernel = attn_res_read_norm_backward_2pass_kernel<T, N, kReadWords, NS, kAcc>;
  const size_t smem = sizeof(float) * kReadWarps * kReadWords * 32 * N;  // dw_sh
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  kernel<<<grid, kReadWarps * 32, smem, stream>>>(src, acc, dsrc, u, rstd, dot, alpha,
                                                  du_partial, rows, dim, nrm);
  return cudaGetLastError();
}
template <typename T, int N>
cudaError_t launch_read_norm_backward_2pass(unsigned grid, cudaStream_t stream, bool any_acc,
                                            const ReadSources& src, const ReadSources& acc,
                                            const ReadGrads& dsrc, int n, const float* u,
                                            const float* rstd, const float* dot,
                                            const float* alpha, float* du_partial, int64_t rows,
                                            int64_t dim, const ReadNorm& nrm) {
  static_assert(kReadNormPassMaxSources == 5, "one case per source count");
#define VIADUCT_READ_NORM_2PASS(NS)                                                              \
  return any_acc ? launch_read_norm_2pass_kernel<T, N, NS, true>(grid, stream, src, acc, dsrc, u, \
                                                                 rstd, dot, alpha, du_partial,   \
                                                                 rows, dim, nrm)                 \
                 : launch_read_norm_2pass_kernel<T, N, NS, false>(grid, stream, src, acc, dsrc, \
                                                                  u, rstd, dot, alpha,           \
                                                                  du_partial, rows, dim, nrm)
  switch (n) {
    case 1: VIADUCT_READ_NORM_2PASS(1);
    case 2: VIADUCT_READ_NORM_2PASS(2);
    case 3: VIADUCT_READ_NORM_2PASS(3);
    case 4: VIADUCT_READ_NORM_2PASS(4);
    case 5: VIADUCT_READ_NORM_2PASS(5);
    default: return cudaErrorInvalidValue;
  }
#undef VIADUCT_READ_NORM_2PASS
}
// The backward's warp-per-row launch: the register form (with slots or
// without, with the norm or without), else the loop form.
template <typename T, int N>
cudaError_t launch_read_backward_warp(unsigned grid, cudaStream_t stream, bool any_acc,
                                      const ReadSources& src, const ReadSources& acc,
                                      const ReadGrads& dsrc, int n, const T* g, const float* u,
                                      const float* rstd, const float* dot, const float* alpha,
                                      float* du_partial, int64_t rows, int64_t dim,
                                      const ReadNorm* nrm) {
  if constexpr (N * sizeof(T) == 16) {
    if (dim <= 32 * kReadWords * N) {
      if (nrm != nullptr && nrm->two_pass && n <= kReadNormPassMaxSources) {
        return launch_read_norm_backward_2pass<T, N>(grid, stream, any_acc, src, acc, dsrc, n, u,
                                                     rstd, dot, alpha, du_partial, rows, dim,
                                                     *nrm);
      }
      if (nrm != nullptr) {
        auto kernel = any_acc ? attn_res_read_backward_warp_kernel<T, N, kReadWords, true, true>
                              : attn_res_read_backward_warp_kernel<T, N, kReadWords, false, true>;
        // dw_sh and h_sh: each as du_sh, kReadWarps x ITERS x 32 lanes x N
        // floats (96 KiB a block with du_sh in bf16: 2 blocks an SM).
        const size_t smem = 2 * sizeof(float) * kReadWarps * kReadWords * 32 * N;
        const cudaError_t e = cudaFuncSetAttribute(
            kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
        if (e != cudaSuccess) return e;
        kernel<<<grid, kReadWarps * 32, smem, stream>>>(src, acc, dsrc, n, g, u, rstd, dot,
                                                        alpha, du_partial, rows, dim, *nrm);
        return cudaGetLastError();
      }
      auto kernel = any_acc ? attn_res_read_backward_warp_kernel<T, N, kReadWords, true, false>
                            : attn_res_read_backward_warp_kernel<T, N, kReadWords, false, false>;
      kernel<<<grid, kReadWarps * 32, 0, stream>>>(src, acc, dsrc, n, g, u, rstd, dot, alpha,
                                                   du_partial, rows, dim, ReadNorm{});
      return cudaGetLastError();
    }
  }
  if (nrm != nullptr) return cudaErrorNotSupported;
  attn_res_read_backward_warp_loop_kernel<T, N><<<grid, kReadWarps * 32, 0, stream>>>(
      src, acc, dsrc, n, g, u, rstd, dot, alpha, du_partial, rows, dim);
  return cudaGetLastError();
}

bool read_vectorisable(DType dt, const void* const* p, int n, int64_t dim) {
  if (dim % group_of(dt) != 0) return false;
  for (int i = 0; i < n; ++i) {
    if (!aligned16(p[i])) return false;
  }
  return true;
}
}  // namespace

bool attn_res_read_norm_fits(DType dt, const ReadSources& src, int n, int64_t dim) {
  return n >= 1 && n <= kMaxReadSources && read_vectorisable(dt, src.p, n, dim) &&
         dim <= 32 * kReadWords * group_of(dt);
}

cudaError_t attn_res_read_forward(DType dt, const ReadSources& src, int n, const float* u,
                                  void* out, float* rstd, float* dot, float* alpha, int64_t rows,
                                  int64_t dim, float eps, bool warp_per_row, cudaStream_t stream,
                                  const ReadNorm* nrm) {
  if (n < 1 || n > kMaxReadSources) return cudaErrorInvalidValue;
  if (nrm != nullptr && !(warp_per_row && attn_res_read_norm_fits(dt, src, n, dim) &&
                          aligned16(nrm->w) && aligned16(out) && aligned16(u))) {
    return cudaErrorNotSupported;
  }
  if (rows == 0) return cudaSuccess;
  const bool vec = read_vectorisable(dt, src.p, n, dim) && aligned16(u) && aligned16(out);
  if (warp_per_row) {  // Note [Fused AttnRes read, warp per row]
    const int64_t blocks = (rows + kReadWarps - 1) / kReadWarps;
    if (blocks > INT32_MAX) return cudaErrorInvalidValue;
    VIADUCT_DISPATCH_VEC(dt, vec,
                         return launch_read_forward_warp<T, N>(
                             static_cast<unsigned>(blocks), stream, src, n, u, out, rstd, dot,
                             alpha, rows, dim, eps, nrm));
  }
  if (nrm != nullptr) return cudaErrorNotSupported;
  const unsigned grid = static_cast<unsigned>(rows < 65535 ? rows : 65535);
  const size_t smem = sizeof(float) * (static_cast<size_t>(kRowThreads / 32) * n * 2 + n);
  VIADUCT_DISPATCH_VEC(dt, vec,
                       attn_res_read_forward_kernel<T, N><<<grid, kRowThreads, smem, stream>>>(
                           src, n, u, static_cast<T*>(out), rstd, dot, alpha, rows, dim, eps));
  return cudaGetLastError();
}

cudaError_t attn_res_read_backward(DType dt, const ReadSources& src, const ReadSources& acc,
                                   const ReadGrads& dsrc, int n, const void* g, const float* u,
                                   const float* rstd, const float* dot, const float* alpha,
                                   float* du_partial, int64_t rows, int64_t dim,
                                   bool warp_per_row, cudaStream_t stream,
                                   const ReadNorm* nrm) {
  if (n < 1 || n > kMaxReadSources) return cudaErrorInvalidValue;
  bool any_acc = false;
  for (int i = 0; i < n; ++i) any_acc = any_acc || acc.p[i] != nullptr;
  if (any_acc && !warp_per_row) return cudaErrorInvalidValue;  // those add into nothing
  if (nrm != nullptr) {  // g is formed from nrm->dy; every pointer as the register form needs
    bool ok = warp_per_row && attn_res_read_norm_fits(dt, src, n, dim) && aligned16(nrm->w) &&
              aligned16(nrm->dy) && aligned16(nrm->dw_partial) && aligned16(u) &&
              aligned16(du_partial);
    for (int i = 0; i < n; ++i) ok = ok && aligned16(dsrc.p[i]) && aligned16(acc.p[i]);
    if (!ok) return cudaErrorNotSupported;
  }
  if (rows == 0) return cudaSuccess;
  bool vec = read_vectorisable(dt, src.p, n, dim) && (nrm != nullptr || aligned16(g)) &&
             aligned16(u) && aligned16(du_partial);
  for (int i = 0; i < n; ++i) vec = vec && aligned16(dsrc.p[i]) && aligned16(acc.p[i]);
  const auto grid = static_cast<unsigned>(attn_res_read_backward_parts(rows, warp_per_row));
  if (warp_per_row) {  // Note [Fused AttnRes read, warp per row]
    VIADUCT_DISPATCH_VEC(dt, vec,
                         return launch_read_backward_warp<T, N>(
                             grid, stream, any_acc, src, acc, dsrc, n,
                             static_cast<const T*>(g), u, rstd, dot, alpha, du_partial, rows,
                             dim, nrm));
  }
  if (nrm != nullptr) return cudaErrorNotSupported;
  const size_t smem = sizeof(float) * (static_cast<size_t>(kRowThreads / 32) * n + 3 * n);
  VIADUCT_DISPATCH_VEC(dt, vec,
                       attn_res_read_backward_kernel<T, N><<<grid, kRowThreads, smem, stream>>>(
                           src, dsrc, n, static_cast<const T*>(g), u, rstd, dot, alpha,
                           du_partial, rows, dim));
  return cudaGetLastError();
}

cudaError_t clip_scale(const float* norms, int64_t k, double max_norm, double* norm_out,
                       float* scale_out, cudaStream_t stream) {
  if (k < 0) return cudaErrorInvalidValue;
  clip_scale_kernel<<<1, 32, 0, stream>>>(norms, k, max_norm, norm_out, scale_out);
  return cudaGetLastError();
}

cudaError_t sum_parts(const float* partial, int64_t parts, int64_t dim, int sets, float* out,
                      cudaStream_t stream, const PartsProducts* prod) {
  if (parts < 1 || dim < 0 || sets < 1 || sets > 65535) return cudaErrorInvalidValue;
  if (prod != nullptr &&
      (prod->a == nullptr || prod->b == nullptr || prod->out_a == nullptr || prod->out_b == nullptr))
    return cudaErrorInvalidValue;
  if (dim == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((dim + 31) / 32), static_cast<unsigned>(sets));
  sum_parts_kernel<<<grid, dim3(32, kSumPartsWarps), 0, stream>>>(
      partial, parts, dim, out, prod ? prod->a : nullptr, prod ? prod->b : nullptr,
      prod ? prod->out_a : nullptr, prod ? prod->out_b : nullptr);
  return cudaGetLastError();
}

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

bool adamw_batchable(const AdamWItem& t) {
  return t.n > 0 && t.n <= kAdamWSmall && t.n % 4 == 0 && aligned16(t.p) && aligned16(t.g) &&
         aligned16(t.m) && aligned16(t.v) && aligned16(t.low_bf16);
}

// Every item's decay is formed as adamw() forms it, on the host. The
// product of two floats is exact in double, so a contracted and an
// uncontracted build give the same decay.
float adamw_decay(float lr, float weight_decay) {
  return static_cast<float>(1.0 - static_cast<double>(lr) * static_cast<double>(weight_decay));
}

cudaError_t adamw_batch(const AdamWItem* items, int count, float lr, float beta1, float beta2,
                        float eps, float bias_corr1, float bias_corr2, float grad_scale,
                        cudaStream_t stream, const float* scale_dev) {
  const float step_size = lr / bias_corr1;
  const float inv_bc2_sqrt = 1.f / sqrtf(bias_corr2);
  for (int start = 0; start < count; start += kAdamWBatch) {
    AdamWBatch b{};
    const int k = count - start < kAdamWBatch ? count - start : kAdamWBatch;
    int64_t most = 0;
    for (int i = 0; i < k; ++i) {
      const AdamWItem& t = items[start + i];
      if (!adamw_batchable(t)) return cudaErrorInvalidValue;
      b.item[i] = t;
      b.decay[i] = adamw_decay(lr, t.weight_decay);
      most = t.n > most ? t.n : most;
    }
    const dim3 grid(static_cast<unsigned>(elementwise_blocks(most / 4)), static_cast<unsigned>(k));
    adamw_batch_kernel<<<grid, kElemThreads, 0, stream>>>(b, beta1, beta2, step_size,
                                                          inv_bc2_sqrt, eps, grad_scale,
                                                          scale_dev);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t adamw(float* p, const float* g, float* m, float* v, void* low_bf16, int64_t n,
                  float lr, float beta1, float beta2, float eps, float weight_decay,
                  float bias_corr1, float bias_corr2, float grad_scale, cudaStream_t stream,
                  const float* scale_dev) {
  auto* low = static_cast<__nv_bfloat16*>(low_bf16);
  if (n == 0) return cudaSuccess;
  const float decay = adamw_decay(lr, weight_decay);
  const float step_size = lr / bias_corr1;
  const float inv_bc2_sqrt = 1.f / sqrtf(bias_corr2);
  if (n % 4 == 0 && aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v)) {
    adamw_kernel<4><<<elementwise_blocks(n / 4), kElemThreads, 0, stream>>>(
        p, g, m, v, low, n / 4, decay, beta1, beta2, step_size, inv_bc2_sqrt, eps, grad_scale,
        scale_dev);
  } else {
    adamw_kernel<1><<<elementwise_blocks(n), kElemThreads, 0, stream>>>(
        p, g, m, v, low, n, decay, beta1, beta2, step_size, inv_bc2_sqrt, eps, grad_scale,
        scale_dev);
  }
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
