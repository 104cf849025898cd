// The SwiGLU feed-forward: w2(silu(w1 x) * w3 x).
#pragma once

#include <torch/torch.h>

#include "ops/options.h"

namespace viaduct::ops {

// x: [..., D]; w1, w3: [F, D]; w2: [D, F] (fp32 master weights, cast to
// x's dtype). Where the kernels run: see Note [One w1/w3 projection].
at::Tensor swiglu_ffn(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                      const at::Tensor& w3, const KernelOptions& k);

}  // namespace viaduct::ops
