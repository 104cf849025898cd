// The device-side clip coefficient (kernels/clip.cu).
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

// See Note [Clip coefficient on the device] (kernels/clip.cu): from k fp32
// per-tensor gradient norms, norm_out[0] = the global norm (double) and
// scale_out[0] = the clip coefficient as fp32, or NaN when the norm is not
// finite (max_norm <= 0: no clipping, 1).
cudaError_t clip_scale(const float* norms, int64_t k, double max_norm, double* norm_out,
                       float* scale_out, cudaStream_t stream);

}  // namespace viaduct::cuda
