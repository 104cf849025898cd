#include "ops/options.h"

#include "core/torch_compat.h"
#include "kernels/fused.h"

namespace viaduct::ops {

bool fused_runs(const at::Tensor& x, const KernelOptions& k) {
  return k.fused && kernels::usable(x);
}

Capabilities probe_capabilities(const at::Device& device) {
  Capabilities c;
  // The fp32-output forms run on CUDA tensors alone (core/torch_compat.h):
  // elsewhere there is nothing to ask.
  if (!device.is_cuda()) return c;
  if (const auto why = compat::fp32_out_gemm_refusal(device)) {
    c.fp32_out_gemm = false;
    c.notes = "no fp32-output GEMM: " + *why;
  }
  if (!compat::kGroupedMm) return c;
  if (const auto why = compat::grouped_fp32_out_gemm_refusal(device)) {
    c.grouped_fp32_out_gemm = false;
    c.notes += (c.notes.empty() ? "" : "; ") + ("no fp32-output grouped GEMM: " + *why);
  }
  return c;
}

std::string describe(const Capabilities& c) {
  std::string s = c.fp32_out_gemm ? "weight gradients written in fp32 by their GEMM"
                                  : "weight gradients as bf16 GEMMs cast to fp32";
  if (compat::kGroupedMm) {
    s += c.grouped_fp32_out_gemm ? ", MoE expert gradients by a grouped GEMM writing fp32"
                                 : ", MoE expert gradients by a bf16 grouped GEMM cast to fp32";
  }
  if (!c.notes.empty()) s += " (" + c.notes + ")";
  return s;
}

void set_kernel_options(torch::nn::Module& root, const KernelOptions& k) {
  for (const auto& m : root.modules(/*include_self=*/true)) {
    if (auto* user = dynamic_cast<KernelUser*>(m.get())) user->set_own_kernel_options(k);
  }
}

}  // namespace viaduct::ops
