// The typed options every op takes, the capabilities they run on, and the
// one question each op asks before its CUDA kernel: does it run here?
//
// Note [Ops own the kernel choice]
// Model code calls ops:: and never asks about kernels. Each op picks its
// CUDA kernel (kernels/fused.h) where kernels::usable() says the GPU and
// dtype have one and the options allow it, and its ATen form otherwise
// (CPU, fp64 gradient checks, the CPU build, model.cuda_kernels = false),
// as a ggml backend answers supports_op. Where a kernel takes only some
// shapes (the read with its norm: rows of at most 2048 bf16), the op checks
// the shape too; nothing else switches between forms. The choices between
// forms of one computation are ops too: one GEMM for q, k and v or three
// (ops::qkv_projection), grouped GEMMs for the MoE's experts or one chain
// per expert (ops::moe_experts, ops::moe_local_experts), the head loss in
// chunks or whole (ops::loss_chunk_tokens). What a LibTorch build's GEMMs
// take is decided once at start-up (ops::Capabilities) and never changes
// during a run.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>

namespace viaduct::kernels {
class WeightCache;
}  // namespace viaduct::kernels

namespace viaduct::ops {

// What this LibTorch build's GEMMs take on the run's device, found by
// probe_capabilities once at start-up (train/process.cpp, which logs it);
// the ops take the path it gives for the whole run. The defaults allow
// the fp32-output forms where the build has them (LibTorch >= 2.8, CUDA:
// compat:: decides at compile time); the probe withdraws what the build
// refuses. Options never probed (a module built by a test or a tool) on a
// build that refuses make the op fail, never switch it.
struct Capabilities {
  // Weight gradients written in fp32 by their GEMM from bf16 inputs
  // (compat::matmul_into_fp32_; See Note [Linear with an fp32 weight
  // gradient], ops/linear.cpp); else the bf16 product is cast.
  bool fp32_out_gemm = true;
  // The MoE experts' weight gradients from one grouped GEMM writing fp32
  // (compat::grouped_mm_fp32); else its bf16 product is cast.
  bool grouped_fp32_out_gemm = true;
  // Why a capability is off, for the start-up log; empty when both are on.
  std::string notes;
};

// Probes `device` with one small call of each form, in the dtypes and
// layouts the ops use (see Note [GEMM support decided at start-up],
// core/torch_compat.h). Call once, before training.
Capabilities probe_capabilities(const at::Device& device);
// The GEMM path `c` gives, one line for the start-up log.
std::string describe(const Capabilities& c);

// Note [The loss's gradient scale known to its forward]
// The trainer scales each micro-batch's summed loss by one factor, 1 / the
// step's tokens, before its backward, so the loss's node receives that
// factor as its incoming gradient. The chunked head loss computes its
// gradients in its forward (ops/cross_entropy.cpp); given the factor there,
// its loss kernel writes the logits' gradient already scaled, and its
// backward, receiving the same factor, has nothing left to do, where it
// would otherwise scale the [V, D] fp32 weight gradient in one more pass.
// The rank's trainer writes the factor here before each step's forward; it
// lives on the device so that a captured step reads each step's value.
// Where the backward receives another factor than the forward used (a
// caller that scales differently), it multiplies by their ratio. A power
// of two (the usual batch x sequence) keeps the bits of scaling after: the
// products only change exponent (barring values scaled into the subnormal
// range).
struct LossGradScale {
  at::Tensor value;  // fp32 scalar on the rank's device
};

// Built from the config in one place (model/model.cpp), completed by the
// rank's model with the probed capabilities and its weight cache
// (train/rank_model.cpp), and held by the modules that call ops
// (KernelUser); a module built without a config gets these defaults.
struct KernelOptions {
  bool fused = true;              // model.cuda_kernels
  bool swiglu_recompute = false;  // model.swiglu_recompute
  Capabilities capabilities;
  // The rank's bf16 copies of its weights (see Note [Low-precision weight
  // cache], kernels/weight_cache.h); null: every cast is made afresh.
  std::shared_ptr<kernels::WeightCache> weight_cache;
  // The factor the loss's backward will receive, set by the rank's trainer
  // (see Note [The loss's gradient scale known to its forward]); null: not
  // known, the backward scales.
  std::shared_ptr<LossGradScale> loss_grad_scale;
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
