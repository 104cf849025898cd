// Row L2 normalisation (KDA's q and k).
#pragma once

#include <torch/torch.h>

#include "ops/options.h"

namespace viaduct::ops {

// scale * x * rsqrt(sum(x^2, last dim) + eps) in fp32 (fp64 stays fp64).
// Where viaduct's kernels run: one kernel each way, reading x in its own
// dtype; the ATen form casts x first.
at::Tensor l2_normalize(const at::Tensor& x, double eps, double scale, const KernelOptions& k);

}  // namespace viaduct::ops
