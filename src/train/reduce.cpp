// Sums over process groups for the trainer (see reduce.h).
#include "train/reduce.h"

#include "core/check.h"
#include "dist/dist.h"

namespace viaduct {

void sum_over(dist::ProcessGroup* group, std::vector<double>& values,
              const std::string& context, const std::string& what) {
  if (group == nullptr || group->size() == 1 || values.empty()) return;
  auto t = at::tensor(values, at::TensorOptions().dtype(at::kDouble)).to(group->device());
  std::vector<at::Tensor> ts{t};
  group->allreduce(ts).wait(str(context, " all-reduce of ", what, " over ", group->name()));
  auto c = ts[0].cpu();
  for (size_t i = 0; i < values.size(); ++i) values[i] = c[static_cast<int64_t>(i)].item<double>();
}

std::vector<std::vector<size_t>> grad_buckets(const std::vector<NamedParam>& params,
                                              int64_t bucket_bytes) {
  std::vector<std::vector<size_t>> buckets;
  int64_t bytes = 0;
  at::ScalarType dtype = at::kFloat;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i].param;
    if (buckets.empty() || bytes >= bucket_bytes || p.scalar_type() != dtype) {
      buckets.emplace_back();
      bytes = 0;
    }
    dtype = p.scalar_type();
    buckets.back().push_back(i);
    bytes += p.numel() * static_cast<int64_t>(p.element_size());
  }
  return buckets;
}

void allreduce_grads(dist::ProcessGroup& group, const std::vector<NamedParam>& params,
                     int64_t bucket_bytes, const std::string& context) {
  torch::NoGradGuard no_grad;
  for (const auto& bucket : grad_buckets(params, bucket_bytes)) {
    std::vector<at::Tensor> grads, flat_parts;
    for (size_t i : bucket) {
      const auto& p = params[i].param;
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      grads.push_back(p.grad());
      flat_parts.push_back(p.grad().reshape(-1));
    }
    std::vector<at::Tensor> flat{at::cat(flat_parts)};
    group.allreduce(flat).wait(str(context, " data-parallel gradient all-reduce"));
    int64_t off = 0;
    for (auto& g : grads) {
      g.copy_(flat[0].slice(0, off, off + g.numel()).view_as(g));
      off += g.numel();
    }
  }
}

}  // namespace viaduct
