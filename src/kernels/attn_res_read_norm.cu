// The read-with-norm backward in two passes over the sources (see Note [Read
// with its norm in two passes]), for up to kReadNormPassMaxSources sources.
#include "kernels/attn_res_read.cuh"

namespace viaduct::cuda {
namespace {

// Note [Read with its norm in two passes]
// The read-with-norm backward above makes three dependent passes over a
// row's sources: h again, the dots g . v_i, then the gradients, and each
// pass waits on one source's loads at a time, and h's sums and du go through
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
// throughout). More than kReadNormPassMaxSources sources take the form above.
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

// See Note [Read with its norm in two passes]: the launch for n sources.
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

}  // namespace

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

template cudaError_t launch_read_norm_backward_2pass<float, 4>(
    unsigned, cudaStream_t, bool, const ReadSources&, const ReadSources&, const ReadGrads&, int,
    const float*, const float*, const float*, const float*, float*, int64_t, int64_t,
    const ReadNorm&);
template cudaError_t launch_read_norm_backward_2pass<__nv_bfloat16, 8>(
    unsigned, cudaStream_t, bool, const ReadSources&, const ReadSources&, const ReadGrads&, int,
    const float*, const float*, const float*, const float*, float*, int64_t, int64_t,
    const ReadNorm&);

}  // namespace viaduct::cuda
