// AdamW launches (kernels/adamw.cu).
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

// One AdamW step on fp32 [n] tensors, in place, on the gradient
// g' = g * grad_scale (rounded as a separate multiply): p *= 1 - lr * wd;
// m += (1 - beta1) (g' - m); v = beta2 v + (1 - beta2) g^2;
// p -= lr / bias_corr1 * m / (sqrt(v) / sqrt(bias_corr2) + eps) (g' for g); and, when
// low_bf16 is not null, low_bf16[i] = bf16(p[i]) (round to nearest even).
// With scale_dev: grad_scale is read from scale_dev[0] on the device, and
// NaN there updates nothing (see Note [Clip coefficient on the device]).
cudaError_t adamw(float* p, const float* g, float* m, float* v, void* low_bf16, int64_t n,
                  float lr, float beta1, float beta2, float eps, float weight_decay,
                  float bias_corr1, float bias_corr2, float grad_scale, cudaStream_t stream,
                  const float* scale_dev = nullptr);

// See Note [AdamW over many tensors in one launch] (kernels/adamw.cu):
// adamw() for `count` tensors in one launch, with the bits of one call
// each. Every item must be adamw_batchable: a multiple of 4 values, every
// pointer 16-byte aligned (low_bf16 may be null). adamw_plan fills each
// item's decay and first chunk on the host and returns the chunk count
// (-1 when an item is not batchable); adamw_many then runs on a copy of
// those items in device memory.
constexpr int64_t kAdamWChunkGroups = 4096;  // groups of 4 values a chunk
struct AdamWItem {
  float* p = nullptr;
  const float* g = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  void* low_bf16 = nullptr;
  int64_t n = 0;
  float weight_decay = 0.f;
  float decay = 1.f;        // 1 - lr weight_decay (adamw_plan)
  int64_t first_chunk = 0;  // (adamw_plan)
};
bool adamw_batchable(const AdamWItem& t);
int64_t adamw_plan(AdamWItem* items, int count, float lr);
cudaError_t adamw_many(const AdamWItem* items_dev, int count, int64_t chunks, float lr,
                       float beta1, float beta2, float eps, float bias_corr1, float bias_corr2,
                       float grad_scale, cudaStream_t stream, const float* scale_dev = nullptr);

}  // namespace viaduct::cuda
