// Rotary embedding on interleaved pairs, and the repeat or sum of grouped
// heads through the same kernel (with or without the rotation).
#include <algorithm>

#include "kernels/common.cuh"
#include "kernels/rope.h"

namespace viaduct::cuda {
namespace {

// x is read through strides (sB, sT, sH; the last dim is contiguous) so the
// backward can rotate SDPA's transposed gradient without a copy; y is
// [B, T, H, hd] with token pitch yT and head pitch yH (H hd and hd:
// contiguous; wider: the slice of a wider row, as the qkv gradient's q, k
// and v parts, or of wider heads, as MLA's rotary channels beside the
// others). Each thread rotates N / 2 pairs. Output head h
// reads the sum of input heads (h / div) * mul + r for r < cnt (in that
// order, in fp32): (1, 1, 1) is a plain rotation; (rep, 1, 1) writes each
// input head rep times (grouped KV heads repeated for attention); (1, rep,
// rep) sums rep heads (the repeat's backward).
// cos_t == nullptr: no rotation (the heads copied or summed as above; v's
// grouped heads repeated for attention, see Note [Repeated heads without a
// gather]).
// A block per (b, t) row, its threads over the row's heads and their
// N-element groups: the row's indices come from the block, the head's from
// one 32-bit division a thread. cos_t and sin_t are read N / 2 values at a
// time (as one 16-byte load for bf16's groups of 8: the caller guarantees
// the tables' alignment for the vector forms).
// Several rows a block, each thread's loads for all of them issued first,
// ran slower: the registers it took left fewer threads an SM.
// A repeat ((rep, 1, 1)) has `fan` = rep output heads per input head: a
// thread reads and rotates an input group once and stores it to each of
// them (the same arithmetic, so the same bits, with a quarter of the loads
// and rotations for a repeat of 4). A template argument, so that the other
// calls keep the registers (and the blocks an SM) of a kernel without it.
template <typename T, int N, bool kFan>
__global__ void rope_kernel(const T* __restrict__ x, const float* __restrict__ cos_t,
                            const float* __restrict__ sin_t, T* __restrict__ y, int64_t rows,
                            int64_t T_len, int64_t H, int64_t half, int64_t sB, int64_t sT,
                            int64_t sH, float sign, int64_t div, int64_t mul, int64_t cnt,
                            int64_t yT, int64_t yH, int64_t fan_arg) {
  constexpr int P = N / 2;
  const int64_t fan = kFan ? fan_arg : 1;
  const int per_head = static_cast<int>(2 * half / N);  // groups in one head vector
  const int per_row = static_cast<int>(H / fan) * per_head;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t t = row % T_len, b = row / T_len;
    for (int j = threadIdx.x; j < per_row; j += blockDim.x) {
      const int hh = j / per_head;
      const int64_t h = hh * fan;  // the first of the output heads this group goes to
      const int64_t d = static_cast<int64_t>(j - hh * per_head) * N;  // first element in the head
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
        float cs[P], sn[P];
        load_n<float, P>(cos_t, t * half + d / 2, cs);
        load_n<float, P>(sin_t, t * half + d / 2, sn);
#pragma unroll
        for (int k = 0; k < N; k += 2) {
          const float c = cs[k / 2], s = sign * sn[k / 2];
          o[k] = v[k] * c - v[k + 1] * s;
          o[k + 1] = v[k] * s + v[k + 1] * c;
        }
      }
      for (int64_t f = 0; f < fan; ++f) {
        store_n<T, N>(y, (b * T_len + t) * yT + (h + f) * yH + d, o);
      }
    }
  }
}

// The launch: a block per row (up to 2^30 blocks, then a stride), threads
// for the row's groups rounded to warps, at most kElemThreads.
template <typename T, int N>
cudaError_t launch_rope(const T* x, const float* cos_t, const float* sin_t, T* y, int64_t rows,
                        int64_t T_len, int64_t H, int64_t half, int64_t sB, int64_t sT,
                        int64_t sH, float sign, int64_t div, int64_t mul, int64_t cnt,
                        int64_t yT, int64_t yH, cudaStream_t stream) {
  const int64_t fan = mul == 1 && cnt == 1 && div > 1 && H % div == 0 ? div : 1;
  const int64_t per_row = H / fan * (2 * half / N);
  const int64_t threads = std::min<int64_t>(kElemThreads, (per_row + 31) / 32 * 32);
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(rows, int64_t{1} << 30));
  auto kernel = fan > 1 ? rope_kernel<T, N, true> : rope_kernel<T, N, false>;
  kernel<<<blocks, static_cast<unsigned>(threads), 0, stream>>>(
      x, cos_t, sin_t, y, rows, T_len, H, half, sB, sT, sH, sign, div, mul, cnt, yT, yH, fan);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rope(DType dt, const void* x, const float* cos, const float* sin, void* y, int64_t B,
                 int64_t T_len, int64_t H, int64_t hd, int64_t sB, int64_t sT, int64_t sH,
                 bool inverse, int64_t div, int64_t mul, int64_t cnt, cudaStream_t stream,
                 int64_t yT, int64_t yH) {
  const int64_t n = B * T_len * H * hd;
  if (n == 0) return cudaSuccess;
  if (div < 1 || mul < 1 || cnt < 1 || yH < hd || yT < (H - 1) * yH + hd) {
    return cudaErrorInvalidValue;
  }
  const float sign = inverse ? -1.f : 1.f;
  const int64_t G = group_of(dt);
  const bool vec = hd % G == 0 && sB % G == 0 && sT % G == 0 && sH % G == 0 && yT % G == 0 &&
                   yH % G == 0 && aligned16(x) && aligned16(y) &&
                   (cos == nullptr || (aligned16(cos) && aligned16(sin)));
  const int64_t rows = B * T_len;
  if (vec) {
    VIADUCT_DISPATCH(dt, constexpr int N = sizeof(T) == 2 ? 8 : 4;
                     return launch_rope<T, N>(static_cast<const T*>(x), cos, sin,
                                              static_cast<T*>(y), rows, T_len, H, hd / 2, sB, sT,
                                              sH, sign, div, mul, cnt, yT, yH, stream));
  }
  VIADUCT_DISPATCH(dt, return launch_rope<T, 2>(static_cast<const T*>(x), cos, sin,
                                                static_cast<T*>(y), rows, T_len, H, hd / 2, sB,
                                                sT, sH, sign, div, mul, cnt, yT, yH, stream));
  return cudaErrorInvalidValue;
}

}  // namespace viaduct::cuda
