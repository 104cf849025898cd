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

void allreduce_grads(dist::ProcessGroup& group, const std::vector<NamedParam>& params,
                     int64_t bucket_bytes, const std::string& context) {
  size_t i = 0;
  while (i < params.size()) {
    std::vector<at::Tensor> grads;
    int64_t bytes = 0;
    at::ScalarType dtype = at::kFloat;
    for (; i < params.size(); ++i) {
      const auto& p = params[i].param;
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      if (!grads.empty() && (bytes >= bucket_bytes || p.grad().scalar_type() != dtype)) break;
      dtype = p.grad().scalar_type();
      grads.push_back(p.grad());
      bytes += p.grad().numel() * static_cast<int64_t>(p.grad().element_size());
    }
    std::vector<at::Tensor> flat{at::cat([&] {
      std::vector<at::Tensor> f;
      for (auto& g : grads) f.push_back(g.reshape(-1));
      return f;
    }())};
    group.allreduce(flat).wait(str(context, " data-parallel gradient all-reduce"));
    int64_t off = 0;
    torch::NoGradGuard no_grad;
    for (auto& g : grads) {
      g.copy_(flat[0].slice(0, off, off + g.numel()).view_as(g));
      off += g.numel();
    }
  }
}

}  // namespace viaduct
