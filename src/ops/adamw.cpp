#include "ops/adamw.h"

#include "kernels/fused.h"
#include "kernels/weight_cache.h"

namespace viaduct::ops {

bool adamw_kernel_runs(const at::Tensor& p, const KernelOptions& k) { return fused_runs(p, k); }

void adamw_kernel_step_(const std::vector<AdamWParam>& params, const AdamWStep& s,
                        const KernelOptions& k) {
  auto* cache = k.weight_cache.get();
  // See Note [AdamW over many tensors in one launch] (kernels/adamw.cu):
  // every tensor the launch takes goes in it, after the few others, the
  // same bits.
  std::vector<kernels::AdamWTensors> many;
  for (const auto& ap : params) {
    const auto& pr = ap.param;
    auto data = pr.detach();
    auto m = ap.exp_avg, v = ap.exp_avg_sq;
    // The weight's bf16 copy, where a forward made one, is written in the
    // same pass (see Note [Low-precision weight cache]).
    const auto low = cache != nullptr ? cache->slot_for(pr) : at::Tensor();
    const double wd = ap.weight_decay;
    // A copy that holds the weight beside another along a later dim (the
    // experts' w1 and w3 as one [E, 2H, D] copy) is written by the leading
    // index: each index's part of it is contiguous. The update is
    // elementwise, so the pieces give the bits of one call.
    const auto g = pr.grad();
    std::vector<kernels::AdamWTensors> pieces;
    if (low.defined() && !low.is_contiguous()) {
      for (int64_t i = 0; i < data.size(0); ++i) {
        pieces.push_back({data[i], g[i], m[i], v[i], low[i], wd});
      }
    } else {
      pieces.push_back({data, g, m, v, low, wd});
    }
    for (auto& t : pieces) {
      if (kernels::adamw_many_takes(t)) {
        many.push_back(std::move(t));
      } else {
        kernels::adamw_(t.p, t.g, t.m, t.v, s.lr, s.beta1, s.beta2, s.eps, wd, s.bias_corr1,
                        s.bias_corr2, t.low, s.grad_scale, s.scale_dev);
      }
    }
    // Raw writes move no version counter: say that the weight changed.
    if (low.defined()) {
      cache->mark_written(pr);
    } else {
      torch::autograd::impl::bump_version(pr);
    }
  }
  kernels::adamw_many_(many, s.lr, s.beta1, s.beta2, s.eps, s.bias_corr1, s.bias_corr2,
                       s.grad_scale, s.scale_dev);
}

}  // namespace viaduct::ops
