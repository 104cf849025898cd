// The Block AttnRes read, with or without the RMSNorm after it, and the
// sum of its partial weight-gradient rows.
#include "kernels/attn_res_read.cuh"

namespace viaduct::cuda {
namespace {

// Register form: dim <= 32 * N * ITERS. Lane columns: lane * N + it * 32 * N
// + k (constant offsets from a per-row base; `rem` bounds a partial row).
// kNorm (see Note [AttnRes read with its norm]): out is norm(h), not h.
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


// Register form: dim <= 32 * N * ITERS, columns as in the forward's. Warp w
// of block b takes rows b * kReadWarps + w + k * gridDim.x * kReadWarps.
//
// kNorm (see Note [AttnRes read with its norm]): g is not loaded but formed from
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

// Note [Summing the read's partial rows]
// The read's backward (and the norm's, when fused with it) leaves its
// weight-shaped gradients as fp32 partial rows, one per block of rows:
// [sets, parts, dim]. Summing them took an ATen reduction per set and two
// multiplies for the query's and the norm weight's gradients (du * w,
// du * q) would be four small launches a read. One launch does it all: a block owns 32 columns of
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

}  // namespace

// kReadRowsPerPart rows a block, up to 1024 blocks (8 MiB of fp32 partials
// at dim 2048; each warp takes more rows beyond that).
int64_t attn_res_read_backward_parts(int64_t rows) {
  const int64_t parts = (rows + kReadRowsPerPart - 1) / kReadRowsPerPart;
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
      if (nrm != nullptr && n <= kReadNormPassMaxSources) {
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
                                  int64_t dim, float eps, cudaStream_t stream,
                                  const ReadNorm* nrm) {
  if (n < 1 || n > kMaxReadSources) return cudaErrorInvalidValue;
  if (nrm != nullptr && !(attn_res_read_norm_fits(dt, src, n, dim) && aligned16(nrm->w) &&
                          aligned16(out) && aligned16(u))) {
    return cudaErrorNotSupported;
  }
  if (rows == 0) return cudaSuccess;
  const bool vec = read_vectorisable(dt, src.p, n, dim) && aligned16(u) && aligned16(out);
  const int64_t blocks = (rows + kReadWarps - 1) / kReadWarps;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  VIADUCT_DISPATCH_VEC(dt, vec,
                       return launch_read_forward_warp<T, N>(
                           static_cast<unsigned>(blocks), stream, src, n, u, out, rstd, dot,
                           alpha, rows, dim, eps, nrm));
}

cudaError_t attn_res_read_backward(DType dt, const ReadSources& src, const ReadSources& acc,
                                   const ReadGrads& dsrc, int n, const void* g, const float* u,
                                   const float* rstd, const float* dot, const float* alpha,
                                   float* du_partial, int64_t rows, int64_t dim,
                                   cudaStream_t stream, const ReadNorm* nrm) {
  if (n < 1 || n > kMaxReadSources) return cudaErrorInvalidValue;
  bool any_acc = false;
  for (int i = 0; i < n; ++i) any_acc = any_acc || acc.p[i] != nullptr;
  if (nrm != nullptr) {  // g is formed from nrm->dy; every pointer as the register form needs
    bool ok = attn_res_read_norm_fits(dt, src, n, dim) && aligned16(nrm->w) &&
              aligned16(nrm->dy) && aligned16(nrm->dw_partial) && aligned16(u) &&
              aligned16(du_partial);
    for (int i = 0; i < n; ++i) ok = ok && aligned16(dsrc.p[i]) && aligned16(acc.p[i]);
    if (!ok) return cudaErrorNotSupported;
  }
  if (rows == 0) return cudaSuccess;
  bool vec = read_vectorisable(dt, src.p, n, dim) && (nrm != nullptr || aligned16(g)) &&
             aligned16(u) && aligned16(du_partial);
  for (int i = 0; i < n; ++i) vec = vec && aligned16(dsrc.p[i]) && aligned16(acc.p[i]);
  const auto grid = static_cast<unsigned>(attn_res_read_backward_parts(rows));
  VIADUCT_DISPATCH_VEC(dt, vec,
                       return launch_read_backward_warp<T, N>(
                           grid, stream, any_acc, src, acc, dsrc, n,
                           static_cast<const T*>(g), u, rstd, dot, alpha, du_partial, rows,
                           dim, nrm));
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

}  // namespace viaduct::cuda
