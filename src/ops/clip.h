// The clip coefficient formed on the device (see Note [Clip coefficient on the
// device], kernels/clip.cu).
#pragma once

#include <torch/torch.h>

#include <vector>

#include "kernels/fused.h"
#include "ops/options.h"

namespace viaduct::ops {

using kernels::DeviceClip;

// Whether the device forms the clip coefficient for these gradients (fp32
// on one GPU the kernels run on, under these options).
bool clip_on_device_takes(const std::vector<at::Tensor>& grads, const KernelOptions& k);
// kernels::clip_on_device: the global norm and the coefficient for max_norm
// on the device; fetch() returns the norm, then the values of `also`.
DeviceClip clip_on_device(const std::vector<at::Tensor>& grads, double max_norm,
                          const std::vector<at::Tensor>& also = {});

}  // namespace viaduct::ops
