#include "ops/options.h"

#include "kernels/fused.h"

namespace viaduct::ops {

bool fused_runs(const at::Tensor& x, const KernelOptions& k) {
  return k.fused && kernels::usable(x);
}

void set_kernel_options(torch::nn::Module& root, const KernelOptions& k) {
  for (const auto& m : root.modules(/*include_self=*/true)) {
    if (auto* user = dynamic_cast<KernelUser*>(m.get())) user->set_own_kernel_options(k);
  }
}

}  // namespace viaduct::ops
