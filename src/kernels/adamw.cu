// AdamW on fp32 tensors: every tensor of a step in one launch, or one
// tensor a launch where its size or alignment does not suit that.
#include "kernels/common.cuh"
#include "kernels/adamw.h"

namespace viaduct::cuda {
namespace {

// Note [AdamW over many tensors in one launch]
// A step updates every parameter tensor (the K3 cell ~380, from [dim]
// norm weights to [experts, ...] stacks); one launch each costs the host a
// launch and the device a partial last wave per tensor. Here one launch
// takes them all: each tensor is cut into chunks of kAdamWChunkGroups
// groups of 4 values, numbered across the tensors in order (the item's
// first_chunk), and a block takes a chunk, finds its tensor by a binary
// search over the items' first chunks, and updates its values. The items
// (pointers, size, decay) travel as one small table in device memory, so
// the launch's arguments stay a handful whatever the tensor count. Each
// value's arithmetic is adamw_kernel's, so the bits are those of one
// launch per tensor.

// One AdamW update of groups [first, groups) of N values, each thread's
// groups `stride` apart: the formulas of train/optimizer.cpp's loop in
// fp32. Both AdamW kernels run it, so one launch per tensor and the
// launch over many tensors have the same bits.
template <int N>
__device__ __forceinline__ void adamw_groups(float* __restrict__ p, const float* __restrict__ g,
                                             float* __restrict__ m, float* __restrict__ v,
                                             __nv_bfloat16* __restrict__ low, int64_t first,
                                             int64_t groups, int64_t stride, float decay,
                                             float beta1, float beta2, float step_size,
                                             float inv_bc2_sqrt, float eps, float grad_scale) {
  for (int64_t k = first; k < groups; k += stride) {
    float pv[N], gv[N], mv[N], vv[N];
    load_n<float, N>(p, k * N, pv);
    load_n<float, N>(g, k * N, gv);
    load_n<float, N>(m, k * N, mv);
    load_n<float, N>(v, k * N, vv);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      // The clip coefficient (see Note [Clip folded into AdamW]) is rounded on
      // its own, as ATen's in-place multiply of the gradient rounds it.
      // Every operation is spelled with its rounding (the _rn intrinsics
      // become mul.rn/sub.rn, which ptxas may not fuse into an fma), so the
      // bits do not depend on how this function is scheduled inside each
      // kernel. Written as plain arithmetic, the PTX had contractible
      // mul.f32/sub.f32 and the two kernels' weights differed for the
      // tensors with weight decay (test AdamWManyHasTheBitsOfOneCallEach).
      gv[j] = __fmul_rn(gv[j], grad_scale);
      pv[j] = __fmul_rn(pv[j], decay);
      mv[j] = __fmaf_rn(1.f - beta1, __fsub_rn(gv[j], mv[j]), mv[j]);  // lerp toward g
      vv[j] = __fmaf_rn(__fmul_rn(1.f - beta2, gv[j]), gv[j], __fmul_rn(vv[j], beta2));
      const float den = __fmaf_rn(__fsqrt_rn(vv[j]), inv_bc2_sqrt, eps);
      pv[j] = __fsub_rn(pv[j], __fdiv_rn(__fmul_rn(step_size, mv[j]), den));
    }
    store_n<float, N>(p, k * N, pv);
    store_n<float, N>(m, k * N, mv);
    store_n<float, N>(v, k * N, vv);
    // See Note [Low-precision weight cache]: the new weight's bf16 copy in the
    // same pass, rounded as a cast rounds.
    if (low != nullptr) store_n<__nv_bfloat16, N>(low, k * N, pv);
  }
}

// The clip coefficient an AdamW kernel applies: grad_scale, or with
// scale_dev the one formed on the device (see Note [Clip coefficient on the
// device]), where NaN means the norm was not finite and nothing is updated.
__device__ __forceinline__ float adamw_scale(float grad_scale, const float* scale_dev) {
  return scale_dev != nullptr ? *scale_dev : grad_scale;
}

template <int N>
__global__ void adamw_kernel(float* __restrict__ p, const float* __restrict__ g,
                             float* __restrict__ m, float* __restrict__ v,
                             __nv_bfloat16* __restrict__ low, int64_t groups, float decay,
                             float beta1, float beta2, float step_size, float inv_bc2_sqrt,
                             float eps, float grad_scale, const float* __restrict__ scale_dev) {
  const float scale = adamw_scale(grad_scale, scale_dev);
  if (scale != scale) return;
  adamw_groups<N>(p, g, m, v, low, blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x,
                  groups, static_cast<int64_t>(gridDim.x) * blockDim.x, decay, beta1, beta2,
                  step_size, inv_bc2_sqrt, eps, scale);
}

// See Note [AdamW over many tensors in one launch]: chunk c of the
// `count` items' chunks, values in groups of 4.
__global__ void adamw_many_kernel(const AdamWItem* __restrict__ items, int count,
                                  int64_t chunks, float beta1, float beta2, float step_size,
                                  float inv_bc2_sqrt, float eps, float grad_scale,
                                  const float* __restrict__ scale_dev) {
  const float scale = adamw_scale(grad_scale, scale_dev);
  if (scale != scale) return;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    int lo = 0, hi = count - 1;  // the last item whose first chunk is <= c
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (items[mid].first_chunk <= c) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const AdamWItem& it = items[lo];
    const int64_t first = (c - it.first_chunk) * kAdamWChunkGroups;
    const int64_t end = min(first + kAdamWChunkGroups, it.n / 4);
    adamw_groups<4>(it.p, it.g, it.m, it.v, static_cast<__nv_bfloat16*>(it.low_bf16),
                    first + threadIdx.x, end, blockDim.x, it.decay, beta1, beta2, step_size,
                    inv_bc2_sqrt, eps, scale);
  }
}

}  // namespace

bool adamw_batchable(const AdamWItem& t) {
  return t.n > 0 && t.n % 4 == 0 && aligned16(t.p) && aligned16(t.g) && aligned16(t.m) &&
         aligned16(t.v) && aligned16(t.low_bf16);
}

// Every item's decay is formed as adamw() forms it, on the host. The
// product of two floats is exact in double, so a contracted and an
// uncontracted build give the same decay.
float adamw_decay(float lr, float weight_decay) {
  return static_cast<float>(1.0 - static_cast<double>(lr) * static_cast<double>(weight_decay));
}

int64_t adamw_plan(AdamWItem* items, int count, float lr) {
  int64_t chunks = 0;
  for (int i = 0; i < count; ++i) {
    if (!adamw_batchable(items[i])) return -1;
    items[i].decay = adamw_decay(lr, items[i].weight_decay);
    items[i].first_chunk = chunks;
    chunks += (items[i].n / 4 + kAdamWChunkGroups - 1) / kAdamWChunkGroups;
  }
  return chunks;
}

cudaError_t adamw_many(const AdamWItem* items_dev, int count, int64_t chunks, float lr,
                       float beta1, float beta2, float eps, float bias_corr1, float bias_corr2,
                       float grad_scale, cudaStream_t stream, const float* scale_dev) {
  if (count == 0 || chunks == 0) return cudaSuccess;
  const float step_size = lr / bias_corr1;
  const float inv_bc2_sqrt = 1.f / sqrtf(bias_corr2);
  const int64_t blocks = chunks < (1 << 20) ? chunks : (1 << 20);
  adamw_many_kernel<<<static_cast<unsigned>(blocks), kElemThreads, 0, stream>>>(
      items_dev, count, chunks, beta1, beta2, step_size, inv_bc2_sqrt, eps, grad_scale, scale_dev);
  return cudaGetLastError();
}

cudaError_t adamw(float* p, const float* g, float* m, float* v, void* low_bf16, int64_t n,
                  float lr, float beta1, float beta2, float eps, float weight_decay,
                  float bias_corr1, float bias_corr2, float grad_scale, cudaStream_t stream,
                  const float* scale_dev) {
  auto* low = static_cast<__nv_bfloat16*>(low_bf16);
  if (n == 0) return cudaSuccess;
  const float decay = adamw_decay(lr, weight_decay);
  const float step_size = lr / bias_corr1;
  const float inv_bc2_sqrt = 1.f / sqrtf(bias_corr2);
  if (n % 4 == 0 && aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v)) {
    adamw_kernel<4><<<elementwise_blocks(n / 4), kElemThreads, 0, stream>>>(
        p, g, m, v, low, n / 4, decay, beta1, beta2, step_size, inv_bc2_sqrt, eps, grad_scale,
        scale_dev);
  } else {
    adamw_kernel<1><<<elementwise_blocks(n), kElemThreads, 0, stream>>>(
        p, g, m, v, low, n, decay, beta1, beta2, step_size, inv_bc2_sqrt, eps, grad_scale,
        scale_dev);
  }
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
