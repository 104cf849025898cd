#include "ops/clip.h"

namespace viaduct::ops {

bool clip_on_device_takes(const std::vector<at::Tensor>& grads, const KernelOptions& k) {
  return k.fused && kernels::clip_on_device_takes(grads);
}

DeviceClip clip_on_device(const std::vector<at::Tensor>& grads, double max_norm,
                          const std::vector<at::Tensor>& also, BackwardNorms* during) {
  return kernels::clip_on_device(grads, max_norm, also, during);
}

std::shared_ptr<BackwardNorms> backward_norms(const std::vector<at::Tensor>& params,
                                              const KernelOptions& k) {
  return k.fused ? kernels::backward_norms(params) : nullptr;
}

void arm_backward_norms(BackwardNorms& norms) { kernels::arm_backward_norms(norms); }

std::function<std::vector<double>()> fetch_clip_values(const DeviceClip& clip) {
  return kernels::fetch_clip_values(clip);
}

}  // namespace viaduct::ops
