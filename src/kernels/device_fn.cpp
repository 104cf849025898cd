// usable(): whether the kernels run on a tensor (CUDA build).
#include "kernels/fused.h"

#include "kernels/fn_common.h"

namespace viaduct::kernels {

bool usable(const at::Tensor& x) {
  if (!x.defined() || !x.is_cuda()) return false;
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16) return false;
  return cuda::device_supported(x.device().index());
}

}  // namespace viaduct::kernels
