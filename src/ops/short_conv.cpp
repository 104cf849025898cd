#include "ops/short_conv.h"

#include "kernels/fused.h"

namespace viaduct::ops {

at::Tensor short_conv_silu(const at::Tensor& x, const at::Tensor& weight, const KernelOptions& k,
                           const Documents* documents) {
  if (documents != nullptr) {
    return documents->per_document({x}, [&](const std::vector<at::Tensor>& d, const DocumentSpan&) {
      return short_conv_silu(d[0], weight, k);
    });
  }
  if (fused_runs(x, k) && kernels::short_conv_silu_usable(x, weight)) {
    return kernels::short_conv_silu(x, weight);
  }
  const auto T = x.size(1), K = weight.size(1);
  auto w = weight.to(x.scalar_type()).unsqueeze(1);  // [C, 1, K]
  auto y = at::conv1d(x.transpose(1, 2), w, {}, /*stride=*/1,
                      /*padding=*/K - 1, /*dilation=*/1,
                      /*groups=*/weight.size(0));  // [B, C, T + K - 1]
  // [B, T, C] laid out densely, as the kernel's and as documents put back
  // together (see Note [Document boundaries]): the ops after it reduce
  // over C in the order its layout gives.
  return at::silu(y.narrow(2, 0, T).transpose(1, 2)).contiguous();
}

}  // namespace viaduct::ops
