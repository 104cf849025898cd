// The typed options every op takes, and the one question each op asks
// before its CUDA kernel: does it run here?
//
// Note [Ops own the kernel choice]
// Model code calls ops:: and never asks about kernels. Each op picks its
// CUDA kernel (kernels/fused.h) where kernels::usable() says the GPU and
// dtype have one and the options allow it, and its ATen form otherwise
// (CPU, fp64 gradient checks, the CPU build, model.cuda_kernels = false),
// as a ggml backend answers supports_op. Where a kernel takes only some
// shapes (the read with its norm: rows of at most 2048 bf16), the op checks
// the shape too; nothing else switches between forms.
#pragma once

#include <torch/torch.h>

namespace viaduct::ops {

// Built from the config in one place (model/model.cpp) and held by the
// modules that call ops (KernelUser); a module built without a config gets
// these defaults.
struct KernelOptions {
  bool fused = true;              // model.cuda_kernels
  bool swiglu_recompute = false;  // model.swiglu_recompute
};

// True when viaduct's CUDA kernels run on x under these options.
bool fused_runs(const at::Tensor& x, const KernelOptions& k);

// A module that calls ops holds its options here; set_kernel_options sets
// them on a module and every submodule that is a KernelUser.
class KernelUser {
 public:
  virtual ~KernelUser() = default;
  const KernelOptions& kernel_options() const { return kernel_options_; }
  void set_own_kernel_options(const KernelOptions& k) { kernel_options_ = k; }

 protected:
  KernelOptions kernel_options_;
};
void set_kernel_options(torch::nn::Module& root, const KernelOptions& k);

}  // namespace viaduct::ops
