// KDA chunked gated delta rule: the intra-chunk transform, the serial scan
// over chunks and the backward of each (see kernels/kda.h for the terms).
// The products that are plain batched GEMMs over the chunks (Tm R, and the
// backward's S, dS and v' products) are left to the caller's cuBLAS calls;
// what is here is the work no GEMM does: the pairwise products with a
// per-channel decay inside each exponent, the triangular inverse, and the
// sequential state passes.
#include "kernels/kda.h"

#include <cuda_runtime.h>

#include <cmath>

namespace viaduct::cuda {
namespace {

constexpr int C = static_cast<int>(kKdaChunk);
constexpr int kFwdThreads = 512;  // the intra-chunk forward's block

// Row r of chunk n of head (b, h) in a [B, T, H, width] tensor, or -1 past T.
__device__ __forceinline__ int64_t row_of(const KdaShape& s, int64_t bh, int64_t n, int c,
                                          int64_t width) {
  const int64_t t = n * C + c;
  if (t >= s.T) return -1;
  const int64_t b = bh / s.H, h = bh % s.H;
  return ((b * s.T + t) * s.H + h) * width;
}

// ---- intra-chunk forward ---------------------------------------------------
// One block per chunk. Shared: G, q, k as [C][D + 1] (rows padded so that a
// warp reading 32 different rows of one column hits 32 banks), Aqk, Kp, Tm
// as [C][C + 1], beta [C].
template <int D>
constexpr size_t intra_forward_smem() {
  return sizeof(float) * (3 * C * (D + 1) + 3 * C * (C + 1) + C);
}

template <int D>
__global__ void __launch_bounds__(kFwdThreads)
    intra_forward_kernel(KdaShape s, const float* __restrict__ q, const float* __restrict__ k,
                         const float* __restrict__ v, const float* __restrict__ g,
                         const float* __restrict__ beta, float* __restrict__ Aqk,
                         float* __restrict__ Kp, float* __restrict__ Tm, float* __restrict__ R,
                         float* __restrict__ qe, float* __restrict__ ke,
                         float* __restrict__ dec) {
  constexpr int P = D + 1, Q = C + 1;
  extern __shared__ float smem[];
  float* Gs = smem;
  float* qs = Gs + C * P;
  float* ks = qs + C * P;
  float* As = ks + C * P;
  float* Ks = As + C * Q;
  float* Ts = Ks + C * Q;
  float* bs = Ts + C * Q;
  const int64_t N = s.chunks();
  const int64_t z = blockIdx.x, bh = z / N, n = z % N;
  const int tid = threadIdx.x;

  for (int i = tid; i < C * D; i += kFwdThreads) {
    const int c = i / D, d = i % D;
    const int64_t r = row_of(s, bh, n, c, D);
    Gs[c * P + d] = r < 0 ? 0.f : g[r + d];
    qs[c * P + d] = r < 0 ? 0.f : q[r + d];
    ks[c * P + d] = r < 0 ? 0.f : k[r + d];
  }
  for (int i = tid; i < C * Q; i += kFwdThreads) As[i] = Ks[i] = 0.f;
  if (tid < C) {
    const int64_t r = row_of(s, bh, n, tid, 1);
    bs[tid] = r < 0 ? 0.f : beta[r];
  }
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
  // Pairwise products: warp item w is row c with columns 32 jt .. 32 jt + 31
  // (lane = column); the items with any column <= c are rows 0..63 with jt
  // = 0 and rows 32..63 with jt = 1. Each entry sums over d in order.
  const int warp = tid / 32, lane = tid % 32;
  for (int w = warp; w < C + C / 2; w += kFwdThreads / 32) {
    const int c = w < C ? w : w - C / 2;
    const int j = (w < C ? 0 : 32) + lane;
    if (j > c) continue;
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
  // Tm = (I + diag(beta) Kp)^-1 by forward substitution, four lanes a
  // column: x_c = [c == i] - beta_c sum_{j < c} Kp[c, j] x_j, lane part p
  // of column i summing j = i + p, i + p + 4, ..., the four parts then
  // added in order (threads 0 .. 4 C - 1: whole warps).
  if (tid < 4 * C) {
    const int i = tid / 4, part = tid % 4, base = lane & ~3;
    for (int c = 0; c < C; ++c) {
      float acc = 0.f;
      for (int j = i + part; j < c; j += 4) acc = fmaf(Ks[c * Q + j], Ts[j * Q + i], acc);
      const float p0 = __shfl_sync(0xffffffffu, acc, base);
      const float p1 = __shfl_sync(0xffffffffu, acc, base + 1);
      const float p2 = __shfl_sync(0xffffffffu, acc, base + 2);
      const float p3 = __shfl_sync(0xffffffffu, acc, base + 3);
      const float x = c == i ? 1.f : c > i ? -bs[c] * (((p0 + p1) + p2) + p3) : 0.f;
      if (part == 0) Ts[c * Q + i] = x;
      __syncwarp();
    }
  }
  __syncthreads();
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
    const int64_t r = row_of(s, bh, n, c, D);
    const float vv = r < 0 ? 0.f : v[r + d];
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
// two products of a chunk run on the tensor cores (mma m16n8k8 with tf32
// operands and fp32 accumulators) as three products each, split-tf32: an
// fp32 operand a is hi + lo with hi = tf32(a) and lo = tf32(a - hi), and
// a b is formed as lo_a hi_b + hi_a lo_b + hi_a hi_b (the small terms in an
// accumulator of their own, added last), which keeps about fp32's accuracy
// (the dropped lo lo term is ~2^-22 of the product) where one tf32 product
// would lose 2^-11. The state slice stays in fp32 registers in the mma's
// accumulator layout and is mirrored to shared memory as the next chunk's
// operand. M1 and M2 of the next chunk are copied into shared memory
// (cp.async, two buffers) while the current chunk computes; A, Y and dec of
// the next chunk are loaded into registers a chunk ahead. The mma's sums
// run in a fixed order, so the pass is bitwise run to run.
//
// mma m16n8k8 fragments (g = lane / 4, t = lane % 4): A (16 x 8, row
// major) a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4);
// B (8 x 8) b0 (t, g), b1 (t + 4, g); C (16 x 8) c0 (g, 2t), c1 (g, 2t + 1),
// c2 (g + 8, 2t), c3 (g + 8, 2t + 1). Shared rows are padded so that each
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

__device__ __forceinline__ void cp_async16(float* dst, const float* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

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
  Ahead cur, next;
  if (N > 0) {
    stage(chunk_of(0), 0);
    fetch(chunk_of(0), cur);
  }
  for (int64_t step = 0; step < N; ++step) {
    const int64_t n = chunk_of(step), z = bh * N + n, zc = z * C;
    const int b = static_cast<int>(step & 1);
    cp_async_wait_all();
    __syncthreads();  // this chunk's M1, M2 and the state's mirror Ss visible to all
    if (step + 1 < N) {
      stage(chunk_of(step + 1), b ^ 1);  // the other buffer's readers finished last chunk
      fetch(chunk_of(step + 1), next);
    }
    // The state as this chunk starts.
#pragma unroll
    for (int j = 0; j < ST; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int k = srow(j) + g + 8 * h;
        *reinterpret_cast<float2*>(p.states + (z * D + k) * D + i0 + col) =
            make_float2(S[j][2 * h], S[j][2 * h + 1]);
        if (p.ddec_part) {
          // The four lanes of a row add their pairs; the butterfly gives
          // every lane the same bits (each add pairs the same operands).
          float v = fmaf(S[j][2 * h], cur.sf[j][h].x, S[j][2 * h + 1] * cur.sf[j][h].y);
          v += __shfl_xor_sync(0xffffffffu, v, 1);
          v += __shfl_xor_sync(0xffffffffu, v, 2);
          if (t == 0) p.ddec_part[(z * D + k) * (2 * D / V) + 2 * blockIdx.x + nt] = v;
        }
      }
    }
    // x = A + s1 M1 S: this warp's 16 x 8 tile, summed over D in steps of 8.
    {
      const float* M1b = M1s + b * L::m1 + xrow * P1;
      float main[4] = {0.f, 0.f, 0.f, 0.f}, small[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
      for (int k0 = 0; k0 < D; k0 += 8) {
        const float a[4] = {M1b[g * P1 + k0 + t], M1b[(g + 8) * P1 + k0 + t],
                            M1b[g * P1 + k0 + t + 4], M1b[(g + 8) * P1 + k0 + t + 4]};
        const float bb[2] = {Ss[(k0 + t) * PV + nt * 8 + g], Ss[(k0 + t + 4) * PV + nt * 8 + g]};
        mma_split(main, small, a, bb);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = xrow + g + 8 * h;
        const float2 v = make_float2(cur.a[h].x + p.s1 * (main[2 * h] + small[2 * h]),
                                     cur.a[h].y + p.s1 * (main[2 * h + 1] + small[2 * h + 1]));
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
#pragma unroll
  for (int j = 0; j < ST; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = srow(j) + g + 8 * h;
      *reinterpret_cast<float2*>(p.final_state + (bh * D + k) * D + i0 + col) =
          make_float2(S[j][2 * h], S[j][2 * h + 1]);
    }
  }
}

// ---- intra-chunk backward --------------------------------------------------
// One block per chunk and slice of 32 channels (lane = channel). The pair
// terms of Aqk and Kp, with P = e^{G_cd - G_jd}, a = dAqk[c, j] (j <= c), m
// = dKp[c, j] = -beta_c dM[c, j] (j < c):
//   row c  (the first half of the warps, rows c = w mod 8): dq_c += a k_j P,
//          dk_c += m k_j P,
//          dG_c += (a q_c + m k_c) k_j P            summed over j <= c
//   row j  (the second half): dk_j += (a q_c + m k_c) P,
//          dG_j -= (a q_c + m k_c) k_j P
//          summed over c >= j
// then the terms of qe, ke, dec and R, and dg as the reverse cumulative
// sum of dG. dbeta's sums over d are written per slice ([slices, Z, C]);
// the caller adds the slices.
constexpr int kSlice = 32;
constexpr int kBwdThreads = 512;

constexpr size_t intra_backward_smem() {
  return sizeof(float) * (3 * C * kSlice + 2 * C * C + 5 * C * kSlice + C);
}

__global__ void __launch_bounds__(kBwdThreads, 2)
    intra_backward_kernel(KdaShape s, const float* __restrict__ q, const float* __restrict__ k,
                          const float* __restrict__ v, const float* __restrict__ g,
                          const float* __restrict__ beta, const float* __restrict__ Kp,
                          const float* __restrict__ dAqk, const float* __restrict__ dM,
                          const float* __restrict__ dR, const float* __restrict__ dqe,
                          const float* __restrict__ dke, const float* __restrict__ ddec,
                          float* __restrict__ dq, float* __restrict__ dk,
                          float* __restrict__ dv, float* __restrict__ dg,
                          float* __restrict__ dbeta_part) {
  constexpr int L = kSlice;
  extern __shared__ float smem[];
  float* Gs = smem;           // [C][L]
  float* qs = Gs + C * L;
  float* ks = qs + C * L;
  float* dA = ks + C * L;     // [C][C]
  float* dK = dA + C * C;     // [C][C]
  float* Xq = dK + C * C;     // row-c sums: dq, dk, dG
  float* Xk = Xq + C * L;
  float* XG = Xk + C * L;
  float* Yk = XG + C * L;     // row-j sums: dk, dG
  float* YG = Yk + C * L;
  float* bs = YG + C * L;     // [C]
  const int64_t N = s.chunks(), D = s.D;
  const int64_t z = blockIdx.x, bh = z / N, n = z % N, zc = z * C;
  const int d0 = blockIdx.y * L;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  for (int x = tid; x < C * L; x += kBwdThreads) {
    const int c = x / L, d = x % L;
    const int64_t r = row_of(s, bh, n, c, D);
    Gs[x] = r < 0 ? 0.f : g[r + d0 + d];
    qs[x] = r < 0 ? 0.f : q[r + d0 + d];
    ks[x] = r < 0 ? 0.f : k[r + d0 + d];
  }
  if (tid < C) {
    const int64_t r = row_of(s, bh, n, tid, 1);
    bs[tid] = r < 0 ? 0.f : beta[r];
  }
  __syncthreads();
  for (int x = tid; x < C * C; x += kBwdThreads) {
    const int c = x / C, j = x % C;
    dA[x] = j <= c ? dAqk[zc * C + x] : 0.f;
    dK[x] = j < c ? -bs[c] * dM[zc * C + x] : 0.f;
  }
  if (tid < L) {
    float acc = 0.f;
    for (int c = 0; c < C; ++c) {
      acc += Gs[c * L + tid];
      Gs[c * L + tid] = acc;
    }
  }
  __syncthreads();
  const int d = lane;
  constexpr int kHalf = kBwdThreads / 64;  // warps per role
  if (warp < kHalf) {
    for (int c = warp; c < C; c += kHalf) {
      const float Gc = Gs[c * L + d], qc = qs[c * L + d], kc = ks[c * L + d];
      float aq = 0.f, ak = 0.f, aG = 0.f;
#pragma unroll 4
      for (int j = 0; j <= c; ++j) {
        const float kj = ks[j * L + d] * expf(Gc - Gs[j * L + d]);
        const float a = dA[c * C + j], m = dK[c * C + j];
        aq = fmaf(a, kj, aq);
        ak = fmaf(m, kj, ak);
        aG = fmaf(fmaf(a, qc, m * kc), kj, aG);
      }
      Xq[c * L + d] = aq;
      Xk[c * L + d] = ak;
      XG[c * L + d] = aG;
    }
  } else {
    for (int j = warp - kHalf; j < C; j += kHalf) {
      const float Gj = Gs[j * L + d], kj = ks[j * L + d];
      float bk = 0.f, bG = 0.f;
#pragma unroll 4
      for (int c = j; c < C; ++c) {
        const float P = expf(Gs[c * L + d] - Gj);
        const float t = fmaf(dA[c * C + j], qs[c * L + d], dK[c * C + j] * ks[c * L + d]) * P;
        bk += t;
        bG = fmaf(t, kj, bG);
      }
      Yk[j * L + d] = bk;
      YG[j * L + d] = bG;
    }
  }
  __syncthreads();
  // The row-local terms. XG becomes the row's whole dG but for the last
  // row's sum over the chunk; YG then holds dke k e^{G_L - G}, which the
  // reverse cumulative sum below adds into the last row.
  for (int x = tid; x < C * L; x += kBwdThreads) {
    const int c = x / L, dd = x % L;
    const float G = Gs[x], GL = Gs[(C - 1) * L + dd];
    const float eG = expf(G), eL = expf(GL - G);
    const int64_t o = (zc + c) * D + d0 + dd;
    const float gqe = dqe[o], gke = dke[o];
    const float gRk = dR[(zc + c) * 2 * D + d0 + dd];
    const float kk = ks[x], b = bs[c];
    const float kdec = gke * kk * eL;
    XG[x] = XG[x] - YG[x] + gqe * qs[x] * eG - kdec + b * eG * kk * gRk;
    YG[x] = kdec;
    const int64_t r = row_of(s, bh, n, c, D);
    if (r >= 0) {
      dq[r + d0 + dd] = Xq[x] + gqe * eG;
      dk[r + d0 + dd] = Xk[x] + Yk[x] + gke * eL + b * eG * gRk;
      dv[r + d0 + dd] = b * dR[(zc + c) * 2 * D + D + d0 + dd];
    }
  }
  __syncthreads();
  if (warp == 0) {
    float acc = ddec[z * D + d0 + d] * expf(Gs[(C - 1) * L + d]);
    for (int c = 0; c < C; ++c) acc += YG[c * L + d];
    for (int c = C - 1; c >= 0; --c) {
      acc += XG[c * L + d];
      const int64_t r = row_of(s, bh, n, c, D);
      if (r >= 0) dg[r + d0 + d] = acc;
    }
  }
  // dbeta over this slice's channels, one warp a row: the R terms, and
  // (slice 0 only) -sum_j dM[c, j] Kp[c, j].
  for (int c = warp; c < C; c += kBwdThreads / 32) {
    const float G = Gs[c * L + lane];
    float acc = dR[(zc + c) * 2 * D + d0 + lane] * expf(G) * ks[c * L + lane];
    const int64_t r = row_of(s, bh, n, c, D);
    acc = fmaf(dR[(zc + c) * 2 * D + D + d0 + lane], r < 0 ? 0.f : v[r + d0 + lane], acc);
    if (blockIdx.y == 0) {
      for (int j = lane; j < c; j += 32) acc -= dM[(zc + c) * C + j] * Kp[(zc + c) * C + j];
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) dbeta_part[(blockIdx.y * s.Z() + z) * C + c] = acc;
  }
}

template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

}  // namespace

bool kda_supported(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

#define VIADUCT_KDA_DISPATCH(D_, ...)                          \
  switch (D_) {                                               \
    case 64: { constexpr int D = 64; __VA_ARGS__; break; }    \
    case 128: { constexpr int D = 128; __VA_ARGS__; break; }  \
    default: return cudaErrorInvalidValue;                    \
  }

cudaError_t kda_intra_forward(const KdaShape& s, const float* q, const float* k, const float* v,
                              const float* g, const float* beta, float* Aqk, float* Kp,
                              float* Tm, float* R, float* qe, float* ke, float* dec,
                              cudaStream_t stream) {
  if (s.Z() == 0) return cudaSuccess;
  VIADUCT_KDA_DISPATCH(s.D, {
    constexpr size_t smem = intra_forward_smem<D>();
    if (auto e = allow_smem(intra_forward_kernel<D>, smem); e != cudaSuccess) return e;
    intra_forward_kernel<D><<<static_cast<unsigned>(s.Z()), kFwdThreads, smem, stream>>>(
        s, q, k, v, g, beta, Aqk, Kp, Tm, R, qe, ke, dec);
  });
  return cudaGetLastError();
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
                             const float* dec, const float* S0, float* vnew, float* states,
                             float* final_state, cudaStream_t stream) {
  const int64_t D = s.D;
  return launch_scan(s,
                     {WU + D, 2 * D, WU, 2 * D, ke, D, dec, nullptr, S0, -1.f, 1.f, false, vnew, D,
                      states, final_state, nullptr, nullptr},
                     stream);
}

cudaError_t kda_scan_backward(const KdaShape& s, const float* WU, const float* ke,
                              const float* dec, const float* X, const float* Y, const float* dSN,
                              const float* states, float* dvnew, int64_t dvnew_stride,
                              float* dstates, float* dS0, float* ddec_part, cudaStream_t stream) {
  const int64_t D = s.D;
  return launch_scan(s,
                     {X, D, ke, D, WU, 2 * D, dec, Y, dSN, 1.f, -1.f, true, dvnew, dvnew_stride,
                      dstates, dS0, states, ddec_part},
                     stream);
}

int64_t kda_beta_slices(int64_t head_dim) { return head_dim / kSlice; }

int64_t kda_ddec_parts(int64_t head_dim) { return 2 * head_dim / V; }

cudaError_t kda_intra_backward(const KdaShape& s, const float* q, const float* k, const float* v,
                               const float* g, const float* beta, const float* Kp,
                               const float* dAqk, const float* dM, const float* dR,
                               const float* dqe, const float* dke, const float* ddec, float* dq,
                               float* dk, float* dv, float* dg, float* dbeta_part,
                               cudaStream_t stream) {
  if (s.Z() == 0) return cudaSuccess;
  if (!kda_supported(s.D)) return cudaErrorInvalidValue;
  constexpr size_t smem = intra_backward_smem();
  if (auto e = allow_smem(intra_backward_kernel, smem); e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(s.Z()), static_cast<unsigned>(s.D / kSlice));
  intra_backward_kernel<<<grid, kBwdThreads, smem, stream>>>(s, q, k, v, g, beta, Kp, dAqk, dM, dR,
                                                          dqe, dke, ddec, dq, dk, dv, dg,
                                                          dbeta_part);
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
