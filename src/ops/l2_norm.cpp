#include "ops/l2_norm.h"

#include "kernels/fused.h"

namespace viaduct::ops {

at::Tensor l2_normalize(const at::Tensor& x, double eps, double scale, const KernelOptions& k) {
  if (fused_runs(x, k)) return kernels::l2_normalize(x, eps, scale);
  auto xf = x.to(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  auto y = xf * at::rsqrt(xf.pow(2).sum(-1, /*keepdim=*/true) + eps);
  return scale == 1.0 ? y : y * scale;
}

}  // namespace viaduct::ops
