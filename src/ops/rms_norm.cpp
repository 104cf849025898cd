#include "ops/rms_norm.h"

#include "kernels/fused.h"

namespace viaduct::ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const KernelOptions& k) {
  if (fused_runs(x, k)) return kernels::rms_norm(x, weight, eps);
  // fp32, or fp64 when the input is fp64 (gradient checks).
  auto xf = x.scalar_type() == at::kDouble ? x : x.to(at::kFloat);
  auto y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (y * weight).to(x.scalar_type());
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& res,
                                               const at::Tensor& weight, double eps,
                                               const KernelOptions& k) {
  if (fused_runs(x, k) && x.scalar_type() == res.scalar_type() && x.sizes() == res.sizes()) {
    return kernels::add_rms_norm(x, res, weight, eps);
  }
  auto h = x + res;
  return {h, rms_norm(h, weight, eps, k)};
}

at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                          const at::Tensor& gate_logits, at::ScalarType out,
                          const KernelOptions& k) {
  if (fused_runs(gate_logits, k) && out == gate_logits.scalar_type() &&
      kernels::gated_rms_norm_usable(x, gate_logits, weight)) {
    return kernels::gated_rms_norm(x, gate_logits, weight, eps);
  }
  return (rms_norm(x, weight, eps, k) * at::sigmoid(gate_logits.to(x.scalar_type()))).to(out);
}

}  // namespace viaduct::ops
