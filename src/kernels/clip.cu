// The clip coefficient formed on the device from per-tensor norms.
#include "kernels/common.cuh"
#include "kernels/clip.h"

namespace viaduct::cuda {
namespace {

// Note [Clip coefficient on the device]
// The clip coefficient needs the global gradient norm. Read on the host, it
// held the device idle between the backward and the optimizer: the host
// waited for the norm, then launched every AdamW update while the device
// ran them faster than they came. Where one process holds the whole model,
// one thread on the device forms the norm and the coefficient instead, and
// the AdamW kernels read the coefficient from there. The host reads the
// norm (for the log and the finiteness check) after it has queued the
// updates. The arithmetic is the host's, in the host's order: squares of
// the fp32 norms and their sum in double, sqrt, max_norm / (norm + 1e-6)
// capped at 1, rounded to fp32, with no contraction. So the update has
// the same bits. A norm that is not finite makes the coefficient NaN, and
// the AdamW kernels then update nothing; the host raises the error it
// raised before.
__global__ void clip_scale_kernel(const float* __restrict__ norms, int64_t k, double max_norm,
                                  double* __restrict__ norm_out, float* __restrict__ scale_out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double s = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    const double v = norms[i];
    s = __dadd_rn(s, __dmul_rn(v, v));
  }
  const double norm = sqrt(s);
  double coef = 1.0;
  if (max_norm > 0) {
    coef = __ddiv_rn(max_norm, __dadd_rn(norm, 1e-6));
    if (!(coef < 1.0)) coef = 1.0;
  }
  norm_out[0] = norm;
  scale_out[0] = isfinite(norm) ? static_cast<float>(coef) : __int_as_float(0x7fc00000);
}

}  // namespace

cudaError_t clip_scale(const float* norms, int64_t k, double max_norm, double* norm_out,
                       float* scale_out, cudaStream_t stream) {
  if (k < 0) return cudaErrorInvalidValue;
  clip_scale_kernel<<<1, 32, 0, stream>>>(norms, k, max_norm, norm_out, scale_out);
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
