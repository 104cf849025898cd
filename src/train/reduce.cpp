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
                                              int64_t bucket_bytes,
                                              const std::vector<int64_t>& stage_of) {
  VIADUCT_CHECK(stage_of.empty() || stage_of.size() == params.size(),
                "grad_buckets: ", stage_of.size(), " stages for ", params.size(), " parameters");
  std::vector<std::vector<size_t>> buckets;
  int64_t bytes = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i].param;
    const size_t prev = buckets.empty() ? 0 : buckets.back().back();
    if (buckets.empty() || bytes >= bucket_bytes ||
        p.scalar_type() != params[prev].param.scalar_type() ||
        (!stage_of.empty() && stage_of[i] != stage_of[prev])) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().push_back(i);
    bytes += p.numel() * static_cast<int64_t>(p.element_size());
  }
  return buckets;
}

GradReduction::GradReduction(dist::ProcessGroup& group, const std::vector<NamedParam>& params,
                             std::vector<std::vector<size_t>> buckets,
                             std::vector<int64_t> stage_of)
    : group_(group),
      params_(params),
      stage_of_(std::move(stage_of)),
      buckets_(std::move(buckets)),
      started_(buckets_.size(), false) {}

void GradReduction::start(size_t b) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> flat_parts;
  for (size_t i : buckets_[b]) {
    const auto& p = params_[i].param;
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    flat_parts.push_back(p.grad().reshape(-1));
  }
  std::vector<at::Tensor> flat{at::cat(flat_parts)};
  auto work = group_.allreduce(flat);
  in_flight_.push_back({b, flat[0], std::move(work)});
  started_[b] = true;
}

void GradReduction::stage_ready(int64_t stage) {
  // The buckets started by earlier calls overlap this stage's backward.
  overlapped_ = static_cast<int64_t>(in_flight_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const size_t first = buckets_[b].front();
    if (!started_[b] && (stage_of_.empty() || stage_of_[first] == stage)) start(b);
  }
}

int64_t GradReduction::finish(const std::string& context) {
  const auto early = overlapped_;
  overlapped_ = 0;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!started_[b]) start(b);
  }
  torch::NoGradGuard no_grad;
  for (auto& f : in_flight_) {
    f.work.wait(str(context, " data-parallel gradient all-reduce"));
    int64_t off = 0;
    for (size_t i : buckets_[f.bucket]) {
      auto& g = params_[i].param.mutable_grad();
      g.copy_(f.flat.slice(0, off, off + g.numel()).view_as(g));
      off += g.numel();
    }
  }
  in_flight_.clear();
  started_.assign(buckets_.size(), false);
  return early;
}

}  // namespace viaduct
