// Per-row cross-entropy that overwrites the logits with their gradient.
#include <algorithm>

#include <cooperative_groups.h>

#include "kernels/common.cuh"
#include "kernels/cross_entropy.h"

namespace viaduct::cuda {
namespace {

// L2 eviction policies for global accesses (PTX createpolicy), and 16-byte
// loads and stores that carry one.
__device__ __forceinline__ uint64_t l2_evict_last() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint4 load_with(const void* p, uint64_t policy) {
  uint4 v;
  asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(policy));
  return v;
}
__device__ __forceinline__ void store_with(void* p, uint4 v, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w), "l"(policy)
               : "memory");
}

// A group of N logits as stored (T), and as floats. Global reads and writes
// of 16-byte groups carry an L2 policy; narrower groups (a vocabulary that
// is not a multiple of the group) take plain accesses.
template <typename T, int N>
struct Group {
  static constexpr bool kWord = N * sizeof(T) == 16;
  T raw[N];
  __device__ __forceinline__ void read(const T* p, int64_t i, uint64_t policy) {
    if constexpr (kWord) {
      *reinterpret_cast<uint4*>(raw) = load_with(p + i, policy);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) raw[k] = p[i + k];
    }
  }
  __device__ __forceinline__ void stage(T* s, int64_t i) const {  // into shared memory
    if constexpr (kWord) {
      *reinterpret_cast<uint4*>(s + i) = *reinterpret_cast<const uint4*>(raw);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) s[i + k] = raw[k];
    }
  }
  __device__ __forceinline__ void floats(float (&v)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = load(raw, k);
  }
  // v rounded to T (as store_n rounds) and written to p + i.
  __device__ __forceinline__ void write(T* p, int64_t i, const float (&v)[N], uint64_t policy) {
#pragma unroll
    for (int k = 0; k < N; ++k) store(raw, k, v[k]);
    if constexpr (kWord) {
      store_with(p + i, *reinterpret_cast<const uint4*>(raw), policy);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) p[i + k] = raw[k];
    }
  }
};

// 2^x by the SFU, the instruction __expf runs after scaling its argument
// by log2 e; a result below 2^-126 (a probability no bf16 gradient
// step can use) is flushed to zero.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
constexpr float kLog2e = 1.4426950408889634f;

// The online softmax's running (max, sum) over one thread's logits, a group
// at a time: the group's max first, so the sum is rescaled at most once a
// group and every logit costs one fused multiply-add and one exp2
// (exp(v - m) = 2^(v log2 e - m log2 e)).
template <int N>
__device__ __forceinline__ void add_to(MaxSum& ms, const float (&v)[N]) {
  float gm = v[0];
#pragma unroll
  for (int k = 1; k < N; ++k) gm = fmaxf(gm, v[k]);
  if (gm > ms.m) {
    ms.s *= fast_exp2((ms.m - gm) * kLog2e);
    ms.m = gm;
  }
  const float ml = ms.m * kLog2e;
#pragma unroll
  for (int k = 0; k < N; ++k) ms.s += fast_exp2(fmaf(v[k], kLog2e, -ml));
}

// A group's gradient from its logits v (in place): the softmax, less one
// at the target t when the group [j, j + N) holds it, times the scale.
template <int N>
__device__ __forceinline__ void softmax_grad(float (&v)[N], float lse2, int64_t j, int64_t t,
                                             float scale) {
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = fast_exp2(fmaf(v[k], kLog2e, -lse2));
  if (t >= j && t < j + N) {  // the target's group: softmax - 1
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (j + k == t) v[k] -= 1.f;
    }
  }
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] *= scale;
}

// A block per row, two passes over it: the log-sum-exp, then the gradient
// written over the logits. The first pass keeps the row's first `staged`
// logits (a multiple of N) in shared memory for the second, so those are
// read from memory once. Where a row is longer than the block's share of
// shared memory and not split over a cluster (below: groups narrower than
// 16 bytes, or a row of more than 8 slices), the rest of it is read twice,
// the first time marked to stay in L2 (evict last) so that the second read
// finds it there, while
// the staged part's reads, the second reads and the gradient's writes are
// marked evict first (each is the last use of its bytes). Each thread
// takes the same logits in the same order in both forms (so the bits do
// not depend on `staged`), two groups a step in the first pass so that two
// loads are in flight.
template <typename T, int N>
__global__ void __launch_bounds__(kLossThreads)
    cross_entropy_kernel(T* __restrict__ logits, const int64_t* __restrict__ targets,
                         float* __restrict__ row_loss, int64_t vocab, int64_t ignore_index,
                         int64_t staged, const float* __restrict__ grad_scale) {
  extern __shared__ uint4 stage_words[];
  T* stage = reinterpret_cast<T*>(stage_words);
  __shared__ MaxSum scratch[32];
  const int64_t row = blockIdx.x;
  T* z = logits + row * vocab;
  const int64_t t = targets[row];
  if (t == ignore_index) {
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) store(z, j, 0.f);
    if (threadIdx.x == 0) row_loss[row] = 0.f;
    return;
  }
  const uint64_t keep = l2_evict_last(), drop = l2_evict_first();
  const int64_t step = static_cast<int64_t>(blockDim.x) * N;
  MaxSum ms{-INFINITY, 0.f};
  int64_t j = threadIdx.x * static_cast<int64_t>(N);
  for (; j + step < vocab; j += 2 * step) {
    Group<T, N> a, b;
    a.read(z, j, j < staged ? drop : keep);
    b.read(z, j + step, j + step < staged ? drop : keep);
    if (j < staged) a.stage(stage, j);
    if (j + step < staged) b.stage(stage, j + step);
    float va[N], vb[N];
    a.floats(va);
    b.floats(vb);
    add_to<N>(ms, va);
    add_to<N>(ms, vb);
  }
  if (j < vocab) {
    Group<T, N> a;
    a.read(z, j, j < staged ? drop : keep);
    if (j < staged) a.stage(stage, j);
    float va[N];
    a.floats(va);
    add_to<N>(ms, va);
  }
  ms = block_max_sum(ms, scratch);
  const float lse = ms.m + logf(ms.s);
  const float lse2 = lse * kLog2e;
  const float scale = grad_scale != nullptr ? *grad_scale : 1.f;
  const bool valid = t >= 0 && t < vocab;
  if (threadIdx.x == 0) row_loss[row] = valid ? lse - load(z, t) : NAN;
  __syncthreads();  // z[t] is read above before it is overwritten below
  for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < vocab; j += step) {
    Group<T, N> g;
    float v[N];
    if (j < staged) {
      load_n<T, N>(stage, j, v);  // this thread's own group from the first pass
    } else {
      g.read(z, j, drop);
      g.floats(v);
    }
    softmax_grad<N>(v, lse2, j, t, scale);
    g.write(z, j, v, drop);
  }
}

// A cluster of C blocks per row (Hopper's thread-block clusters), each
// staging its slice of the row (at most ~70 KB, so three blocks an SM) in
// shared memory by cp.async: the whole row is read from memory once. Each
// block's (max, sum) goes to the cluster through distributed shared memory;
// every block combines the C parts in rank order, so all take the same
// log-sum-exp. The gradient is then written from the staged slice. A
// block must not exit while another may still read its part: the cluster
// barrier is arrived at after the parts are read and waited on at the end.
constexpr int kClusterThreads = 512;
constexpr int kClusterMax = 8;
constexpr int64_t kClusterSliceBytes = 70 * 1024;

template <typename T, int N>
__global__ void __launch_bounds__(kClusterThreads)
    cross_entropy_cluster_kernel(T* __restrict__ logits, const int64_t* __restrict__ targets,
                                 float* __restrict__ row_loss, int64_t vocab,
                                 int64_t ignore_index, int64_t slice,
                                 const float* __restrict__ grad_scale) {
  static_assert(N * sizeof(T) == 16, "the cluster form stages 16-byte groups");
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ uint4 stage_words[];
  T* stage = reinterpret_cast<T*>(stage_words);
  __shared__ MaxSum scratch[32];
  __shared__ MaxSum part;
  __shared__ float lse_sh;
  const unsigned C = cluster.num_blocks(), rank = cluster.block_rank();
  const int64_t row = blockIdx.x / C;
  const int64_t begin = static_cast<int64_t>(rank) * slice;
  const int64_t left = vocab - begin;
  const int64_t n = left < 0 ? 0 : (left < slice ? left : slice);
  T* z = logits + row * vocab + begin;
  const int64_t t = targets[row];
  const int64_t step = static_cast<int64_t>(blockDim.x) * N;
  if (t == ignore_index) {  // the whole cluster takes this branch
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) store(z, j, 0.f);
    if (rank == 0 && threadIdx.x == 0) row_loss[row] = 0.f;
    return;
  }
  for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < n; j += step) {
    cp_async16(stage + j, z + j);
  }
  cp_async_commit();
  cp_async_wait_all();  // this thread's own groups, read back by it alone below
  MaxSum ms{-INFINITY, 0.f};
  for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < n; j += step) {
    float v[N];
    load_n<T, N>(stage, j, v);
    add_to<N>(ms, v);
  }
  ms = block_max_sum(ms, scratch);
  if (threadIdx.x == 0) part = ms;
  cluster.sync();
  if (threadIdx.x == 0) {
    MaxSum total{-INFINITY, 0.f};
    for (unsigned r = 0; r < C; ++r) total = combine(total, *cluster.map_shared_rank(&part, r));
    lse_sh = total.m + logf(total.s);
  }
  __syncthreads();
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  const float lse = lse_sh;
  const float lse2 = lse * kLog2e;
  const float scale = grad_scale != nullptr ? *grad_scale : 1.f;
  const bool valid = t >= 0 && t < vocab;
  const int64_t tl = t - begin;  // the target in this slice when 0 <= tl < n
  if (threadIdx.x == 0) {
    if (!valid && rank == 0) row_loss[row] = NAN;
    if (valid && tl >= 0 && tl < n) row_loss[row] = lse - load(stage, tl);
  }
  const uint64_t drop = l2_evict_first();
  for (int64_t j = threadIdx.x * static_cast<int64_t>(N); j < n; j += step) {
    float v[N];
    load_n<T, N>(stage, j, v);
    softmax_grad<N>(v, lse2, j, tl, scale);
    Group<T, N> g;
    g.write(z, j, v, drop);
  }
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The cluster form's blocks a row, where a row is longer than one block
// stages (stage_bytes_limit) and fits kClusterMax slices of at most
// kClusterSliceBytes (16-byte groups only); 0 where the one-block form runs.
int64_t stage_bytes_limit();
template <typename T, int N>
int cluster_blocks_for(int64_t vocab) {
  if constexpr (N * sizeof(T) != 16) {
    return 0;
  } else {
    const int64_t bytes = vocab * static_cast<int64_t>(sizeof(T));
    if (bytes <= stage_bytes_limit()) return 0;
    for (int c = 2; c <= kClusterMax; ++c) {
      if ((bytes + c - 1) / c <= kClusterSliceBytes) return c;
    }
    return 0;
  }
}

// Blocks of the loss an SM holds at once: the staged part of a row is
// sized so that this many fit in an SM's shared memory (two: one block's
// bubble at its block-wide sum is the other's time to load).
constexpr int kLossBlocksPerSm = 2;

// The dynamic shared memory a loss block may stage a row in: its share of
// the current device's SM, less what the block's launch reserves and its
// static part.
int64_t stage_bytes_limit() {
  int dev = 0, per_sm = 0, per_block = 0, reserved = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev) !=
          cudaSuccess) {
    return 0;
  }
  const int64_t share = std::min<int64_t>(per_sm / kLossBlocksPerSm - reserved, per_block);
  return std::max<int64_t>(share - static_cast<int64_t>(32 * sizeof(MaxSum)), 0);
}

template <typename T, int N>
cudaError_t launch_cross_entropy(T* logits, const int64_t* targets, float* row_loss, int64_t rows,
                                 int64_t vocab, int64_t ignore_index, const float* grad_scale,
                                 cudaStream_t stream) {
  if (const int c = cluster_blocks_for<T, N>(vocab); c > 0) {
    // Slices of whole groups; the last may be shorter.
    const int64_t groups = vocab / N;
    const int64_t slice = (groups + c - 1) / c * N;
    const size_t bytes = static_cast<size_t>(slice) * sizeof(T);
    if constexpr (N * sizeof(T) == 16) {
      auto kernel = cross_entropy_cluster_kernel<T, N>;
      if (auto e = allow_smem(kernel, bytes); e != cudaSuccess) return e;
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(static_cast<unsigned>(rows * c));
      cfg.blockDim = dim3(kClusterThreads);
      cfg.dynamicSmemBytes = bytes;
      cfg.stream = stream;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = static_cast<unsigned>(c);
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      return cudaLaunchKernelEx(&cfg, kernel, logits, targets, row_loss, vocab, ignore_index,
                                slice, grad_scale);
    }
  }
  const int64_t fit = stage_bytes_limit() / static_cast<int64_t>(sizeof(T)) / N * N;
  const int64_t staged = std::min(vocab / N * N, fit);
  const size_t bytes = static_cast<size_t>(staged) * sizeof(T);
  if (auto e = allow_smem(cross_entropy_kernel<T, N>, bytes); e != cudaSuccess) return e;
  cross_entropy_kernel<T, N><<<static_cast<unsigned>(rows), kLossThreads, bytes, stream>>>(
      logits, targets, row_loss, vocab, ignore_index, staged, grad_scale);
  return cudaGetLastError();
}

// Grid-stride, so that where the ratio is 1 a few hundred blocks read two
// scalars and return (a grid over every element would launch and retire
// tens of thousands of empty blocks).
template <typename T, int N>
__global__ void __launch_bounds__(kElemThreads)
    scale_by_ratio_kernel(T* __restrict__ t, int64_t groups, const float* __restrict__ num,
                          const float* __restrict__ den) {
  const float r = den != nullptr ? *num / *den : *num;
  if (r == 1.f) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kElemThreads;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x; g < groups;
       g += stride) {
    float v[N];
    load_n<T, N>(t, g * N, v);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] *= r;
    store_n<T, N>(t, g * N, v);
  }
}

template <typename T, int N>
cudaError_t launch_scale_by_ratio(T* t, int64_t n, const float* num, const float* den,
                                  cudaStream_t stream) {
  int dev = 0, sms = 0;
  if (auto e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (auto e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
      e != cudaSuccess) {
    return e;
  }
  const int64_t groups = n / N;
  const int64_t want = (groups + kElemThreads - 1) / kElemThreads;
  const auto blocks = static_cast<unsigned>(std::max<int64_t>(
      1, std::min<int64_t>(want, static_cast<int64_t>(sms) * 8)));
  scale_by_ratio_kernel<T, N><<<blocks, kElemThreads, 0, stream>>>(t, groups, num, den);
  return cudaGetLastError();
}

}  // namespace

cudaError_t cross_entropy_forward_backward(DType dt, void* logits, const int64_t* targets,
                                           float* row_loss, int64_t rows, int64_t vocab,
                                           int64_t ignore_index, const float* grad_scale,
                                           cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const bool vec = vocab % group_of(dt) == 0 && aligned16(logits);
  VIADUCT_DISPATCH_VEC(dt, vec,
                       return launch_cross_entropy<T, N>(static_cast<T*>(logits), targets,
                                                         row_loss, rows, vocab, ignore_index,
                                                         grad_scale, stream));
  return cudaErrorInvalidValue;
}

cudaError_t scale_by_ratio(DType dt, void* t, int64_t n, const float* num, const float* den,
                           cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool vec = n % group_of(dt) == 0 && aligned16(t);
  VIADUCT_DISPATCH_VEC(dt, vec,
                       return launch_scale_by_ratio<T, N>(static_cast<T*>(t), n, num, den, stream));
  return cudaErrorInvalidValue;
}

}  // namespace viaduct::cuda
