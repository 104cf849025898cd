#include "ops/layer_norm.h"

#include "kernels/fused.h"

namespace viaduct::ops {

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      double eps, const KernelOptions& k) {
  if (fused_runs(x, k) && kernels::layer_norm_usable(x, weight, bias)) {
    return kernels::layer_norm(x, weight, bias, eps);
  }
  // fp32, or fp64 when the input is fp64 (gradient checks).
  const auto up = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::layer_norm(x.to(up), {weight.size(0)}, weight, bias, eps).to(x.scalar_type());
}

std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& res,
                                                 const at::Tensor& weight,
                                                 const at::Tensor& bias, double eps,
                                                 const KernelOptions& k) {
  if (fused_runs(x, k) && kernels::layer_norm_usable(x, weight, bias) &&
      x.scalar_type() == res.scalar_type() && x.sizes() == res.sizes() &&
      res.device() == x.device()) {
    return kernels::add_layer_norm(x, res, weight, bias, eps);
  }
  auto h = x + res;
  return {h, layer_norm(h, weight, bias, eps, k)};
}

}  // namespace viaduct::ops
