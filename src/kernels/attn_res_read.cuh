// What the AttnRes read's kernel files share (kernels/attn_res_read.cu,
// kernels/attn_res_read_norm.cu): the warp-per-row layout, the lane helpers
// and the two-pass backward's entry. CUDA only.
#pragma once

#include "kernels/attn_res_read.h"
#include "kernels/common.cuh"

namespace viaduct::cuda {
namespace {

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

// Note [Fused AttnRes read, warp per row]
// A block per row would be latency-bound: each row would wait on two block
// barriers and a softmax that one thread runs while the others idle. Here
// a warp owns a row, blocks of kReadWarps independent warps, and no block
// barrier sits on a row's path. A sum over the row is the lane's columns in order, then a shuffle
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
// statistics are the same bits in both forms.
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
// The form that adds into slots (see Note [AttnRes block gradients in place])
// holds a slot's slice too.
constexpr int kReadBackwardAccBlocksPerSM = 2;
// Note [AttnRes read with its norm]
// Every AttnRes read in kimi_k3 feeds
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
// sources in backward (from L2 where it stays). h's sums wait in shared
// memory and dy is loaded where used, so the register form does not spill.
static_assert(kMaxReadSources <= 64, "LaneSlots hold two sources a lane");

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

// The backward's per-source coefficients of the warp's row (see Note [Fused
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

// See Note [Read with its norm in two passes] (kernels/attn_res_read_norm.cu):
// the source counts it takes; more take the three-pass form.
constexpr int kReadNormPassMaxSources = 5;

}  // namespace

// The two-pass read-with-norm backward for n <= kReadNormPassMaxSources
// sources (kernels/attn_res_read_norm.cu), for the register form's 16-byte
// words: T float with N 4, or bf16 with N 8.
template <typename T, int N>
cudaError_t launch_read_norm_backward_2pass(unsigned grid, cudaStream_t stream, bool any_acc,
                                            const ReadSources& src, const ReadSources& acc,
                                            const ReadGrads& dsrc, int n, const float* u,
                                            const float* rstd, const float* dot,
                                            const float* alpha, float* du_partial, int64_t rows,
                                            int64_t dim, const ReadNorm& nrm);

}  // namespace viaduct::cuda
