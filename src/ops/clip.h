// The clip coefficient formed on the device (see Note [Clip coefficient on the
// device], kernels/clip.cu).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <vector>

#include "kernels/fused.h"
#include "ops/options.h"

namespace viaduct::ops {

using kernels::DeviceClip;

// Whether the device forms the clip coefficient for these gradients (fp32
// on one GPU the kernels run on, under these options).
bool clip_on_device_takes(const std::vector<at::Tensor>& grads, const KernelOptions& k);
// kernels::clip_on_device: the global norm and the coefficient for max_norm
// on the device, and the values of `also` beside the norm; device work only.
DeviceClip clip_on_device(const std::vector<at::Tensor>& grads, double max_norm,
                          const std::vector<at::Tensor>& also = {});
// kernels::fetch_clip_values: starts the values' copy to the host; the
// function returned waits for it and returns the norm, then `also`.
std::function<std::vector<double>()> fetch_clip_values(const DeviceClip& clip);

}  // namespace viaduct::ops
