// The clip coefficient formed on the device (CUDA build).
#include "kernels/fused.h"

#include <ATen/cuda/CUDAEvent.h>
#include "kernels/fn_common.h"
#include "kernels/clip.h"

namespace viaduct::kernels {

bool clip_on_device_takes(const std::vector<at::Tensor>& grads) {
  if (grads.empty() || !usable(grads.front())) return false;
  for (const auto& g : grads) {
    if (!g.defined() || g.device() != grads.front().device() || g.scalar_type() != at::kFloat)
      return false;
  }
  return true;
}

DeviceClip clip_on_device(const std::vector<at::Tensor>& grads, double max_norm,
                          const std::vector<at::Tensor>& also) {
  VIADUCT_CHECK(clip_on_device_takes(grads),
                "clip_on_device: the gradients must be fp32 on one CUDA device");
  const auto opts = grads.front().options();
  for (const auto& t : also) {
    VIADUCT_CHECK(t.defined() && t.numel() == 1 && t.device() == opts.device(),
                  "clip_on_device: each value to fetch must be one element on the gradients' "
                  "device");
  }
  // The norms as grad_squared_norms (train/optimizer.cpp) forms them.
  auto norms = at::stack(at::_foreach_norm(grads, 2)).contiguous();
  const auto n = static_cast<int64_t>(also.size());
  auto vals = at::empty({1 + n}, opts.dtype(at::kDouble));  // [norm, also...]
  auto scale = at::empty({1}, opts.dtype(at::kFloat));
  const auto stream = c10::cuda::getCurrentCUDAStream(opts.device().index());
  check_launch(cuda::clip_scale(norms.data_ptr<float>(), norms.numel(), max_norm,
                                vals.data_ptr<double>(), scale.data_ptr<float>(), stream.stream()),
               "clip_scale");
  if (n > 0) {
    std::vector<at::Tensor> flat;
    for (const auto& t : also) flat.push_back(t.reshape({1}));
    vals.narrow(0, 1, n).copy_(at::cat(flat));
  }
  return {scale, vals};
}

std::function<std::vector<double>()> fetch_clip_values(const DeviceClip& clip) {
  const auto& vals = clip.values;
  VIADUCT_CHECK(vals.defined() && vals.is_cuda() && vals.scalar_type() == at::kDouble,
                "fetch_clip_values: the values of clip_on_device");
  const auto stream = c10::cuda::getCurrentCUDAStream(vals.device().index());
  auto host = at::empty(vals.sizes(), at::TensorOptions().dtype(at::kDouble).pinned_memory(true));
  host.copy_(vals, /*non_blocking=*/true);
  auto ready = std::make_shared<at::cuda::CUDAEvent>();
  ready->record(stream);
  return [host, ready, vals] {
    ready->synchronize();
    const double* v = host.data_ptr<double>();
    return std::vector<double>(v, v + host.numel());
  };
}

}  // namespace viaduct::kernels
