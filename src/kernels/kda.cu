// KDA chunked gated delta rule: the intra-chunk transform, the serial scan
// over chunks and the backward of each (see kernels/kda.h for the terms),
// and the batched products over the chunks the caller runs between them
// (Tm R, and the backward's S, dS and v' products: kda_gemm). Every product
// runs on the tensor cores in split-tf32 (fp32 accuracy).
#include "kernels/common.cuh"
#include "kernels/kda.h"

#include <cuda_runtime.h>

#include <cmath>

namespace viaduct::cuda {
namespace {

constexpr int C = static_cast<int>(kKdaChunk);
constexpr int kFwdThreads = 512;  // the intra-chunk forward's block

// The row of each of chunk n's C rows of head bh in a [B, T, H] tensor (-1
// where the chunk holds no token: past T, or past the token count the
// chunk table gives it), into rows[C] by the first C threads; the caller
// syncs before use. A [B, T, H, D] tensor's row starts at D times it.
__device__ __forceinline__ void chunk_rows(const KdaShape& s, int64_t bh, int64_t n,
                                           int64_t* rows) {
  const int c = threadIdx.x;
  if (c < C) {
    const int64_t b = bh / s.H;
    int64_t first = n * C, count = s.T - first;
    if (s.spans != nullptr) {
      const int32_t* span = s.spans + (b * s.N + n) * 2;
      first = span[0];
      count = span[1];
    }
    rows[c] = c < count ? ((b * s.T + first + c) * s.H + bh % s.H) : -1;
  }
}

// ---- tensor-core products in fp32 accuracy ---------------------------------
// mma m16n8k8 with tf32 operands and fp32 accumulators, each product taken
// as three (split-tf32): an fp32 operand a is hi + lo with hi = tf32(a) and
// lo = tf32(a - hi), and a b is formed as lo_a hi_b + hi_a lo_b + hi_a hi_b
// (the small terms in an accumulator of their own, added last). That keeps
// about fp32's accuracy (the dropped lo lo term is ~2^-22 of the product)
// where one tf32 product would lose 2^-11. Fragments (g = lane / 4, t =
// lane % 4): A (16 x 8, row major) a0 (g, t), a1 (g + 8, t), a2 (g, t + 4),
// a3 (g + 8, t + 4); B (8 x 8) b0 (t, g), b1 (t + 4, g); C (16 x 8) c0 (g,
// 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1).
// a = hi + lo in tf32 (each the 19-bit pattern in a 32-bit register).
__device__ __forceinline__ void split_tf32(float a, uint32_t& hi, uint32_t& lo) {
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(a));
  const float r = a - __uint_as_float(hi);
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(r));
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One split-tf32 step: main += hi_a hi_b, small += lo_a hi_b + hi_a lo_b.
__device__ __forceinline__ void mma_split(float (&main)[4], float (&small)[4], const float (&a)[4],
                                          const float (&b)[2]) {
  uint32_t ah[4], al[4], bh[2], bl[2];
#pragma unroll
  for (int e = 0; e < 4; ++e) split_tf32(a[e], ah[e], al[e]);
#pragma unroll
  for (int e = 0; e < 2; ++e) split_tf32(b[e], bh[e], bl[e]);
  mma_tf32(small, al, bh);
  mma_tf32(small, ah, bl);
  mma_tf32(main, ah, bh);
}

// ---- the products over the chunks -------------------------------------------
// A block computes a 64 x 64 tile of one C_z, four warps of 32 x 32 (two
// m16 by four n8 fragments), over K in steps of 32 staged in shared memory:
// A as [m][k] rows of 36 (a fragments (g, t) on 4 g + t), B as [k][n] rows
// of 72 (b fragments (t, g) on 8 t + g). The global reads follow whichever
// index is contiguous. Each fragment is split once and serves all of the
// warp's products.
constexpr int kGemmM = 64, kGemmN = 64, kGemmK = 32, kGemmThreads = 128;
static_assert(kGemmM == C && kGemmThreads >= C, "a token-layout tile is one chunk's rows");

template <bool AT, bool BT>  // AT: A contiguous along m; BT: B contiguous along k
__global__ void __launch_bounds__(kGemmThreads) gemm_kernel(KdaGemm p) {
  __shared__ float As[kGemmM][kGemmK + 4];
  __shared__ float Bs[kGemmK][kGemmN + 8];
  const int64_t z = blockIdx.z;
  const int64_t m0 = blockIdx.y * kGemmM, n0 = blockIdx.x * kGemmN;
  const float* A = p.A.data + z * p.A.batch;
  const float* B = p.B.data + z * p.B.batch;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
  // Token layout: each C row's place in the [B, T, H] rows (chunk_rows).
  __shared__ int64_t rows[kGemmM];
  if (p.to_tokens) {
    const int64_t zc = p.z_first + z, N = p.tokens.chunks();
    chunk_rows(p.tokens, zc / N, zc % N, rows);
    __syncthreads();
  }
  float acc[2][4][4] = {}, small[2][4][4] = {};
  for (int64_t k0 = 0; k0 < p.K; k0 += kGemmK) {
#pragma unroll
    for (int i = 0; i < kGemmM * kGemmK / kGemmThreads; ++i) {
      if (AT) {
        const int m = tid % kGemmM, k = tid / kGemmM + 2 * i;
        As[m][k] = A[(m0 + m) + (k0 + k) * p.A.col];
      } else {
        const int k = tid % kGemmK, m = tid / kGemmK + 4 * i;
        As[m][k] = A[(m0 + m) * p.A.row + k0 + k];
      }
    }
#pragma unroll
    for (int i = 0; i < kGemmK * kGemmN / kGemmThreads; ++i) {
      if (BT) {
        const int k = tid % kGemmK, n = tid / kGemmK + 4 * i;
        Bs[k][n] = B[(k0 + k) + (n0 + n) * p.B.col];
      } else {
        const int n = tid % kGemmN, k = tid / kGemmN + 2 * i;
        Bs[k][n] = B[(k0 + k) * p.B.row + n0 + n];
      }
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kGemmK; kk += 8) {
      uint32_t ah[2][4], al[2][4], bh[4][2], bl[4][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          split_tf32(As[wm + 16 * mi + g + 8 * (e & 1)][kk + t + 4 * (e >> 1)], ah[mi][e],
                     al[mi][e]);
        }
      }
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          split_tf32(Bs[kk + t + 4 * e][wn + 8 * ni + g], bh[ni][e], bl[ni][e]);
        }
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          mma_tf32(small[mi][ni], al[mi], bh[ni]);
          mma_tf32(small[mi][ni], ah[mi], bl[ni]);
          mma_tf32(acc[mi][ni], ah[mi], bh[ni]);
        }
      }
    }
    __syncthreads();
  }
  float* Cz = p.C + z * p.c_batch;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t m = m0 + wm + 16 * mi + g + 8 * h, n = n0 + wn + 8 * ni + 2 * t;
        const int64_t row = p.to_tokens ? rows[m] : m;
        if (row < 0) continue;
        float2* out = reinterpret_cast<float2*>((p.to_tokens ? p.C : Cz) + row * p.c_row + n);
        float2 v = make_float2(p.alpha * (acc[mi][ni][2 * h] + small[mi][ni][2 * h]),
                               p.alpha * (acc[mi][ni][2 * h + 1] + small[mi][ni][2 * h + 1]));
        if (p.beta != 0.f) {
          const float2 old = *out;
          v.x = fmaf(p.beta, old.x, v.x);
          v.y = fmaf(p.beta, old.y, v.y);
        }
        *out = v;
      }
    }
  }
}

// ---- intra-chunk forward ---------------------------------------------------
// One block per chunk. Shared: G, q, k as [C][D + 4] (the mma fragments'
// rows g and columns t land on 4 g + t: 32 banks), Aqk, Kp, Tm as
// [C][C + 1], beta [C], and the triangular inverse's block products.
//
// The pair terms P_cjd = e^{G_cd - G_jd} factor through any row r between
// j and c: P_cjd = e^{G_cd - G_rd} e^{G_rd - G_jd}, and both factors are
// <= 1 (G falls along the chunk), so nothing overflows. With the chunk cut
// into four sub-chunks of 16 rows and r the first row of c's sub-chunk,
// the block of pairs (sub-chunk I of rows, an earlier sub-chunk J of
// columns) is a plain product over d of rescaled rows, (q_c e^{G_c - G_r})
// (k_j e^{G_r - G_j}), run on the tensor cores; the diagonal blocks, where
// r would lie between j and c only for some pairs, keep the direct form
// with an exponential per term.
constexpr int kSub = 16;                 // sub-chunk rows
constexpr int kDiagPairs = kSub * (kSub + 1) / 2;  // pairs j <= c of one diagonal block

template <int D>
constexpr size_t intra_forward_smem() {
  return sizeof(float) * (3 * C * (D + 4) + 3 * C * (C + 1) + C + (C / kSub - 1) * kSub * kSub);
}

// Sub-chunk pair (I, J), I > J, of index p in 0..5: (1,0) (2,0) (2,1) (3,0)
// (3,1) (3,2).
__device__ __forceinline__ void block_pair(int p, int& I, int& J) {
  I = p < 1 ? 1 : p < 3 ? 2 : 3;
  J = p - I * (I - 1) / 2;
}

// Pair e in 0..kDiagPairs-1 of a diagonal block, row-major over j <= c:
// (c, j) within the block.
__device__ __forceinline__ void diag_pair(int e, int& c, int& j) {
  c = 0;
  while (e > c) e -= ++c;
  j = e;
}

template <int D, typename Tv>
__global__ void __launch_bounds__(kFwdThreads)
    intra_forward_kernel(KdaShape s, const float* __restrict__ q, const float* __restrict__ k,
                         const Tv* __restrict__ v, const float* __restrict__ g,
                         const float* __restrict__ beta, float* __restrict__ Aqk,
                         float* __restrict__ Kp, float* __restrict__ Tm, float* __restrict__ R,
                         float* __restrict__ qe, float* __restrict__ ke,
                         float* __restrict__ dec) {
  constexpr int P = D + 4, Q = C + 1;
  extern __shared__ float smem[];
  float* Gs = smem;
  float* qs = Gs + C * P;
  float* ks = qs + C * P;
  float* As = ks + C * P;
  float* Ks = As + C * Q;
  float* Ts = Ks + C * Q;
  float* bs = Ts + C * Q;
  float* Ms = bs + C;  // [C / kSub - 1][kSub][kSub]: the inverse's partial products
  __shared__ int64_t rows[C];
  const int64_t N = s.chunks();
  const int64_t z = blockIdx.x, bh = z / N, n = z % N;
  const int tid = threadIdx.x;
  chunk_rows(s, bh, n, rows);
  __syncthreads();

  for (int i = tid; i < C * D; i += kFwdThreads) {
    const int c = i / D, d = i % D;
    const int64_t r = rows[c] * D;
    Gs[c * P + d] = r < 0 ? 0.f : g[r + d];
    qs[c * P + d] = r < 0 ? 0.f : q[r + d];
    ks[c * P + d] = r < 0 ? 0.f : k[r + d];
  }
  for (int i = tid; i < C * Q; i += kFwdThreads) As[i] = Ks[i] = Ts[i] = 0.f;
  if (tid < C) bs[tid] = rows[tid] < 0 ? 0.f : beta[rows[tid]];
  __syncthreads();
  // Inclusive cumulative log-decay along the chunk, one thread a channel.
  if (tid < D) {
    float acc = 0.f;
    for (int c = 0; c < C; ++c) {
      acc += Gs[c * P + tid];
      Gs[c * P + tid] = acc;
    }
  }
  __syncthreads();
  const int warp = tid / 32, lane = tid % 32;
  // Below the diagonal blocks: warp 2 p + h computes columns 8 h .. 8 h + 7
  // of block pair p for Aqk and Kp (one B operand, two A operands), summed
  // over d in steps of 8 (split-tf32).
  constexpr int kTileWarps = 12;  // 6 block pairs, 2 column halves
  if (warp < kTileWarps) {
    int I, J;
    block_pair(warp / 2, I, J);
    const int r = kSub * I, j0 = kSub * J + 8 * (warp % 2);
    const int fg = lane / 4, ft = lane % 4;
    const float* Gr = Gs + r * P;
    float qm[4] = {0.f, 0.f, 0.f, 0.f}, qsm[4] = {0.f, 0.f, 0.f, 0.f};
    float km[4] = {0.f, 0.f, 0.f, 0.f}, ksm[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int d0 = 0; d0 < D; d0 += 8) {
      float aq[4], ak[4], b[2];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int o = (r + fg + 8 * (e & 1)) * P + d0 + ft + 4 * (e >> 1);
        const float x = expf(Gs[o] - Gr[d0 + ft + 4 * (e >> 1)]);
        aq[e] = qs[o] * x;
        ak[e] = ks[o] * x;
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int d = d0 + ft + 4 * e, o = (j0 + fg) * P + d;
        b[e] = ks[o] * expf(Gr[d] - Gs[o]);
      }
      mma_split(qm, qsm, aq, b);
      mma_split(km, ksm, ak, b);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int o = (r + fg + 8 * (e >> 1)) * Q + j0 + 2 * ft + (e & 1);
      As[o] = qm[e] + qsm[e];
      Ks[o] = km[e] + ksm[e];
    }
  }
  // The diagonal blocks, a thread a pair j <= c, each entry summed over d in
  // order (disjoint from the entries above). Their 4 x 136 pairs are more
  // than a pair a thread: the warps without a tile above take two pairs a
  // thread and the first tile warps one, so no warp takes a tile and two.
  constexpr int kFree = kFwdThreads - 32 * kTileWarps;
  static_assert(4 * kDiagPairs - 2 * kFree <= 32 * kTileWarps, "a pair a tile thread at most");
  const bool free_thread = tid >= 32 * kTileWarps;
  const int first = free_thread ? tid - 32 * kTileWarps : 2 * kFree + tid;
  const int end = free_thread ? 2 * kFree : 4 * kDiagPairs;
  const int step = free_thread ? kFree : 32 * kTileWarps;
  for (int e = first; e < end; e += step) {
    int c, j;
    diag_pair(e % kDiagPairs, c, j);
    c += kSub * (e / kDiagPairs);
    j += kSub * (e / kDiagPairs);
    float aq = 0.f, ak = 0.f;
    const float* Gc = Gs + c * P;
    const float* Gj = Gs + j * P;
    const float* qc = qs + c * P;
    const float* kc = ks + c * P;
    const float* kj = ks + j * P;
#pragma unroll 8
    for (int d = 0; d < D; ++d) {
      const float x = kj[d] * expf(Gc[d] - Gj[d]);  // exponent <= 0
      aq = fmaf(qc[d], x, aq);
      ak = fmaf(kc[d], x, ak);
    }
    As[c * Q + j] = aq;
    if (j < c) Ks[c * Q + j] = ak;
  }
  __syncthreads();
  // Tm = L^-1 for L = I + diag(beta) Kp (unit lower triangular), by
  // sub-chunk blocks. The diagonal blocks by forward substitution, a thread
  // a column: x_c = [c == i] - beta_c sum_{i <= j < c} Kp[c, j] x_j.
  if (tid < C) {
    const int i = tid, hi = (i & ~(kSub - 1)) + kSub;
    Ts[i * Q + i] = 1.f;
    for (int c = i + 1; c < hi; ++c) {
      float acc = 0.f;
      for (int j = i; j < c; ++j) acc = fmaf(Ks[c * Q + j], Ts[j * Q + i], acc);
      Ts[c * Q + i] = -bs[c] * acc;
    }
  }
  __syncthreads();
  // Then the blocks below, one band I - J = l at a time: from (L Tm)_IJ = 0,
  // Tm_IJ = -Tm_II M with M = sum_{J <= K < I} L_IK Tm_KJ, every Tm_KJ of
  // the bands before.
  for (int l = 1; l < C / kSub; ++l) {
    const int blocks = (C / kSub - l) * kSub * kSub;
    for (int e = tid; e < blocks; e += kFwdThreads) {
      const int J = e / (kSub * kSub), row = kSub * (J + l) + (e / kSub) % kSub;
      const int col = kSub * J + e % kSub;
      float acc = 0.f;
      for (int j = kSub * J; j < kSub * (J + l); ++j) {
        acc = fmaf(Ks[row * Q + j], Ts[j * Q + col], acc);
      }
      Ms[e] = bs[row] * acc;
    }
    __syncthreads();
    for (int e = tid; e < blocks; e += kFwdThreads) {
      const int J = e / (kSub * kSub), I = J + l, row = kSub * I + (e / kSub) % kSub;
      const int cc = e % kSub;
      float acc = 0.f;
      for (int k = 0; k < kSub; ++k) {
        acc = fmaf(Ts[row * Q + kSub * I + k], Ms[J * kSub * kSub + k * kSub + cc], acc);
      }
      Ts[row * Q + kSub * J + cc] = -acc;
    }
    __syncthreads();
  }
  const int64_t zc = z * C;
  for (int i = tid; i < C * C; i += kFwdThreads) {
    const int c = i / C, j = i % C;
    Aqk[zc * C + i] = As[c * Q + j];
    Kp[zc * C + i] = Ks[c * Q + j];
    Tm[zc * C + i] = Ts[c * Q + j];
  }
  for (int i = tid; i < C * D; i += kFwdThreads) {
    const int c = i / D, d = i % D;
    const float G = Gs[c * P + d], GL = Gs[(C - 1) * P + d];
    const float eG = expf(G);
    const int64_t r = rows[c] * D;
    const float vv = r < 0 ? 0.f : load(v, r + d);
    qe[zc * D + i] = qs[c * P + d] * eG;
    ke[zc * D + i] = ks[c * P + d] * expf(GL - G);
    R[(zc + c) * 2 * D + d] = bs[c] * eG * ks[c * P + d];
    R[(zc + c) * 2 * D + D + d] = bs[c] * vv;
  }
  if (tid < D) dec[z * D + tid] = expf(Gs[(C - 1) * P + tid]);
}

// ---- the scan over chunks --------------------------------------------------
// Both passes are one recurrence over the chunks of a head (forward in
// order, backward in reverse), with S [D][D] carried from chunk to chunk:
//   x_n     = A_n + s1 M1_n S_n                    [C][D]
//   S_next  = dec_n * S_n + s2 M2_n^T x_n + Y_n    (dec scales the rows)
// forward:  A = U, M1 = W, s1 = -1, M2 = ke, s2 = +1, Y = 0 (x = v')
// backward: A = Aqk^T do, M1 = ke, s1 = +1, M2 = W, s2 = -1, Y = qe^T do
//           (S = dS, x = dv')
// Everything else (o, and the backward's products) is a batched GEMM over
// the chunks on the saved states, left to the caller.
//
// One block per head and slice of V = 16 value columns, eight warps. The
// two products of a chunk run on the tensor cores in split-tf32 (above).
// The state slice stays in fp32 registers in the mma's accumulator layout
// and is mirrored to shared memory as the next chunk's operand. M1 and M2
// of the next chunk are copied into shared memory (cp.async, two buffers)
// while the current chunk computes; A, Y and dec of the next chunk are
// loaded into registers a chunk ahead. The mma's sums run in a fixed order,
// so the pass is bitwise run to run. Shared rows are padded so that each
// fragment load hits 32 banks: M1 [C][D + 4] (rows g, columns t), M2
// [C][D + 8] and the operands S [D][V + 8], x [C][V + 8] (rows t,
// columns g).
constexpr int V = 16;
constexpr int kScanWarps = 8;
constexpr int kScanThreads = 32 * kScanWarps;
constexpr int PV = V + 8;

template <int D>
struct ScanLayout {
  static constexpr int P1 = D + 4, P2 = D + 8;
  static constexpr int m1 = C * P1, m2 = C * P2;  // one buffer each
  static constexpr int floats = 2 * (m1 + m2) + D * PV + C * PV;
};

template <int D>
constexpr size_t scan_smem() {
  return sizeof(float) * ScanLayout<D>::floats;
}

struct ScanArgs {
  const float* A;  int64_t a_stride;   // [Z][C][a_stride], this slice's columns at 0
  const float* M1; int64_t m1_stride;  // [Z][C][m1_stride]
  const float* M2; int64_t m2_stride;  // [Z][C][m2_stride]
  const float* dec;                    // [Z][D]
  const float* Y;                      // [Z][D][D] or null
  const float* S0;                     // [B H][D][D] or null
  // [B][N] or null: the state is zero as a flagged chunk starts (forward);
  // the gradient of the state before a flagged chunk is zero (backward).
  const uint8_t* restarts;
  float s1, s2;
  bool reverse;
  float* x;        int64_t x_stride;   // [Z][C][x_stride]
  float* states;                       // [Z][D][D]: S as the chunk starts
  float* final_state;                  // [B H][D][D]
  // Backward only (else null): the forward's states Sf [Z][D][D], and
  // ddec's parts [Z][D][kda_ddec_parts(D)]: part 2 blockIdx.x + (column
  // tile) of sum_i S[k][i] Sf[k][i] over that tile's 8 columns, with S the
  // state as the chunk starts (dS after the chunk).
  const float* Sf;
  float* ddec_part;
};

template <int D>
__global__ void __launch_bounds__(kScanThreads) scan_kernel(KdaShape s, ScanArgs p) {
  using L = ScanLayout<D>;
  constexpr int P1 = L::P1, P2 = L::P2;
  constexpr int ST = D / 64;  // state tiles (16 rows x 8 columns) per warp
  extern __shared__ float smem[];
  float* M1s = smem;              // [2][C][P1]
  float* M2s = M1s + 2 * L::m1;   // [2][C][P2]
  float* Ss = M2s + 2 * L::m2;    // [D][PV]
  float* xs = Ss + D * PV;        // [C][PV]
  const int64_t N = s.chunks();
  const int64_t bh = blockIdx.y;
  const int i0 = blockIdx.x * V;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int nt = warp & 1;              // this warp's column tile (8 columns)
  const int col = nt * 8 + 2 * t;       // its accumulator columns col, col + 1
  const int xrow = (warp >> 1) * 16;    // its x tile's first row
  auto srow = [&](int j) { return ((warp >> 1) + 4 * j) * 16; };  // state tile j's first row

  auto chunk_of = [&](int64_t step) { return p.reverse ? N - 1 - step : step; };
  // M1 and M2 of chunk n into buffer b.
  auto stage = [&](int64_t n, int b) {
    const int64_t zc = (bh * N + n) * C;
    constexpr int D4 = D / 4;
    for (int e = tid; e < C * D4; e += kScanThreads) {
      const int c = e / D4, k = (e % D4) * 4;
      cp_async16(M1s + b * L::m1 + c * P1 + k, p.M1 + (zc + c) * p.m1_stride + k);
      cp_async16(M2s + b * L::m2 + c * P2 + k, p.M2 + (zc + c) * p.m2_stride + k);
    }
    cp_async_commit();
  };
  // A, Y and dec of chunk n at this thread's accumulator positions.
  struct Ahead {
    float2 a[2];
    float2 y[ST][2];
    float dec[ST][2];
    float2 sf[ST][2];
  };
  auto fetch = [&](int64_t n, Ahead& f) {
    const int64_t z = bh * N + n, zc = z * C;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      f.a[h] = *reinterpret_cast<const float2*>(p.A + (zc + xrow + g + 8 * h) * p.a_stride + i0 +
                                                col);
    }
#pragma unroll
    for (int j = 0; j < ST; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int k = srow(j) + g + 8 * h;
        f.y[j][h] = p.Y ? *reinterpret_cast<const float2*>(p.Y + (z * D + k) * D + i0 + col)
                        : make_float2(0.f, 0.f);
        f.dec[j][h] = p.dec[z * D + k];
        f.sf[j][h] = p.Sf ? *reinterpret_cast<const float2*>(p.Sf + (z * D + k) * D + i0 + col)
                          : make_float2(0.f, 0.f);
      }
    }
  };

  float S[ST][4];  // the state slice: tile j, rows srow(j) + g (+ 8), columns col (+ 1)
#pragma unroll
  for (int j = 0; j < ST; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = srow(j) + g + 8 * h;
      float2 v = make_float2(0.f, 0.f);
      if (p.S0) v = *reinterpret_cast<const float2*>(p.S0 + (bh * D + k) * D + i0 + col);
      S[j][2 * h] = v.x;
      S[j][2 * h + 1] = v.y;
      *reinterpret_cast<float2*>(Ss + k * PV + col) = v;
    }
  }
  // This thread's part of the state slice into the [D][D] matrix at Sm.
  auto store_state = [&](float* Sm) {
#pragma unroll
    for (int j = 0; j < ST; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int k = srow(j) + g + 8 * h;
        *reinterpret_cast<float2*>(Sm + k * D + i0 + col) =
            make_float2(S[j][2 * h], S[j][2 * h + 1]);
      }
    }
  };
  Ahead cur, next;
  if (N > 0) {
    stage(chunk_of(0), 0);
    fetch(chunk_of(0), cur);
  }
  for (int64_t step = 0; step < N; ++step) {
    const int64_t n = chunk_of(step), z = bh * N + n, zc = z * C;
    const int b = static_cast<int>(step & 1);
    // A restart: forward, this chunk starts from zero; backward (S the
    // gradient of the state after chunk n), the next chunk started from
    // zero, so nothing of it reaches chunk n. Each thread clears its own
    // part of the state and of its mirror Ss (read after the sync below).
    const int64_t flagged = p.reverse ? n + 1 : n;
    if (p.restarts != nullptr && flagged < N && p.restarts[(bh / s.H) * N + flagged]) {
#pragma unroll
      for (int j = 0; j < ST; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          S[j][2 * h] = S[j][2 * h + 1] = 0.f;
          *reinterpret_cast<float2*>(Ss + (srow(j) + g + 8 * h) * PV + col) =
              make_float2(0.f, 0.f);
        }
      }
    }
    cp_async_wait_all();
    __syncthreads();  // this chunk's M1, M2 and the state's mirror Ss visible to all
    if (step + 1 < N) {
      stage(chunk_of(step + 1), b ^ 1);  // the other buffer's readers finished last chunk
      fetch(chunk_of(step + 1), next);
    }
    // The state as this chunk starts.
    store_state(p.states + z * D * D);
    if (p.ddec_part) {
#pragma unroll
      for (int j = 0; j < ST; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // The four lanes of a row add their pairs; the butterfly gives
          // every lane the same bits (each add pairs the same operands).
          const int k = srow(j) + g + 8 * h;
          float v = fmaf(S[j][2 * h], cur.sf[j][h].x, S[j][2 * h + 1] * cur.sf[j][h].y);
          v += __shfl_xor_sync(0xffffffffu, v, 1);
          v += __shfl_xor_sync(0xffffffffu, v, 2);
          if (t == 0) p.ddec_part[(z * D + k) * (2 * D / V) + 2 * blockIdx.x + nt] = v;
        }
      }
    }
    // x = A + s1 M1 S: this warp's 16 x 8 tile, summed over D in steps of 8,
    // the two halves of D in accumulators of their own (two independent mma
    // chains half as long), added last.
    {
      const float* M1b = M1s + b * L::m1 + xrow * P1;
      float main[2][4] = {}, small[2][4] = {};
#pragma unroll 2
      for (int k = 0; k < D / 2; k += 8) {
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int k0 = k + u * D / 2;
          const float a[4] = {M1b[g * P1 + k0 + t], M1b[(g + 8) * P1 + k0 + t],
                              M1b[g * P1 + k0 + t + 4], M1b[(g + 8) * P1 + k0 + t + 4]};
          const float bb[2] = {Ss[(k0 + t) * PV + nt * 8 + g],
                               Ss[(k0 + t + 4) * PV + nt * 8 + g]};
          mma_split(main[u], small[u], a, bb);
        }
      }
      auto sum = [&](int e) { return (main[0][e] + main[1][e]) + (small[0][e] + small[1][e]); };
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = xrow + g + 8 * h;
        const float2 v = make_float2(cur.a[h].x + p.s1 * sum(2 * h),
                                     cur.a[h].y + p.s1 * sum(2 * h + 1));
        *reinterpret_cast<float2*>(xs + c * PV + col) = v;
        *reinterpret_cast<float2*>(p.x + (zc + c) * p.x_stride + i0 + col) = v;
      }
    }
    __syncthreads();  // x complete in xs; every read of Ss done
    // S = dec * S + s2 M2^T x + Y: this warp's state tiles, summed over C.
    {
      const float* M2b = M2s + b * L::m2;
      float main[ST][4], small[ST][4];
#pragma unroll
      for (int j = 0; j < ST; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) main[j][e] = small[j][e] = 0.f;
      }
#pragma unroll 2
      for (int c0 = 0; c0 < C; c0 += 8) {
        const float bb[2] = {xs[(c0 + t) * PV + nt * 8 + g], xs[(c0 + t + 4) * PV + nt * 8 + g]};
#pragma unroll
        for (int j = 0; j < ST; ++j) {
          const int r0 = srow(j);
          const float a[4] = {M2b[(c0 + t) * P2 + r0 + g], M2b[(c0 + t) * P2 + r0 + g + 8],
                              M2b[(c0 + t + 4) * P2 + r0 + g],
                              M2b[(c0 + t + 4) * P2 + r0 + g + 8]};
          mma_split(main[j], small[j], a, bb);
        }
      }
#pragma unroll
      for (int j = 0; j < ST; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int k = srow(j) + g + 8 * h;
          const float d = cur.dec[j][h];
          const float v0 = fmaf(d, S[j][2 * h], p.s2 * (main[j][2 * h] + small[j][2 * h])) +
                           cur.y[j][h].x;
          const float v1 =
              fmaf(d, S[j][2 * h + 1], p.s2 * (main[j][2 * h + 1] + small[j][2 * h + 1])) +
              cur.y[j][h].y;
          S[j][2 * h] = v0;
          S[j][2 * h + 1] = v1;
          *reinterpret_cast<float2*>(Ss + k * PV + col) = make_float2(v0, v1);
        }
      }
    }
    cur = next;
  }
  // Backward: a restart at chunk 0 leaves S0 unread, so dS0 is zero.
  if (p.reverse && p.restarts != nullptr && N > 0 && p.restarts[(bh / s.H) * N]) {
#pragma unroll
    for (int j = 0; j < ST; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) S[j][e] = 0.f;
    }
  }
  store_state(p.final_state + bh * D * D);
}

// ---- intra-chunk backward --------------------------------------------------
// One block per chunk and slice of 32 channels. The pair terms of Aqk and
// Kp, with P = e^{G_cd - G_jd}, a = dAqk[c, j] (j <= c), m = dKp[c, j] =
// -beta_c dM[c, j] (j < c), give three sums:
//   Xq_c = sum_{j <= c} a k_j P,  Xk_c = sum_{j < c} m k_j P   (row sums)
//   Yk_j = sum_{c >= j} (a q_c + m k_c) P                      (column sums)
// and dq_c += Xq_c, dk_c += Xk_c, dk_j += Yk_j, while the log-decay's
// gradient takes q_c Xq_c + k_c Xk_c at row c and -k_j Yk_j at row j. As
// in the forward, the sub-chunk blocks below the diagonal factor P through
// r, the first row of c's sub-chunk I: Xq, Xk of I's rows are e^{G_c - G_r}
// times (dAqk or dKp) (k_j e^{G_r - G_j}), and Yk of sub-chunk J's rows
// collects, for each I > J, e^{G_r - G_j} times (dAqk^T (q_c e^{G_c -
// G_r}) + dKp^T (k_c e^{G_c - G_r})): products over 16 rows on the tensor
// cores. The diagonal blocks add their terms in the direct form after. Then
// the terms of qe, ke, dec and R, and dg as the reverse cumulative sum of
// the log-decay's gradient. dbeta's sums over d are written per slice
// ([slices, Z, C]); the caller adds the slices.
constexpr int kSlice = 32;
constexpr int kBwdThreads = 512;
constexpr int kSliceP = kSlice + 8;  // [C][kSlice] rows: B fragments (rows t, columns g) on 8 t + g
constexpr int kPairP = C + 4;        // dAqk, dKp rows: A fragments (rows g, columns t) on 4 g + t

constexpr size_t intra_backward_smem() {
  return sizeof(float) * (6 * C * kSliceP + 2 * C * kPairP + C);
}

template <typename Tv>
__global__ void __launch_bounds__(kBwdThreads, 2)
    intra_backward_kernel(KdaShape s, const float* __restrict__ q, const float* __restrict__ k,
                          const Tv* __restrict__ v, const float* __restrict__ g,
                          const float* __restrict__ beta, const float* __restrict__ Kp,
                          const float* __restrict__ dAqk, const float* __restrict__ dM,
                          const float* __restrict__ dR, const float* __restrict__ dqe,
                          const float* __restrict__ dke, const float* __restrict__ ddec,
                          float* __restrict__ dq, float* __restrict__ dk,
                          Tv* __restrict__ dv, float* __restrict__ dg,
                          float* __restrict__ dbeta_part) {
  constexpr int L = kSlice, PL = kSliceP, PA = kPairP;
  extern __shared__ float smem[];
  float* Gs = smem;           // [C][PL]
  float* qs = Gs + C * PL;
  float* ks = qs + C * PL;
  float* Xq = ks + C * PL;    // row sums
  float* Xk = Xq + C * PL;    // row sums; then the row's whole log-decay gradient
  float* Yk = Xk + C * PL;    // column sums; then the ke term of the last row's sum
  float* dA = Yk + C * PL;    // [C][PA]
  float* dK = dA + C * PA;    // [C][PA]
  float* bs = dK + C * PA;    // [C]
  __shared__ int64_t rows[C];
  const int64_t N = s.chunks(), D = s.D;
  const int64_t z = blockIdx.x, bh = z / N, n = z % N, zc = z * C;
  const int d0 = blockIdx.y * L;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  chunk_rows(s, bh, n, rows);
  __syncthreads();

  for (int x = tid; x < C * L; x += kBwdThreads) {
    const int c = x / L, d = x % L;
    const int64_t r = rows[c] * D;
    Gs[c * PL + d] = r < 0 ? 0.f : g[r + d0 + d];
    qs[c * PL + d] = r < 0 ? 0.f : q[r + d0 + d];
    ks[c * PL + d] = r < 0 ? 0.f : k[r + d0 + d];
  }
  if (tid < C) bs[tid] = rows[tid] < 0 ? 0.f : beta[rows[tid]];
  __syncthreads();
  for (int x = tid; x < C * C; x += kBwdThreads) {
    const int c = x / C, j = x % C;
    dA[c * PA + j] = j <= c ? dAqk[zc * C + x] : 0.f;
    dK[c * PA + j] = j < c ? -bs[c] * dM[zc * C + x] : 0.f;
  }
  if (tid < L) {
    float acc = 0.f;
    for (int c = 0; c < C; ++c) {
      acc += Gs[c * PL + tid];
      Gs[c * PL + tid] = acc;
    }
  }
  __syncthreads();
  // Below the diagonal blocks, a 16 x 8 tile a task: tasks 0..11 the row
  // sums of sub-chunk I = 1 + task / 4, tasks 12..23 the column sums of
  // sub-chunk J = (task - 12) / 4, columns 8 (task % 4) .. + 7 of the slice.
  {
    const int fg = lane / 4, ft = lane % 4;
    for (int task = warp; task < 24; task += kBwdThreads / 32) {
      const int ch0 = 8 * (task % 4);
      if (task < 12) {
        const int I = 1 + task / 4, r = kSub * I;
        float qm[4] = {0.f, 0.f, 0.f, 0.f}, qsm[4] = {0.f, 0.f, 0.f, 0.f};
        float km[4] = {0.f, 0.f, 0.f, 0.f}, ksm[4] = {0.f, 0.f, 0.f, 0.f};
        for (int j0 = 0; j0 < r; j0 += 8) {
          float a[4], m[4], b[2];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int o = (r + fg + 8 * (e & 1)) * PA + j0 + ft + 4 * (e >> 1);
            a[e] = dA[o];
            m[e] = dK[o];
          }
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int o = (j0 + ft + 4 * e) * PL + ch0 + fg;
            b[e] = ks[o] * expf(Gs[r * PL + ch0 + fg] - Gs[o]);
          }
          mma_split(qm, qsm, a, b);
          mma_split(km, ksm, m, b);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int o = (r + fg + 8 * (e >> 1)) * PL + ch0 + 2 * ft + (e & 1);
          const float x = expf(Gs[o] - Gs[r * PL + ch0 + 2 * ft + (e & 1)]);
          Xq[o] = (qm[e] + qsm[e]) * x;
          Xk[o] = (km[e] + ksm[e]) * x;
        }
      } else {
        const int J = (task - 12) / 4, jr = kSub * J;
        float tot[4] = {0.f, 0.f, 0.f, 0.f};
        for (int I = J + 1; I < C / kSub; ++I) {
          const int r = kSub * I;
          float pm[4] = {0.f, 0.f, 0.f, 0.f}, psm[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int c0 = r; c0 < r + kSub; c0 += 8) {
            float a[4], m[4], bq[2], bk[2];
#pragma unroll
            for (int e = 0; e < 4; ++e) {  // the transposed blocks: row j, column c
              const int o = (c0 + ft + 4 * (e >> 1)) * PA + jr + fg + 8 * (e & 1);
              a[e] = dA[o];
              m[e] = dK[o];
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int o = (c0 + ft + 4 * e) * PL + ch0 + fg;
              const float x = expf(Gs[o] - Gs[r * PL + ch0 + fg]);
              bq[e] = qs[o] * x;
              bk[e] = ks[o] * x;
            }
            mma_split(pm, psm, a, bq);
            mma_split(pm, psm, m, bk);
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int ch = ch0 + 2 * ft + (e & 1), o = (jr + fg + 8 * (e >> 1)) * PL + ch;
            tot[e] = fmaf(pm[e] + psm[e], expf(Gs[r * PL + ch] - Gs[o]), tot[e]);
          }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          Yk[(jr + fg + 8 * (e >> 1)) * PL + ch0 + 2 * ft + (e & 1)] = tot[e];
        }
      }
    }
  }
  __syncthreads();
  // The diagonal blocks, lane = channel: warp w adds row w's terms (j <= c
  // in c's sub-chunk) to Xq, Xk and column w's terms (c >= j in j's
  // sub-chunk) to Yk. The first sub-chunk's rows and the last one's columns
  // have nothing from below the diagonal yet.
  const int d = lane;
  for (int c = warp; c < C; c += kBwdThreads / 32) {
    const int lo = c & ~(kSub - 1), hi = lo + kSub;
    {
      const float Gc = Gs[c * PL + d];
      float aq = 0.f, ak = 0.f;
      for (int j = lo; j <= c; ++j) {
        const float kj = ks[j * PL + d] * expf(Gc - Gs[j * PL + d]);
        aq = fmaf(dA[c * PA + j], kj, aq);
        ak = fmaf(dK[c * PA + j], kj, ak);
      }
      const bool below = c >= kSub;
      Xq[c * PL + d] = (below ? Xq[c * PL + d] : 0.f) + aq;
      Xk[c * PL + d] = (below ? Xk[c * PL + d] : 0.f) + ak;
    }
    {
      const int j = c;
      const float Gj = Gs[j * PL + d];
      float bk = 0.f;
      for (int cc = j; cc < hi; ++cc) {
        const float P = expf(Gs[cc * PL + d] - Gj);
        bk = fmaf(fmaf(dA[cc * PA + j], qs[cc * PL + d], dK[cc * PA + j] * ks[cc * PL + d]), P,
                  bk);
      }
      const bool above = j < C - kSub;
      Yk[j * PL + d] = (above ? Yk[j * PL + d] : 0.f) + bk;
    }
  }
  __syncthreads();
  // The row-local terms. Xk becomes the row's whole log-decay gradient but
  // for the last row's sum over the chunk; Yk then holds dke k e^{G_L - G},
  // which the reverse cumulative sum below adds into the last row.
  for (int x = tid; x < C * L; x += kBwdThreads) {
    const int c = x / L, dd = x % L, o = c * PL + dd;
    const float G = Gs[o], GL = Gs[(C - 1) * PL + dd];
    const float eG = expf(G), eL = expf(GL - G);
    const int64_t oz = (zc + c) * D + d0 + dd;
    const float gqe = dqe[oz], gke = dke[oz];
    const float gRk = dR[(zc + c) * 2 * D + d0 + dd];
    const float qq = qs[o], kk = ks[o], b = bs[c];
    const float xq = Xq[o], xk = Xk[o], yk = Yk[o];
    const float kdec = gke * kk * eL;
    Xk[o] = fmaf(qq, xq, kk * xk) - kk * yk + gqe * qq * eG - kdec + b * eG * kk * gRk;
    Yk[o] = kdec;
    const int64_t r = rows[c] * D;
    if (r >= 0) {
      dq[r + d0 + dd] = xq + gqe * eG;
      dk[r + d0 + dd] = xk + yk + gke * eL + b * eG * gRk;
      store(dv, r + d0 + dd, b * dR[(zc + c) * 2 * D + D + d0 + dd]);
    }
  }
  __syncthreads();
  // dg_c = ddec e^{G_L} + sum_c' kdec_c' + sum_{c' >= c} (Xk)_c', in
  // segments of four rows: warp w sums its rows 4 w .. 4 w + 3 (into the
  // free dA, dK), then runs its rows from the later segments' sum.
  static_assert(C == 4 * (kBwdThreads / 32), "a segment of four rows a warp");
  {
    const int c0 = 4 * warp;
    float sx = 0.f, sy = 0.f;
    for (int c = c0; c < c0 + 4; ++c) {
      sx += Xk[c * PL + d];
      sy += Yk[c * PL + d];
    }
    dA[warp * PA + d] = sx;
    dK[warp * PA + d] = sy;
    __syncthreads();
    float acc = ddec[z * D + d0 + d] * expf(Gs[(C - 1) * PL + d]);
    for (int w = 0; w < C / 4; ++w) acc += dK[w * PA + d];
    for (int w = C / 4 - 1; w > warp; --w) acc += dA[w * PA + d];
    for (int c = c0 + 3; c >= c0; --c) {
      acc += Xk[c * PL + d];
      if (rows[c] >= 0) dg[rows[c] * D + d0 + d] = acc;
    }
  }
  // dbeta over this slice's channels, one warp a row: the R terms, and
  // (slice 0 only) -sum_j dM[c, j] Kp[c, j].
  for (int c = warp; c < C; c += kBwdThreads / 32) {
    const float G = Gs[c * PL + lane];
    float acc = dR[(zc + c) * 2 * D + d0 + lane] * expf(G) * ks[c * PL + lane];
    const int64_t r = rows[c] * D;
    acc = fmaf(dR[(zc + c) * 2 * D + D + d0 + lane], r < 0 ? 0.f : load(v, r + d0 + lane), acc);
    if (blockIdx.y == 0) {
      for (int j = lane; j < c; j += 32) acc -= dM[(zc + c) * C + j] * Kp[(zc + c) * C + j];
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) dbeta_part[(blockIdx.y * s.Z() + z) * C + c] = acc;
  }
}

}  // namespace

bool kda_supported(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

#define VIADUCT_KDA_DISPATCH(D_, ...)                          \
  switch (D_) {                                               \
    case 64: { constexpr int D = 64; __VA_ARGS__; break; }    \
    case 128: { constexpr int D = 128; __VA_ARGS__; break; }  \
    default: return cudaErrorInvalidValue;                    \
  }

namespace {
template <int D, typename Tv>
cudaError_t launch_intra_forward(const KdaShape& s, const float* q, const float* k, const Tv* v,
                                 const float* g, const float* beta, float* Aqk, float* Kp,
                                 float* Tm, float* R, float* qe, float* ke, float* dec,
                                 cudaStream_t stream) {
  constexpr size_t smem = intra_forward_smem<D>();
  if (auto e = allow_smem(intra_forward_kernel<D, Tv>, smem); e != cudaSuccess) return e;
  intra_forward_kernel<D, Tv><<<static_cast<unsigned>(s.Z()), kFwdThreads, smem, stream>>>(
      s, q, k, v, g, beta, Aqk, Kp, Tm, R, qe, ke, dec);
  return cudaGetLastError();
}
}  // namespace

cudaError_t kda_intra_forward(const KdaShape& s, const float* q, const float* k, const void* v,
                              DType v_type, const float* g, const float* beta, float* Aqk,
                              float* Kp, float* Tm, float* R, float* qe, float* ke, float* dec,
                              cudaStream_t stream) {
  if (s.Z() == 0) return cudaSuccess;
  const bool bf16 = v_type == DType::kBFloat16;
  VIADUCT_KDA_DISPATCH(s.D, {
    return bf16 ? launch_intra_forward<D>(s, q, k, static_cast<const __nv_bfloat16*>(v), g, beta,
                                          Aqk, Kp, Tm, R, qe, ke, dec, stream)
                : launch_intra_forward<D>(s, q, k, static_cast<const float*>(v), g, beta, Aqk,
                                          Kp, Tm, R, qe, ke, dec, stream);
  });
  return cudaSuccess;
}

namespace {
cudaError_t launch_scan(const KdaShape& s, const ScanArgs& p, cudaStream_t stream) {
  if (s.Z() == 0) return cudaSuccess;
  VIADUCT_KDA_DISPATCH(s.D, {
    constexpr size_t smem = scan_smem<D>();
    if (auto e = allow_smem(scan_kernel<D>, smem); e != cudaSuccess) return e;
    const dim3 grid(D / V, static_cast<unsigned>(s.B * s.H));
    scan_kernel<D><<<grid, kScanThreads, smem, stream>>>(s, p);
  });
  return cudaGetLastError();
}
}  // namespace

cudaError_t kda_scan_forward(const KdaShape& s, const float* WU, const float* ke,
                             const float* dec, const float* S0, const uint8_t* restarts,
                             float* vnew, float* states, float* final_state,
                             cudaStream_t stream) {
  const int64_t D = s.D;
  return launch_scan(s,
                     {WU + D, 2 * D, WU, 2 * D, ke, D, dec, nullptr, S0, restarts, -1.f, 1.f,
                      false, vnew, D, states, final_state, nullptr, nullptr},
                     stream);
}

cudaError_t kda_scan_backward(const KdaShape& s, const float* WU, const float* ke,
                              const float* dec, const float* X, const float* Y, const float* dSN,
                              const uint8_t* restarts, const float* states, float* dvnew,
                              int64_t dvnew_stride, float* dstates, float* dS0, float* ddec_part,
                              cudaStream_t stream) {
  const int64_t D = s.D;
  return launch_scan(s,
                     {X, D, ke, D, WU, 2 * D, dec, Y, dSN, restarts, 1.f, -1.f, true, dvnew,
                      dvnew_stride, dstates, dS0, states, ddec_part},
                     stream);
}

cudaError_t kda_gemm(const KdaGemm& g, cudaStream_t stream) {
  if (g.batch == 0) return cudaSuccess;
  const bool at = g.A.row == 1, bt = g.B.row == 1;
  if (g.M % kGemmM || g.N % kGemmN || g.K % kGemmK || g.c_row % 2 || (!at && g.A.col != 1) ||
      (!bt && g.B.col != 1) || (g.beta != 0.f && g.beta != 1.f) ||
      (g.to_tokens && (g.M != kGemmM || g.batch != g.tokens.Z()))) {
    return cudaErrorInvalidValue;
  }
  // The batch runs on the grid's z, which holds at most 65535: a longer
  // batch (B H chunks past it: long sequences, packed documents) goes in
  // slices, each its own launch with the operands moved to its first matrix.
  constexpr int64_t kMaxZ = 65535;
  for (int64_t z0 = 0; z0 < g.batch; z0 += kMaxZ) {
    KdaGemm p = g;
    p.batch = g.batch - z0 < kMaxZ ? g.batch - z0 : kMaxZ;
    p.A.data += z0 * g.A.batch;
    p.B.data += z0 * g.B.batch;
    if (!g.to_tokens) p.C += z0 * g.c_batch;
    p.z_first = z0;
    const dim3 grid(static_cast<unsigned>(p.N / kGemmN), static_cast<unsigned>(p.M / kGemmM),
                    static_cast<unsigned>(p.batch));
    if (at && bt) gemm_kernel<true, true><<<grid, kGemmThreads, 0, stream>>>(p);
    if (at && !bt) gemm_kernel<true, false><<<grid, kGemmThreads, 0, stream>>>(p);
    if (!at && bt) gemm_kernel<false, true><<<grid, kGemmThreads, 0, stream>>>(p);
    if (!at && !bt) gemm_kernel<false, false><<<grid, kGemmThreads, 0, stream>>>(p);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

namespace {
// One thread per 4 values of out: each row is width / 4 float4 loads of one
// x row (256 bytes at width 64), a warp over consecutive ones. Each pass
// makes one load, so the test of the row index holds no other load back.
__global__ void gather_rows_kernel(const float4* __restrict__ x, const int64_t* __restrict__ read,
                                   int64_t rows, int64_t w4, float4* __restrict__ out) {
  const int64_t total = rows * w4;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = e / w4, src = read[r];
    out[e] = src < 0 ? make_float4(0.f, 0.f, 0.f, 0.f) : x[src * w4 + e % w4];
  }
}
}  // namespace

cudaError_t kda_gather_rows(const float* x, const int64_t* read, int64_t rows, int64_t width,
                            float* out, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (width % 4 || !aligned16(x) || !aligned16(out)) return cudaErrorInvalidValue;
  const int64_t w4 = width / 4;
  gather_rows_kernel<<<elementwise_blocks(rows * w4), kElemThreads, 0, stream>>>(
      reinterpret_cast<const float4*>(x), read, rows, w4, reinterpret_cast<float4*>(out));
  return cudaGetLastError();
}

int64_t kda_beta_slices(int64_t head_dim) { return head_dim / kSlice; }

int64_t kda_ddec_parts(int64_t head_dim) { return 2 * head_dim / V; }

namespace {
template <typename Tv>
cudaError_t launch_intra_backward(const KdaShape& s, const float* q, const float* k, const Tv* v,
                                  const float* g, const float* beta, const float* Kp,
                                  const float* dAqk, const float* dM, const float* dR,
                                  const float* dqe, const float* dke, const float* ddec,
                                  float* dq, float* dk, Tv* dv, float* dg, float* dbeta_part,
                                  cudaStream_t stream) {
  constexpr size_t smem = intra_backward_smem();
  if (auto e = allow_smem(intra_backward_kernel<Tv>, smem); e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(s.Z()), static_cast<unsigned>(s.D / kSlice));
  intra_backward_kernel<Tv><<<grid, kBwdThreads, smem, stream>>>(
      s, q, k, v, g, beta, Kp, dAqk, dM, dR, dqe, dke, ddec, dq, dk, dv, dg, dbeta_part);
  return cudaGetLastError();
}
}  // namespace

cudaError_t kda_intra_backward(const KdaShape& s, const float* q, const float* k, const void* v,
                               DType v_type, const float* g, const float* beta, const float* Kp,
                               const float* dAqk, const float* dM, const float* dR,
                               const float* dqe, const float* dke, const float* ddec, float* dq,
                               float* dk, void* dv, float* dg, float* dbeta_part,
                               cudaStream_t stream) {
  if (s.Z() == 0) return cudaSuccess;
  if (!kda_supported(s.D)) return cudaErrorInvalidValue;
  if (v_type == DType::kBFloat16) {
    return launch_intra_backward(s, q, k, static_cast<const __nv_bfloat16*>(v), g, beta, Kp, dAqk,
                                 dM, dR, dqe, dke, ddec, dq, dk, static_cast<__nv_bfloat16*>(dv),
                                 dg, dbeta_part, stream);
  }
  return launch_intra_backward(s, q, k, static_cast<const float*>(v), g, beta, Kp, dAqk, dM, dR,
                               dqe, dke, ddec, dq, dk, static_cast<float*>(dv), dg, dbeta_part,
                               stream);
}

}  // namespace viaduct::cuda
