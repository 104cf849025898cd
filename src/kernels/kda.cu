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
// the chunks on the saved states, left to the caller. One block per head
// and slice of V value columns: S's slice stays in shared memory, as S^T
// [V][D + 4]; M1 is staged as [C][D + 4] and M2 transposed as [D][C + 4],
// so every inner product reads float4 runs along its summed index. Thread
// t owns column i = t % V, rows c = t / V + 64 m of x and rows
// k = t / V + 64 m of S.
constexpr int V = 8;
constexpr int kScanThreads = 512;
constexpr int kGroups = kScanThreads / V;  // 64

template <int D>
constexpr size_t scan_smem() {
  return sizeof(float) * (V * (D + 4) + C * (D + 4) + D * (C + 4) + V * (C + 4) + D);
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
  float* x;                            // [Z][C][D]
  float* states;                       // [Z][D][D]: S as the chunk starts
  float* final_state;                  // [B H][D][D]
};

__device__ __forceinline__ float dot4(const float4 a, const float4 b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

template <int D>
__global__ void __launch_bounds__(kScanThreads, 2) scan_kernel(KdaShape s, ScanArgs p) {
  constexpr int PD = D + 4, PC = C + 4, KM = D / kGroups, XM = C / kGroups;
  extern __shared__ float smem[];
  float* St = smem;             // [V][PD]  S^T
  float* M1s = St + V * PD;     // [C][PD]
  float* M2t = M1s + C * PD;    // [D][PC]
  float* xt = M2t + D * PC;     // [V][PC]  x^T
  float* ds = xt + V * PC;      // [D]
  const int64_t N = s.chunks();
  const int64_t bh = blockIdx.y;
  const int i0 = blockIdx.x * V;
  const int tid = threadIdx.x, i = tid % V, r = tid / V;

  float Sreg[KM];  // this thread's S[k][i], k = r + kGroups m
#pragma unroll
  for (int m = 0; m < KM; ++m) {
    const int k = r + kGroups * m;
    Sreg[m] = p.S0 ? p.S0[(bh * D + k) * D + i0 + i] : 0.f;
    St[i * PD + k] = Sreg[m];
  }
  for (int64_t step = 0; step < N; ++step) {
    const int64_t n = p.reverse ? N - 1 - step : step;
    const int64_t z = bh * N + n, zc = z * C;
    __syncthreads();  // St written; the previous chunk's reads of M1s, M2t, xt done
    {
      constexpr int D4 = D / 4;
      for (int e = tid; e < C * D4; e += kScanThreads) {
        const int c = e / D4, k = (e % D4) * 4;
        *reinterpret_cast<float4*>(M1s + c * PD + k) =
            *reinterpret_cast<const float4*>(p.M1 + (zc + c) * p.m1_stride + k);
      }
      for (int e = tid; e < C * D4; e += kScanThreads) {
        const int c = e % C, k = (e / C) * 4;
        const float4 v = *reinterpret_cast<const float4*>(p.M2 + (zc + c) * p.m2_stride + k);
        M2t[(k + 0) * PC + c] = v.x;
        M2t[(k + 1) * PC + c] = v.y;
        M2t[(k + 2) * PC + c] = v.z;
        M2t[(k + 3) * PC + c] = v.w;
      }
      if (tid < D) ds[tid] = p.dec[z * D + tid];
    }
#pragma unroll
    for (int m = 0; m < KM; ++m) {
      p.states[(z * D + r + kGroups * m) * D + i0 + i] = Sreg[m];
    }
    __syncthreads();
    // x = A + s1 M1 S, rows r + kGroups h
#pragma unroll
    for (int h = 0; h < XM; ++h) {
      const int c = r + kGroups * h;
      float acc = 0.f;
#pragma unroll 8
      for (int k = 0; k < D; k += 4) {
        acc = dot4(*reinterpret_cast<const float4*>(M1s + c * PD + k),
                   *reinterpret_cast<const float4*>(St + i * PD + k), acc);
      }
      const float xv = p.A[(zc + c) * p.a_stride + i0 + i] + p.s1 * acc;
      xt[i * PC + c] = xv;
      p.x[(zc + c) * D + i0 + i] = xv;
    }
    __syncthreads();
    // S = dec * S + s2 M2^T x + Y, rows k = r + kGroups m
#pragma unroll
    for (int m = 0; m < KM; ++m) {
      const int k = r + kGroups * m;
      float acc = 0.f;
#pragma unroll 4
      for (int c = 0; c < C; c += 4) {
        acc = dot4(*reinterpret_cast<const float4*>(M2t + k * PC + c),
                   *reinterpret_cast<const float4*>(xt + i * PC + c), acc);
      }
      float v = fmaf(ds[k], Sreg[m], p.s2 * acc);
      if (p.Y) v += p.Y[(z * D + k) * D + i0 + i];
      Sreg[m] = v;
      St[i * PD + k] = v;
    }
  }
#pragma unroll
  for (int m = 0; m < KM; ++m) {
    p.final_state[(bh * D + r + kGroups * m) * D + i0 + i] = Sreg[m];
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
                     {WU + D, 2 * D, WU, 2 * D, ke, D, dec, nullptr, S0, -1.f, 1.f, false, vnew,
                      states, final_state},
                     stream);
}

cudaError_t kda_scan_backward(const KdaShape& s, const float* WU, const float* ke,
                              const float* dec, const float* X, const float* Y, const float* dSN,
                              float* dvnew, float* dstates, float* dS0, cudaStream_t stream) {
  const int64_t D = s.D;
  return launch_scan(s,
                     {X, D, ke, D, WU, 2 * D, dec, Y, dSN, 1.f, -1.f, true, dvnew, dstates, dS0},
                     stream);
}

int64_t kda_beta_slices(int64_t head_dim) { return head_dim / kSlice; }

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
