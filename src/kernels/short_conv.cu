// KDA's short convolution: a causal depthwise filter of K taps over time,
// then SiLU, in one pass forward and four small passes backward (the
// pre-activation is recomputed from x, so the forward keeps only x).
// Threads run along channels, so every load and store is coalesced.
// Over documents in place, a token's offset in its document bounds its
// taps: tap j reaches K - 1 - j tokens back, and one that reaches past the
// document's first token is skipped, as the padding before a document
// alone adds nothing (a sum that skips a zero product has its bits).
#include "kernels/common.cuh"
#include "kernels/short_conv.h"

namespace viaduct::cuda {
namespace {

// How far back token t of row b may read: its offset in its document
// (offsets [B, T]), or t itself (no documents: the sequence's start).
__device__ __forceinline__ int64_t reach(const int32_t* __restrict__ offsets, int64_t b,
                                         int64_t t, int64_t Tn) {
  return offsets != nullptr ? offsets[b * Tn + t] : t;
}

// The pre-activation at token t of channel c: x points at (b, 0, c), its
// tokens xs apart, wc at w[c, 0]; taps in ascending j, those within `back`
// tokens of t.
template <typename T>
__device__ __forceinline__ float conv_at(const T* __restrict__ x, const float* __restrict__ wc,
                                         int64_t t, int64_t back, int64_t xs, int K) {
  float z = 0.f;
  for (int j = 0; j < K; ++j) {
    if (K - 1 - j <= back) z += wc[j] * load(x, (t - K + 1 + j) * xs);
  }
  return z;
}

// silu(z) = z / (1 + e^-z), as ATen's CUDA silu forms it in fp32.
__device__ __forceinline__ float silu(float z) { return z / (1.f + expf(-z)); }
// silu'(z) = s (1 + z (1 - s)), s = sigmoid(z), each rounding spelled out
// (the plain and the L2-fused backward form the same bits).
__device__ __forceinline__ float silu_grad(float z) {
  const float s = __frcp_rn(__fadd_rn(1.f, expf(-z)));
  return __fmul_rn(s, __fadd_rn(1.f, __fmul_rn(z, __fsub_rn(1.f, s))));
}

// The elementwise kernels' grid: x over channels, y over a row's tokens
// (a stride loop past the grid's y limit), z over the rows (B within the
// same limit), so a thread finds its (b, t, c) without a division (a
// 64-bit division by a runtime value is a routine of tens of
// instructions, as many as the rest of the element's work).
constexpr int64_t kGridYZLimit = 65535;
dim3 element_grid(int64_t B, int64_t Tn, int64_t C) {
  return dim3(static_cast<unsigned>((C + kElemThreads - 1) / kElemThreads),
              static_cast<unsigned>(Tn < kGridYZLimit ? Tn : kGridYZLimit),
              static_cast<unsigned>(B));
}

// Calls f(b, t, c) for each token t of the thread's row b and channel c
// on the element grid.
template <typename F>
__device__ __forceinline__ void for_each_token(int64_t Tn, int64_t C, F&& f) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  const int64_t b = blockIdx.z;
  for (int64_t t = blockIdx.y; t < Tn; t += gridDim.y) f(b, t, c);
}

template <typename T>
__global__ void __launch_bounds__(kElemThreads)
    forward_kernel(const T* __restrict__ x, const float* __restrict__ w,
                   const int32_t* __restrict__ offsets, T* __restrict__ y, int64_t Tn, int64_t C,
                   int64_t xs, int K) {
  for_each_token(Tn, C, [&](int64_t b, int64_t t, int64_t c) {
    const float z = conv_at(x + b * Tn * xs + c, w + c * K, t, reach(offsets, b, t, Tn), xs, K);
    store(y, (b * Tn + t) * C + c, silu(z));
  });
}

// dz = dy silu'(z), silu'(z) = s (1 + z (1 - s)), s = sigmoid(z).
template <typename T>
__global__ void __launch_bounds__(kElemThreads)
    dz_kernel(const T* __restrict__ x, const float* __restrict__ w,
              const int32_t* __restrict__ offsets, const T* __restrict__ dy,
              float* __restrict__ dz, int64_t Tn, int64_t C, int64_t xs, int K) {
  for_each_token(Tn, C, [&](int64_t b, int64_t t, int64_t c) {
    const int64_t i = (b * Tn + t) * C + c;
    const float z = conv_at(x + b * Tn * xs + c, w + c * K, t, reach(offsets, b, t, Tn), xs, K);
    dz[i] = __fmul_rn(load(dy, i), silu_grad(z));
  });
}

// dx[b, t, c] = sum_j w[c, j] dz[b, t + K - 1 - j, c] over the taps that
// stay inside the sequence (and the document: tap j of token t + K - 1 - j
// reads t where it reaches that far back), j ascending.
template <typename T>
__global__ void __launch_bounds__(kElemThreads)
    dx_kernel(const float* __restrict__ w, const int32_t* __restrict__ offsets,
              const float* __restrict__ dz, T* __restrict__ dx, int64_t Tn, int64_t C, int K) {
  for_each_token(Tn, C, [&](int64_t b, int64_t t, int64_t c) {
    const float* dzc = dz + b * Tn * C + c;
    const float* wc = w + c * K;
    float acc = 0.f;
    for (int j = 0; j < K; ++j) {
      const int64_t dst = t + K - 1 - j;
      if (dst < Tn && K - 1 - j <= reach(offsets, b, dst, Tn)) acc += wc[j] * dzc[dst * C];
    }
    store(dx, (b * Tn + t) * C + c, acc);
  });
}

// One partial of dw per (sequence, span of tokens): a thread per channel
// sums its span's dz x products in token order.
template <typename T>
__global__ void __launch_bounds__(kElemThreads)
    dw_partial_kernel(const T* __restrict__ x, const int32_t* __restrict__ offsets,
                      const float* __restrict__ dz, float* __restrict__ partial, int64_t Tn,
                      int64_t C, int64_t xs, int K, int64_t spans) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  const int64_t p = blockIdx.y;  // b * spans + span
  const int64_t b = p / spans, t0 = (p % spans) * kShortConvTokensPerPartial;
  const int64_t t1 = t0 + kShortConvTokensPerPartial < Tn ? t0 + kShortConvTokensPerPartial : Tn;
  const T* xc = x + b * Tn * xs + c;
  const float* dzc = dz + b * Tn * C + c;
  float acc[kShortConvMaxTaps];
#pragma unroll
  for (int j = 0; j < kShortConvMaxTaps; ++j) acc[j] = 0.f;
  // Unrolled so that several tokens' loads are in flight at once; the sums
  // still run in token order.
#pragma unroll 4
  for (int64_t t = t0; t < t1; ++t) {
    const float g = dzc[t * C];
    const int64_t back = reach(offsets, b, t, Tn);
#pragma unroll
    for (int j = 0; j < kShortConvMaxTaps; ++j) {
      if (j < K && K - 1 - j <= back) acc[j] += g * load(xc, (t - K + 1 + j) * xs);
    }
  }
  float* out = partial + (p * C + c) * K;
#pragma unroll
  for (int j = 0; j < kShortConvMaxTaps; ++j) {
    if (j < K) out[j] = acc[j];
  }
}

// dw[c, j] = the partials summed in order.
__global__ void __launch_bounds__(kElemThreads)
    dw_sum_kernel(const float* __restrict__ partial, float* __restrict__ dw, int64_t CK,
                  int64_t parts) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= CK) return;
  float acc = 0.f;
  for (int64_t p = 0; p < parts; ++p) acc += partial[p * CK + i];
  dw[i] = acc;
}

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kElemThreads - 1) / kElemThreads); }

// With the L2 norm of each head's d = 32 J channels (KDA's q and k): a warp
// per (token, head), lane l on channels l + 32 j. The convolution's output
// is rounded to T where the convolution kernel stores it, and the norm
// sums its squares in kernels/l2_norm.cu's order, so the results are the
// bits of the two kernels run one after the other, without the T tensor
// between them written and read back (or kept for the backward).
constexpr int kNormRowsPerBlock = kElemThreads / 32;

// Row `row` of [B, Tn, heads] as (token bt = b Tn + t, head h), in 32-bit
// divisions (a few instructions, where 64-bit ones are a long routine);
// the launchers keep B Tn heads below 2^31.
__device__ __forceinline__ void row_place(int64_t row, int64_t heads, int64_t Tn, int64_t& bt,
                                          int64_t& h, int64_t& t, int64_t& b) {
  const auto r = static_cast<uint32_t>(row), hs = static_cast<uint32_t>(heads);
  const uint32_t q = r / hs;
  const uint32_t bq = q / static_cast<uint32_t>(Tn);
  bt = q;
  h = r - q * hs;
  b = bq;
  t = q - bq * static_cast<uint32_t>(Tn);
}

template <typename T, int J>
__global__ void __launch_bounds__(kElemThreads)
    l2_forward_kernel(const T* __restrict__ x, const float* __restrict__ w,
                      const int32_t* __restrict__ offsets, float* __restrict__ y, int64_t rows,
                      int64_t Tn, int64_t C, int64_t xs, int K, float eps, float scale) {
  constexpr int d = 32 * J;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kNormRowsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // a whole warp leaves together
  int64_t bt, h, t, b;
  row_place(row, C / d, Tn, bt, h, t, b);
  const int64_t back = reach(offsets, b, t, Tn);
  float v[J];
  float ss = 0.f, unused = 0.f;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int64_t c = h * d + lane + 32 * j;
    v[j] = round_as<T>(silu(conv_at(x + b * Tn * xs + c, w + c * K, t, back, xs, K)));
    l2_sums(v[j], 0.f, ss, unused);
  }
  const float r = rsqrtf(warp_sum(ss) + eps);
#pragma unroll
  for (int j = 0; j < J; ++j) {
    y[bt * C + h * d + lane + 32 * j] = __fmul_rn(__fmul_rn(v[j], r), scale);
  }
}

// dz for the backward of the two: the norm's input gradient (rounded to T,
// as the norm kernel stores it for the convolution) times silu'(z), z and
// the norm's input recomputed from x.
template <typename T, int J>
__global__ void __launch_bounds__(kElemThreads)
    l2_dz_kernel(const T* __restrict__ x, const float* __restrict__ w,
                 const int32_t* __restrict__ offsets, const float* __restrict__ dy,
                 float* __restrict__ dz, int64_t rows, int64_t Tn, int64_t C, int64_t xs, int K,
                 float eps, float scale) {
  constexpr int d = 32 * J;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kNormRowsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  int64_t bt, h, t, b;
  row_place(row, C / d, Tn, bt, h, t, b);
  const int64_t back = reach(offsets, b, t, Tn);
  float z[J], v[J], g[J];
  float ss = 0.f, dot = 0.f;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int64_t c = h * d + lane + 32 * j;
    z[j] = conv_at(x + b * Tn * xs + c, w + c * K, t, back, xs, K);
    v[j] = round_as<T>(silu(z[j]));
    g[j] = dy[bt * C + c];
    l2_sums(v[j], g[j], ss, dot);
  }
  const float r = rsqrtf(warp_sum(ss) + eps);
  dot = warp_sum(dot);
  const float r3dot = __fmul_rn(__fmul_rn(__fmul_rn(r, r), r), dot);
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const float dv = round_as<T>(l2_input_grad(r, g[j], v[j], r3dot, scale));
    dz[bt * C + h * d + lane + 32 * j] = __fmul_rn(dv, silu_grad(z[j]));
  }
}

#define VIADUCT_SHORT_CONV_J(d_, ...)                    \
  switch ((d_) / 32) {                                   \
    case 1: { constexpr int J = 1; __VA_ARGS__; break; } \
    case 2: { constexpr int J = 2; __VA_ARGS__; break; } \
    case 4: { constexpr int J = 4; __VA_ARGS__; break; } \
    default: return cudaErrorInvalidValue;               \
  }

// dx and dw from dz, as the plain backward's last three launches.
template <typename T>
void dx_dw_from_dz(const T* x, int64_t xs, const float* w, const int32_t* offsets,
                   const float* dz, T* dx, float* partial, float* dw, int64_t B, int64_t Tn,
                   int64_t C, int K, cudaStream_t stream) {
  const int64_t spans = (Tn + kShortConvTokensPerPartial - 1) / kShortConvTokensPerPartial;
  dx_kernel<T><<<element_grid(B, Tn, C), kElemThreads, 0, stream>>>(w, offsets, dz, dx, Tn, C, K);
  const dim3 grid(blocks_for(C), static_cast<unsigned>(B * spans));
  dw_partial_kernel<T><<<grid, kElemThreads, 0, stream>>>(x, offsets, dz, partial, Tn, C, xs, K,
                                                           spans);
  dw_sum_kernel<<<blocks_for(C * K), kElemThreads, 0, stream>>>(partial, dw, C * K, B * spans);
}

}  // namespace

cudaError_t short_conv_silu_forward(DType dt, const void* x, int64_t xs, const float* w,
                                    const int32_t* offsets, void* y, int64_t B, int64_t Tn,
                                    int64_t C, int K, cudaStream_t stream) {
  const int64_t n = B * Tn * C;
  if (n == 0) return cudaSuccess;
  if (K < 1 || K > kShortConvMaxTaps || xs < C || B > kGridYZLimit) return cudaErrorInvalidValue;
  VIADUCT_DISPATCH(dt, forward_kernel<T><<<element_grid(B, Tn, C), kElemThreads, 0, stream>>>(
                           static_cast<const T*>(x), w, offsets, static_cast<T*>(y), Tn, C, xs,
                           K));
  return cudaGetLastError();
}

cudaError_t short_conv_silu_backward(DType dt, const void* x, int64_t xs, const float* w,
                                     const int32_t* offsets, const void* dy, float* dz, void* dx,
                                     float* partial, float* dw, int64_t B, int64_t Tn, int64_t C,
                                     int K, cudaStream_t stream) {
  const int64_t n = B * Tn * C;
  if (K < 1 || K > kShortConvMaxTaps || xs < C) return cudaErrorInvalidValue;
  if (n == 0) return cudaMemsetAsync(dw, 0, sizeof(float) * C * K, stream);
  const int64_t spans = (Tn + kShortConvTokensPerPartial - 1) / kShortConvTokensPerPartial;
  const int64_t parts = B * spans;
  if (parts > 65535) return cudaErrorInvalidValue;  // grid.y; the op checks first
  VIADUCT_DISPATCH(dt, {
    const auto* xt = static_cast<const T*>(x);
    dz_kernel<T><<<element_grid(B, Tn, C), kElemThreads, 0, stream>>>(
        xt, w, offsets, static_cast<const T*>(dy), dz, Tn, C, xs, K);
    dx_dw_from_dz<T>(xt, xs, w, offsets, dz, static_cast<T*>(dx), partial, dw, B, Tn, C, K,
                     stream);
  });
  return cudaGetLastError();
}

cudaError_t short_conv_silu_l2_forward(DType dt, const void* x, int64_t xs, const float* w,
                                       const int32_t* offsets, float* y, int64_t B, int64_t Tn,
                                       int64_t C, int K, int64_t head_dim, float eps,
                                       float scale, cudaStream_t stream) {
  if (K < 1 || K > kShortConvMaxTaps || xs < C ||
      (head_dim != 32 && head_dim != 64 && head_dim != 128) || C % head_dim != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = B * Tn * (C / head_dim);
  if (rows == 0) return cudaSuccess;
  if (rows >= (int64_t{1} << 31)) return cudaErrorInvalidValue;  // row_place's 32 bits
  const unsigned blocks = static_cast<unsigned>((rows + kNormRowsPerBlock - 1) / kNormRowsPerBlock);
  VIADUCT_SHORT_CONV_J(head_dim, VIADUCT_DISPATCH(dt, l2_forward_kernel<T, J>
                                                  <<<blocks, kElemThreads, 0, stream>>>(
                                                      static_cast<const T*>(x), w, offsets, y,
                                                      rows, Tn, C, xs, K, eps, scale)));
  return cudaGetLastError();
}

cudaError_t short_conv_silu_l2_backward(DType dt, const void* x, int64_t xs, const float* w,
                                        const int32_t* offsets, const float* dy, float* dz,
                                        void* dx, float* partial, float* dw, int64_t B,
                                        int64_t Tn, int64_t C, int K, int64_t head_dim,
                                        float eps, float scale, cudaStream_t stream) {
  if (K < 1 || K > kShortConvMaxTaps || xs < C ||
      (head_dim != 32 && head_dim != 64 && head_dim != 128) || C % head_dim != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = B * Tn * (C / head_dim);
  if (rows == 0) return cudaMemsetAsync(dw, 0, sizeof(float) * C * K, stream);
  if (rows >= (int64_t{1} << 31)) return cudaErrorInvalidValue;  // row_place's 32 bits
  if (short_conv_partials(B, Tn) > 65535) return cudaErrorInvalidValue;  // grid.y
  const unsigned blocks = static_cast<unsigned>((rows + kNormRowsPerBlock - 1) / kNormRowsPerBlock);
  VIADUCT_SHORT_CONV_J(head_dim, VIADUCT_DISPATCH(dt, {
    const auto* xt = static_cast<const T*>(x);
    l2_dz_kernel<T, J><<<blocks, kElemThreads, 0, stream>>>(xt, w, offsets, dy, dz, rows, Tn, C,
                                                             xs, K, eps, scale);
    dx_dw_from_dz<T>(xt, xs, w, offsets, dz, static_cast<T*>(dx), partial, dw, B, Tn, C, K,
                     stream);
  }));
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
