// The KDA layer's gates in one pass each way. ATen's forms run each as a
// chain of elementwise passes over [tokens, H D] fp32 (the cast up, the
// bias add, softplus, the product with -exp(A_log); the norm, the cast,
// sigmoid, the product, the cast back) and as many again backward, each
// saving its input; here each direction reads its inputs once and the
// backward recomputes what it needs from them.
#include "kernels/common.cuh"
#include "kernels/kda_gates.h"

namespace viaduct::cuda {
namespace {

constexpr float kSoftplusThreshold = 20.f;  // ATen's default
constexpr int64_t kDecayRowsPerPart = 64;
constexpr int64_t kDecayMaxParts = 1024;
constexpr int kNormWarps = 8;  // rows a block handles at once, a warp each
constexpr int64_t kNormMaxParts = 1024;

__device__ __forceinline__ float softplus(float z) {
  return z > kSoftplusThreshold ? z : log1pf(expf(z));
}
__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + expf(-z)); }

template <typename T>
__global__ void __launch_bounds__(kElemThreads)
    decay_forward_kernel(const T* __restrict__ f, const float* __restrict__ dt_bias,
                         const float* __restrict__ A_log, float* __restrict__ g, int64_t n,
                         int64_t C, int64_t D) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int64_t c = i % C;
  const float a = -expf(A_log[c / D]);
  g[i] = a * softplus(load(f, i) + dt_bias[c]);
}

// A thread per channel over one part's rows, in row order: reads f and dg
// once, writes df, and keeps the part's sums of dz and dg softplus(z).
template <typename T>
__global__ void __launch_bounds__(kElemThreads)
    decay_backward_kernel(const T* __restrict__ f, const float* __restrict__ dt_bias,
                          const float* __restrict__ A_log, const float* __restrict__ dg,
                          T* __restrict__ df, float* __restrict__ dbias_part,
                          float* __restrict__ gs_part, int64_t rows, int64_t C, int64_t D,
                          int64_t span) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  const int64_t p = blockIdx.y;
  const int64_t r0 = p * span, r1 = r0 + span < rows ? r0 + span : rows;
  const float a = -expf(A_log[c / D]), bias = dt_bias[c];
  float sb = 0.f, sg = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r * C + c;
    const float z = load(f, i) + bias, gi = dg[i];
    float sp, dsp;
    if (z > kSoftplusThreshold) {
      sp = z;
      dsp = 1.f;
    } else {
      const float e = expf(z);
      sp = log1pf(e);
      dsp = e / (e + 1.f);
    }
    const float dz = gi * a * dsp;
    store(df, i, dz);
    sb += dz;
    sg += gi * sp;
  }
  dbias_part[p * C + c] = sb;
  gs_part[p * C + c] = sg;
}

// A warp per row of D = 32 J channels, lane l holding channels l + 32 j.
template <typename T, int J>
__global__ void __launch_bounds__(kNormWarps * 32)
    gated_norm_forward_kernel(const float* __restrict__ x, const T* __restrict__ gl,
                              const float* __restrict__ w, T* __restrict__ y,
                              float* __restrict__ rstd, int64_t rows, float eps) {
  constexpr int D = 32 * J;
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kNormWarps) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t base = row * D;
  float xv[J];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    xv[j] = x[base + lane + 32 * j];
    ss += xv[j] * xv[j];
  }
  const float r = rsqrtf(warp_sum(ss) / static_cast<float>(D) + eps);
  if (lane == 0) rstd[row] = r;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int c = lane + 32 * j;
    store(y, base + c, xv[j] * r * w[c] * sigmoid(load(gl, base + c)));
  }
}

// Rows in a grid stride, a warp each; each warp keeps its rows' share of
// the weight gradient in registers, and the block adds its warps' shares
// in warp order into its part (no atomics; the caller adds the parts).
template <typename T, int J>
__global__ void __launch_bounds__(kNormWarps * 32)
    gated_norm_backward_kernel(const float* __restrict__ x, const T* __restrict__ gl,
                               const float* __restrict__ w, const float* __restrict__ rstd,
                               const T* __restrict__ dy, float* __restrict__ dx,
                               T* __restrict__ dgl, float* __restrict__ dw_part, int64_t rows,
                               ChunkRows dx_rows) {
  constexpr int D = 32 * J;
  __shared__ float shares[kNormWarps][D];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float pw[J];
#pragma unroll
  for (int j = 0; j < J; ++j) pw[j] = 0.f;
  for (int64_t row = blockIdx.x * static_cast<int64_t>(kNormWarps) + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kNormWarps) {
    const int64_t base = row * D;
    const float r = rstd[row];
    float xv[J], s[J], g[J], u[J];
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int c = lane + 32 * j;
      xv[j] = x[base + c];
      s[j] = sigmoid(load(gl, base + c));
      g[j] = load(dy, base + c);
      u[j] = g[j] * s[j];
      sum += u[j] * w[c] * xv[j];
    }
    const float k = r * r * r * warp_sum(sum) / static_cast<float>(D);
    const int64_t dx_base = dx_rows.of(row) * D;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int c = lane + 32 * j;
      const float n = xv[j] * r * w[c];
      dx[dx_base + c] = r * u[j] * w[c] - xv[j] * k;
      store(dgl, base + c, g[j] * n * ((1.f - s[j]) * s[j]));
      pw[j] += u[j] * xv[j] * r;
    }
  }
#pragma unroll
  for (int j = 0; j < J; ++j) shares[warp][lane + 32 * j] = pw[j];
  __syncthreads();
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float t = 0.f;
    for (int v = 0; v < kNormWarps; ++v) t += shares[v][c];
    dw_part[blockIdx.x * static_cast<int64_t>(D) + c] = t;
  }
}

unsigned blocks_for(int64_t n, int64_t per) { return static_cast<unsigned>((n + per - 1) / per); }

}  // namespace

#define VIADUCT_GATED_NORM_J(D_, ...)                 \
  switch ((D_) / 32) {                                \
    case 1: { constexpr int J = 1; __VA_ARGS__; break; } \
    case 2: { constexpr int J = 2; __VA_ARGS__; break; } \
    case 3: { constexpr int J = 3; __VA_ARGS__; break; } \
    case 4: { constexpr int J = 4; __VA_ARGS__; break; } \
    case 5: { constexpr int J = 5; __VA_ARGS__; break; } \
    case 6: { constexpr int J = 6; __VA_ARGS__; break; } \
    case 7: { constexpr int J = 7; __VA_ARGS__; break; } \
    case 8: { constexpr int J = 8; __VA_ARGS__; break; } \
    default: return cudaErrorInvalidValue;            \
  }

cudaError_t kda_decay_forward(DType dt, const void* f, const float* dt_bias, const float* A_log,
                              float* g, int64_t rows, int64_t H, int64_t D, cudaStream_t stream) {
  const int64_t C = H * D, n = rows * C;
  if (n == 0) return cudaSuccess;
  VIADUCT_DISPATCH(dt, decay_forward_kernel<T><<<blocks_for(n, kElemThreads), kElemThreads, 0,
                                                 stream>>>(static_cast<const T*>(f), dt_bias,
                                                           A_log, g, n, C, D));
  return cudaGetLastError();
}

int64_t kda_decay_parts(int64_t rows) {
  const int64_t parts = (rows + kDecayRowsPerPart - 1) / kDecayRowsPerPart;
  return parts < 1 ? 1 : (parts > kDecayMaxParts ? kDecayMaxParts : parts);
}

cudaError_t kda_decay_backward(DType dt, const void* f, const float* dt_bias,
                               const float* A_log, const float* dg, void* df, float* dbias_part,
                               float* gs_part, int64_t rows, int64_t H, int64_t D,
                               cudaStream_t stream) {
  const int64_t C = H * D, parts = kda_decay_parts(rows);
  if (C == 0) return cudaSuccess;
  if (rows == 0) {
    if (auto e = cudaMemsetAsync(dbias_part, 0, sizeof(float) * C, stream); e != cudaSuccess) {
      return e;
    }
    return cudaMemsetAsync(gs_part, 0, sizeof(float) * C, stream);
  }
  const int64_t span = (rows + parts - 1) / parts;
  const dim3 grid(blocks_for(C, kElemThreads), static_cast<unsigned>(parts));
  VIADUCT_DISPATCH(dt, decay_backward_kernel<T><<<grid, kElemThreads, 0, stream>>>(
                           static_cast<const T*>(f), dt_bias, A_log, dg, static_cast<T*>(df),
                           dbias_part, gs_part, rows, C, D, span));
  return cudaGetLastError();
}

cudaError_t gated_rms_norm_forward(DType dt, const float* x, const void* gl, const float* w,
                                   void* y, float* rstd, int64_t rows, int64_t D, float eps,
                                   cudaStream_t stream) {
  if (D % 32 != 0 || D > kGatedNormMaxDim) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  VIADUCT_GATED_NORM_J(D, VIADUCT_DISPATCH(dt, gated_norm_forward_kernel<T, J>
                                           <<<blocks_for(rows, kNormWarps), kNormWarps * 32, 0,
                                              stream>>>(x, static_cast<const T*>(gl), w,
                                                        static_cast<T*>(y), rstd, rows, eps)));
  return cudaGetLastError();
}

int64_t gated_rms_norm_parts(int64_t rows) {
  const int64_t parts = (rows + 63) / 64;
  return parts < 1 ? 1 : (parts > kNormMaxParts ? kNormMaxParts : parts);
}

cudaError_t gated_rms_norm_backward(DType dt, const float* x, const void* gl, const float* w,
                                    const float* rstd, const void* dy, float* dx, void* dgl,
                                    float* dw_part, int64_t rows, int64_t D, ChunkRows dx_rows,
                                    cudaStream_t stream) {
  if (D % 32 != 0 || D > kGatedNormMaxDim) return cudaErrorInvalidValue;
  if (dx_rows.per_head != 0 &&
      (dx_rows.T <= 0 || dx_rows.H <= 0 || dx_rows.per_head < dx_rows.T ||
       rows % (dx_rows.T * dx_rows.H) != 0)) {
    return cudaErrorInvalidValue;
  }
  const unsigned parts = static_cast<unsigned>(gated_rms_norm_parts(rows));
  VIADUCT_GATED_NORM_J(D, VIADUCT_DISPATCH(dt, gated_norm_backward_kernel<T, J>
                                           <<<parts, kNormWarps * 32, 0, stream>>>(
                                               x, static_cast<const T*>(gl), w, rstd,
                                               static_cast<const T*>(dy), dx,
                                               static_cast<T*>(dgl), dw_part, rows,
                                               dx_rows)));
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
