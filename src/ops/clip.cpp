#include "ops/clip.h"

namespace viaduct::ops {

bool clip_on_device_takes(const std::vector<at::Tensor>& grads, const KernelOptions& k) {
  return k.fused && kernels::clip_on_device_takes(grads);
}

DeviceClip clip_on_device(const std::vector<at::Tensor>& grads, double max_norm,
                          const std::vector<at::Tensor>& also) {
  return kernels::clip_on_device(grads, max_norm, also);
}

std::function<std::vector<double>()> fetch_clip_values(const DeviceClip& clip) {
  return kernels::fetch_clip_values(clip);
}

}  // namespace viaduct::ops
