// AdamW on fp32 tensors: one tensor a launch, or many small ones.
#include "kernels/common.cuh"
#include "kernels/adamw.h"

namespace viaduct::cuda {
namespace {

// Note [Small tensors in one AdamW launch]
// A model has many small parameters: every norm weight, and in kimi_k3 two
// [dim] tensors per AttnRes read (134 at the K3 benchmark shape). One
// launch each costs more device time than its few KiB of work. Up to kAdamWBatch tensors of at most
// kAdamWSmall values share one launch here: blockIdx.y picks the tensor,
// the x blocks stride over its values. Each value's arithmetic is
// adamw_kernel's, so the bits are the same as one launch per tensor.
constexpr int kAdamWBatch = 24;
struct AdamWBatch {
  AdamWItem item[kAdamWBatch];
  float decay[kAdamWBatch];  // 1 - lr * weight_decay, per tensor
};

// One AdamW update of `groups` groups of N values, grid-stride: the
// formulas of train/optimizer.cpp's loop in fp32. Both AdamW kernels run
// it, so one launch per tensor and the batched launches have the same bits.
template <int N>
__device__ __forceinline__ void adamw_groups(float* __restrict__ p, const float* __restrict__ g,
                                             float* __restrict__ m, float* __restrict__ v,
                                             __nv_bfloat16* __restrict__ low, int64_t groups,
                                             float decay, float beta1, float beta2,
                                             float step_size, float inv_bc2_sqrt, float eps,
                                             float grad_scale) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < groups;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
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
      // tensors with weight decay (test AdamWBatchHasTheBitsOfOneCallEach).
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
  adamw_groups<N>(p, g, m, v, low, groups, decay, beta1, beta2, step_size, inv_bc2_sqrt, eps,
                  scale);
}

// See Note [Small tensors in one AdamW launch]: the update of tensor
// blockIdx.y of the batch, values in groups of 4 (every item 16-byte
// aligned with a multiple of 4 values).
__global__ void adamw_batch_kernel(AdamWBatch batch, float beta1, float beta2, float step_size,
                                   float inv_bc2_sqrt, float eps, float grad_scale,
                                   const float* __restrict__ scale_dev) {
  const float scale = adamw_scale(grad_scale, scale_dev);
  if (scale != scale) return;
  const AdamWItem& it = batch.item[blockIdx.y];
  adamw_groups<4>(it.p, it.g, it.m, it.v, static_cast<__nv_bfloat16*>(it.low_bf16), it.n / 4,
                  batch.decay[blockIdx.y], beta1, beta2, step_size, inv_bc2_sqrt, eps, scale);
}

}  // namespace

bool adamw_batchable(const AdamWItem& t) {
  return t.n > 0 && t.n <= kAdamWSmall && t.n % 4 == 0 && aligned16(t.p) && aligned16(t.g) &&
         aligned16(t.m) && aligned16(t.v) && aligned16(t.low_bf16);
}

// Every item's decay is formed as adamw() forms it, on the host. The
// product of two floats is exact in double, so a contracted and an
// uncontracted build give the same decay.
float adamw_decay(float lr, float weight_decay) {
  return static_cast<float>(1.0 - static_cast<double>(lr) * static_cast<double>(weight_decay));
}

cudaError_t adamw_batch(const AdamWItem* items, int count, float lr, float beta1, float beta2,
                        float eps, float bias_corr1, float bias_corr2, float grad_scale,
                        cudaStream_t stream, const float* scale_dev) {
  const float step_size = lr / bias_corr1;
  const float inv_bc2_sqrt = 1.f / sqrtf(bias_corr2);
  for (int start = 0; start < count; start += kAdamWBatch) {
    AdamWBatch b{};
    const int k = count - start < kAdamWBatch ? count - start : kAdamWBatch;
    int64_t most = 0;
    for (int i = 0; i < k; ++i) {
      const AdamWItem& t = items[start + i];
      if (!adamw_batchable(t)) return cudaErrorInvalidValue;
      b.item[i] = t;
      b.decay[i] = adamw_decay(lr, t.weight_decay);
      most = t.n > most ? t.n : most;
    }
    const dim3 grid(static_cast<unsigned>(elementwise_blocks(most / 4)), static_cast<unsigned>(k));
    adamw_batch_kernel<<<grid, kElemThreads, 0, stream>>>(b, beta1, beta2, step_size,
                                                          inv_bc2_sqrt, eps, grad_scale,
                                                          scale_dev);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
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
