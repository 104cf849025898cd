// KDA's short convolution: a causal depthwise filter of K taps over time,
// then SiLU (and, for q and k, each head's L2 norm), one pass forward and
// one backward plus a small sum of the weight gradient's partials.
//
// A warp walks a span of tokens of one row over 32 J channels (lane l on
// channels l + 32 j of its group, so each token's loads and stores are
// coalesced), and each thread keeps the last W inputs of its channels in
// registers: every x is read once, not K times. The backward keeps the
// last W gradients of the pre-activation too, so dz never goes to memory:
// dx of token t is complete once dz of t + K - 1 is known, and the weight
// gradient's partial of the span sums dz x as the walk passes. A span's
// backward recomputes the K - 1 tokens of dz past its end that its last
// dx needs (the next span's first ones).
//
// Over documents in place, a token's offset in its document bounds its
// taps: tap j reaches K - 1 - j tokens back, and one that reaches past the
// document's first token is skipped, as the padding before a document
// alone adds nothing (a sum that skips a zero product has its bits).
#include "kernels/common.cuh"
#include "kernels/short_conv.h"

namespace viaduct::cuda {
namespace {

constexpr int kConvWarps = 4;
constexpr int kConvThreads = 32 * kConvWarps;
// Blocks an SM must hold at once: 4 caps a thread at 128 registers, so a
// whole [8192, 1024] call's warps fit on the device in one wave. Windows of
// more than 8 floats a thread would spill under that cap and keep 1.
template <int J, int W>
constexpr int conv_min_blocks() {
  return J * W <= 8 ? 4 : 1;
}

// How far back token t of row b may read: its offset in its document
// (offsets [B, T]), or t itself (no documents: the sequence's start).
__device__ __forceinline__ int64_t reach(const int32_t* __restrict__ offsets, int64_t b,
                                         int64_t t, int64_t Tn) {
  return offsets != nullptr ? offsets[b * Tn + t] : t;
}

// silu(z) = z / (1 + e^-z), as ATen's CUDA silu forms it in fp32.
__device__ __forceinline__ float silu(float z) { return z / (1.f + expf(-z)); }
// silu'(z) = s (1 + z (1 - s)), s = sigmoid(z), each rounding spelled out
// (the plain and the L2-fused backward form the same bits).
__device__ __forceinline__ float silu_grad(float z) {
  const float s = __frcp_rn(__fadd_rn(1.f, expf(-z)));
  return __fmul_rn(s, __fadd_rn(1.f, __fmul_rn(z, __fsub_rn(1.f, s))));
}

// `window[W - 1 - m]` is the value m tokens back: the shift drops the
// oldest and appends the newest. W is a compile-time width (K rounded up),
// so every index below is a constant and the windows stay in registers.
template <typename V, int W>
__device__ __forceinline__ void push(V (&window)[W], V v) {
#pragma unroll
  for (int i = 0; i + 1 < W; ++i) window[i] = window[i + 1];
  window[W - 1] = v;
}

// One thread's channels c + 32 j (j < J) of a warp's group, with each
// channel's taps: ahead[j][i] = w[c_j, i] and back[j][m] = w[c_j, K - 1 -
// m] (zero past K), so that both the forward's sum (taps ascending, m
// descending) and dx's (taps ascending over later tokens) index them by
// constants.
template <int J, int W>
struct Taps {
  float ahead[J][W], back[J][W];
  __device__ Taps(const float* __restrict__ w, int64_t c0, int K) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const float* wc = w + (c0 + 32 * j) * K;
#pragma unroll
      for (int i = 0; i < W; ++i) {
        ahead[j][i] = i < K ? wc[i] : 0.f;
        back[j][i] = i < K ? wc[K - 1 - i] : 0.f;
      }
    }
  }
  // The pre-activation of channel j at the window's newest token, whose
  // taps reach `limit` tokens back: taps ascending (m descending), as the
  // filter's definition orders the sum.
  __device__ __forceinline__ float conv(int j, const float (&x)[W], int limit, int K) const {
    float z = 0.f;
#pragma unroll
    for (int m = W - 1; m >= 0; --m) {
      if (m < K && m <= limit) z += back[j][m] * x[W - 1 - m];
    }
    return z;
  }
};

// The group of 32 J channels a warp takes and the span of tokens its
// block takes; false where the warp has no channels (a thread whose
// channel is past C returns: the plain kernels have no warp-wide steps,
// and the L2 ones take whole heads, so all or none of a warp's lanes are
// in).
template <int J>
__device__ __forceinline__ bool place(int64_t C, int64_t Tn, int64_t spans, int64_t& c0,
                                      int64_t& b, int64_t& t0, int64_t& t1) {
  c0 = (blockIdx.x * static_cast<int64_t>(kConvWarps) + threadIdx.x / 32) * 32 * J +
       threadIdx.x % 32;
  if (c0 >= C) return false;
  const int64_t p = blockIdx.y;  // b * spans + span
  b = p / spans;
  t0 = (p % spans) * kShortConvTokensPerPartial;
  t1 = t0 + kShortConvTokensPerPartial < Tn ? t0 + kShortConvTokensPerPartial : Tn;
  return true;
}

// The window of x before token t0: x[t0 - W + i] in slot i (zero before
// the sequence; no tap reads those).
template <typename T, int J, int W>
__device__ __forceinline__ void fill_before(const T* __restrict__ xb, int64_t c0, int64_t t0,
                                            int64_t xs, float (&x)[J][W]) {
#pragma unroll
  for (int j = 0; j < J; ++j) {
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const int64_t t = t0 - W + i;
      x[j][i] = t >= 0 ? load(xb, t * xs + c0 + 32 * j) : 0.f;
    }
  }
}

// The walk loads kStage tokens' inputs before it uses the first, so that
// a thread has that many loads in flight rather than one (its tokens are
// otherwise a chain of dependent steps): x of tokens base.. below `end`
// (zero past it) and each one's reach (-1 past it: no tap).
constexpr int kStage = 8;
template <typename T, int J>
__device__ __forceinline__ void stage(const T* __restrict__ xb,
                                      const int32_t* __restrict__ offsets, int64_t b,
                                      int64_t base, int64_t end, int64_t Tn, int64_t c0,
                                      int64_t xs, float (&xn)[kStage][J],
                                      int (&limits)[kStage]) {
#pragma unroll
  for (int s = 0; s < kStage; ++s) {
    const int64_t t = base + s;
    const bool in = t < end;
    limits[s] = in ? static_cast<int>(reach(offsets, b, t, Tn)) : -1;
#pragma unroll
    for (int j = 0; j < J; ++j) xn[s][j] = in ? load(xb, t * xs + c0 + 32 * j) : 0.f;
  }
}

// y = silu(conv(x)) stored as Y (plain), or, with kL2, each head's L2
// norm of it rounded to T, times scale, stored fp32.
template <typename T, typename Y, int J, int W, bool kL2>
__global__ void __launch_bounds__(kConvThreads, conv_min_blocks<J, W>())
    forward_kernel(const T* __restrict__ x, const float* __restrict__ w,
                   const int32_t* __restrict__ offsets, Y* __restrict__ y, int64_t Tn, int64_t C,
                   int64_t xs, int K, int64_t spans, float eps, float scale) {
  int64_t c0, b, t0, t1;
  if (!place<J>(C, Tn, spans, c0, b, t0, t1)) return;
  const Taps<J, W> taps(w, c0, K);
  const T* xb = x + b * Tn * xs;
  float xw[J][W];
  fill_before<T, J, W>(xb, c0, t0, xs, xw);
  for (int64_t base = t0; base < t1; base += kStage) {
    float xn[kStage][J];
    int limits[kStage];
    stage<T, J>(xb, offsets, b, base, t1, Tn, c0, xs, xn, limits);
#pragma unroll
    for (int s = 0; s < kStage; ++s) {
      const int64_t t = base + s;
      if (t >= t1) break;  // the same t in every lane
      const int64_t row = (b * Tn + t) * C + c0;
      float v[J];
      float ss = 0.f, unused = 0.f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        push(xw[j], xn[s][j]);
        v[j] = silu(taps.conv(j, xw[j], limits[s], K));
        if constexpr (kL2) {
          // The bits of the plain kernel's stored output, then the L2 norm
          // kernel's sums (kernels/l2_norm.cu).
          v[j] = round_as<T>(v[j]);
          l2_sums(v[j], 0.f, ss, unused);
        } else {
          store(y, row + 32 * j, v[j]);
        }
      }
      if constexpr (kL2) {
        const float r = rsqrtf(warp_sum(ss) + eps);
#pragma unroll
        for (int j = 0; j < J; ++j) y[row + 32 * j] = __fmul_rn(__fmul_rn(v[j], r), scale);
      }
    }
  }
}

// From dy (of G: T plain, fp32 with kL2): dx of the span's tokens and the
// span's partial of dw. dz = dy silu'(z) (plain) or the L2 norm's input
// gradient, rounded to T, times silu'(z), z recomputed from x.
// dx[t] = sum_j w[j] dz[t + K - 1 - j] over the taps that stay inside the
// sequence (and the document: tap j of token t + K - 1 - j reads t where
// it reaches that far back), j ascending. The partial sums dz[t] x[t - K +
// 1 + j] over the span in token order.
template <typename T, typename G, int J, int W, bool kL2>
__global__ void __launch_bounds__(kConvThreads, conv_min_blocks<J, W>())
    backward_kernel(const T* __restrict__ x, const float* __restrict__ w,
                    const int32_t* __restrict__ offsets, const G* __restrict__ dy,
                    T* __restrict__ dx, float* __restrict__ partial, int64_t Tn, int64_t C,
                    int64_t xs, int64_t dxs, int K, int64_t spans, float eps, float scale) {
  int64_t c0, b, t0, t1;
  if (!place<J>(C, Tn, spans, c0, b, t0, t1)) return;
  const Taps<J, W> taps(w, c0, K);
  const T* xb = x + b * Tn * xs;
  float xw[J][W], dzw[J][W], acc[J][W];
  int limits[W];  // each dz slot's reach; -1 past the sequence (no tap)
  fill_before<T, J, W>(xb, c0, t0, xs, xw);
#pragma unroll
  for (int i = 0; i < W; ++i) {
    limits[i] = -1;
#pragma unroll
    for (int j = 0; j < J; ++j) dzw[j][i] = acc[j][i] = 0.f;
  }
  const int64_t walk_end = t1 + K - 1, in_end = walk_end < Tn ? walk_end : Tn;
  for (int64_t base = t0; base < walk_end; base += kStage) {
    float xn[kStage][J], gn[kStage][J];
    int ln[kStage];
    stage<T, J>(xb, offsets, b, base, in_end, Tn, c0, xs, xn, ln);
#pragma unroll
    for (int s = 0; s < kStage; ++s) {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int64_t u = base + s;
        gn[s][j] = u < in_end ? load(dy, (b * Tn + u) * C + c0 + 32 * j) : 0.f;
      }
    }
#pragma unroll
    for (int s = 0; s < kStage; ++s) {
      // dz of token u (zero past the sequence, where no tap reads it); u is
      // the warp's, so the L2 sums' shuffles run in every lane or none.
      const int64_t u = base + s;
      if (u >= walk_end) break;
      const bool in = u < Tn;
      const int limit = ln[s];
      push(limits, limit);
      float z[J], v[J];
      float ss = 0.f, dot = 0.f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        push(xw[j], xn[s][j]);
        z[j] = in ? taps.conv(j, xw[j], limit, K) : 0.f;
        if constexpr (kL2) {
          v[j] = round_as<T>(silu(z[j]));
          l2_sums(v[j], gn[s][j], ss, dot);
        }
      }
      float r = 0.f, r3dot = 0.f;
      if constexpr (kL2) {
        if (in) {
          r = rsqrtf(warp_sum(ss) + eps);
          r3dot = __fmul_rn(__fmul_rn(__fmul_rn(r, r), r), warp_sum(dot));
        }
      }
#pragma unroll
      for (int j = 0; j < J; ++j) {
        float dz = 0.f;
        if (in) {
          const float dv =
              kL2 ? round_as<T>(l2_input_grad(r, gn[s][j], v[j], r3dot, scale)) : gn[s][j];
          dz = __fmul_rn(dv, silu_grad(z[j]));
        }
        push(dzw[j], dz);
        if (u < t1) {
#pragma unroll
          for (int m = 0; m < W; ++m) {
            if (m < K && m <= limit) acc[j][m] += dz * xw[j][W - 1 - m];
          }
        }
      }
      const int64_t t = u - (K - 1);  // the token whose dx is now complete
      if (t >= t0) {
#pragma unroll
        for (int j = 0; j < J; ++j) {
          float sum = 0.f;
#pragma unroll
          for (int i = 0; i < W; ++i) {  // tap i reads dz of u - i
            if (i < K && K - 1 - i <= limits[W - 1 - i]) {
              sum += taps.ahead[j][i] * dzw[j][W - 1 - i];
            }
          }
          store(dx, (b * Tn + t) * dxs + c0 + 32 * j, sum);
        }
      }
    }
  }
  float* out = partial + (static_cast<int64_t>(blockIdx.y) * C + c0) * K;
#pragma unroll
  for (int j = 0; j < J; ++j) {
#pragma unroll
    for (int m = 0; m < W; ++m) {
      if (m < K) out[32 * j * K + K - 1 - m] = acc[j][m];
    }
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

// The grid of a walk: x over groups of kConvWarps warps, y over the
// (row, span) pairs.
dim3 conv_grid(int64_t B, int64_t Tn, int64_t C, int J) {
  const int64_t groups = (C + 32 * J - 1) / (32 * J);
  return dim3(static_cast<unsigned>((groups + kConvWarps - 1) / kConvWarps),
              static_cast<unsigned>(short_conv_partials(B, Tn)));
}

// The walks keep a token's reach in 32 bits and put a (row, span) pair on
// the grid's y (65,535 at most).
bool bad_shape(int64_t B, int64_t Tn, int64_t C, int K, int64_t xs) {
  return K < 1 || K > kShortConvMaxTaps || xs < C || Tn >= (int64_t{1} << 31) ||
         short_conv_partials(B, Tn) > 65535;
}
bool bad_head(int64_t C, int64_t head_dim) {
  return (head_dim != 32 && head_dim != 64 && head_dim != 128) || C % head_dim != 0;
}

// W: the filter's length rounded up to 4 or kShortConvMaxTaps.
#define VIADUCT_SHORT_CONV_W(K_, ...)       \
  if ((K_) <= 4) {                          \
    constexpr int W = 4;                    \
    __VA_ARGS__;                            \
  } else {                                  \
    constexpr int W = kShortConvMaxTaps;    \
    __VA_ARGS__;                            \
  }

#define VIADUCT_SHORT_CONV_J(d_, ...)                    \
  switch ((d_) / 32) {                                   \
    case 1: { constexpr int J = 1; __VA_ARGS__; break; } \
    case 2: { constexpr int J = 2; __VA_ARGS__; break; } \
    case 4: { constexpr int J = 4; __VA_ARGS__; break; } \
    default: return cudaErrorInvalidValue;               \
  }

void sum_partials(const float* partial, float* dw, int64_t B, int64_t Tn, int64_t C, int K,
                  cudaStream_t stream) {
  const int64_t CK = C * K;
  dw_sum_kernel<<<static_cast<unsigned>((CK + kElemThreads - 1) / kElemThreads), kElemThreads,
                  0, stream>>>(partial, dw, CK, short_conv_partials(B, Tn));
}

}  // namespace

cudaError_t short_conv_silu_forward(DType dt, const void* x, int64_t xs, const float* w,
                                    const int32_t* offsets, void* y, int64_t B, int64_t Tn,
                                    int64_t C, int K, cudaStream_t stream) {
  if (B * Tn * C == 0) return cudaSuccess;
  if (bad_shape(B, Tn, C, K, xs)) return cudaErrorInvalidValue;
  const int64_t spans = short_conv_partials(1, Tn);
  VIADUCT_SHORT_CONV_W(K, VIADUCT_DISPATCH(dt, (forward_kernel<T, T, 1, W, false>
                                                <<<conv_grid(B, Tn, C, 1), kConvThreads, 0,
                                                   stream>>>(static_cast<const T*>(x), w, offsets,
                                                             static_cast<T*>(y), Tn, C, xs, K,
                                                             spans, 0.f, 0.f))));
  return cudaGetLastError();
}

cudaError_t short_conv_silu_backward(DType dt, const void* x, int64_t xs, const float* w,
                                     const int32_t* offsets, const void* dy, void* dx,
                                     int64_t dxs, float* partial, float* dw, int64_t B,
                                     int64_t Tn, int64_t C, int K, cudaStream_t stream) {
  if (bad_shape(B, Tn, C, K, xs) || dxs < C) return cudaErrorInvalidValue;
  if (B * Tn * C == 0) return cudaMemsetAsync(dw, 0, sizeof(float) * C * K, stream);
  const int64_t spans = short_conv_partials(1, Tn);
  VIADUCT_SHORT_CONV_W(K, VIADUCT_DISPATCH(dt, (backward_kernel<T, T, 1, W, false>
                                                <<<conv_grid(B, Tn, C, 1), kConvThreads, 0,
                                                   stream>>>(static_cast<const T*>(x), w, offsets,
                                                             static_cast<const T*>(dy),
                                                             static_cast<T*>(dx), partial, Tn, C,
                                                             xs, dxs, K, spans, 0.f, 0.f))));
  sum_partials(partial, dw, B, Tn, C, K, stream);
  return cudaGetLastError();
}

cudaError_t short_conv_silu_l2_forward(DType dt, const void* x, int64_t xs, const float* w,
                                       const int32_t* offsets, float* y, int64_t B, int64_t Tn,
                                       int64_t C, int K, int64_t head_dim, float eps,
                                       float scale, cudaStream_t stream) {
  if (bad_shape(B, Tn, C, K, xs) || bad_head(C, head_dim)) return cudaErrorInvalidValue;
  if (B * Tn * C == 0) return cudaSuccess;
  const int64_t spans = short_conv_partials(1, Tn);
  VIADUCT_SHORT_CONV_J(
      head_dim,
      VIADUCT_SHORT_CONV_W(K, VIADUCT_DISPATCH(dt, (forward_kernel<T, float, J, W, true>
                                                    <<<conv_grid(B, Tn, C, J), kConvThreads, 0,
                                                       stream>>>(static_cast<const T*>(x), w,
                                                                 offsets, y, Tn, C, xs, K, spans,
                                                                 eps, scale)))));
  return cudaGetLastError();
}

cudaError_t short_conv_silu_l2_backward(DType dt, const void* x, int64_t xs, const float* w,
                                        const int32_t* offsets, const float* dy, void* dx,
                                        int64_t dxs, float* partial, float* dw, int64_t B,
                                        int64_t Tn, int64_t C, int K, int64_t head_dim,
                                        float eps, float scale, cudaStream_t stream) {
  if (bad_shape(B, Tn, C, K, xs) || bad_head(C, head_dim) || dxs < C) {
    return cudaErrorInvalidValue;
  }
  if (B * Tn * C == 0) return cudaMemsetAsync(dw, 0, sizeof(float) * C * K, stream);
  const int64_t spans = short_conv_partials(1, Tn);
  VIADUCT_SHORT_CONV_J(
      head_dim,
      VIADUCT_SHORT_CONV_W(K, VIADUCT_DISPATCH(dt, (backward_kernel<T, float, J, W, true>
                                                    <<<conv_grid(B, Tn, C, J), kConvThreads, 0,
                                                       stream>>>(static_cast<const T*>(x), w,
                                                                 offsets, dy,
                                                                 static_cast<T*>(dx), partial,
                                                                 Tn, C, xs, dxs, K, spans, eps,
                                                                 scale)))));
  sum_partials(partial, dw, B, Tn, C, K, stream);
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
