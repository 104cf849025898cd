// Sums over process groups for the trainer (see reduce.h).
#include "train/reduce.h"

#include <algorithm>

#include "core/check.h"
#include "distributed/distributed.h"

namespace viaduct {

void sum_over(distributed::ProcessGroup* group, std::vector<double>& values,
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
                                              const std::vector<int64_t>& stage_of,
                                              const std::vector<bool>& own_bucket,
                                              const std::vector<bool>& skip) {
  VIADUCT_CHECK(stage_of.empty() || stage_of.size() == params.size(),
                "grad_buckets: ", stage_of.size(), " stages for ", params.size(), " parameters");
  auto flag = [](const std::vector<bool>& v, size_t i) { return !v.empty() && v.at(i); };
  std::vector<std::vector<size_t>> buckets;
  int64_t bytes = 0;
  // A parameter with a bucket of its own, or none, ends the bucket before
  // it: the other buckets are the same whichever of the two it has.
  bool closed = true;
  for (size_t i = 0; i < params.size(); ++i) {
    if (flag(skip, i)) {
      closed = true;
      continue;
    }
    const auto& p = params[i].param;
    const size_t prev = buckets.empty() ? 0 : buckets.back().back();
    if (closed || bytes >= bucket_bytes ||
        p.scalar_type() != params[prev].param.scalar_type() ||
        (!stage_of.empty() && stage_of[i] != stage_of[prev]) || flag(own_bucket, i)) {
      closed = flag(own_bucket, i);
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().push_back(i);
    bytes += p.numel() * static_cast<int64_t>(p.element_size());
  }
  return buckets;
}

ShardLayout shard_layout(const std::vector<int64_t>& numels,
                         const std::vector<std::vector<size_t>>& buckets, int dp,
                         const std::vector<int64_t>& units) {
  VIADUCT_CHECK(dp >= 1, "shard_layout: dp must be positive, got ", dp);
  ShardLayout layout;
  for (const auto& bucket : buckets) {
    std::vector<int64_t> starts;  // of each parameter in the bucket's flattening
    int64_t n = 0;
    for (size_t i : bucket) {
      starts.push_back(n);
      n += numels.at(i);
    }
    // Boundaries x_0 = 0 <= x_1 <= ... <= x_dp = n; moving each down inside
    // its parameter keeps them ordered.
    std::vector<int64_t> x(static_cast<size_t>(dp) + 1, n);
    x[0] = 0;
    for (int r = 1; r < dp; ++r) {
      const int64_t nominal = n * r / dp;
      size_t k = 0;
      while (k + 1 < bucket.size() && starts[k + 1] <= nominal) ++k;
      const int64_t unit =
          bucket.empty() || units.empty() || units.at(bucket[k]) == 0 ? kShardAlign
                                                                      : units.at(bucket[k]);
      x[static_cast<size_t>(r)] =
          bucket.empty() ? 0 : starts[k] + (nominal - starts[k]) / unit * unit;
    }
    std::vector<std::vector<ShardSegment>> per_rank(static_cast<size_t>(dp));
    for (int r = 0; r < dp; ++r) {
      const int64_t lo = x[static_cast<size_t>(r)], hi = x[static_cast<size_t>(r) + 1];
      for (size_t k = 0; k < bucket.size(); ++k) {
        const int64_t ps = starts[k], pe = ps + numels[bucket[k]];
        const int64_t b = std::max(lo, ps), e = std::min(hi, pe);
        if (b < e) per_rank[static_cast<size_t>(r)].push_back({bucket[k], b - ps, e - ps});
      }
    }
    layout.segments.push_back(std::move(per_rank));
  }
  return layout;
}

int64_t segment_elements(const std::vector<ShardSegment>& segs) {
  int64_t n = 0;
  for (const auto& s : segs) n += s.end - s.begin;
  return n;
}

at::Tensor segment_of(const at::Tensor& t, const ShardSegment& s) {
  return t.reshape(-1).slice(0, s.begin, s.end);
}

RangeGather start_range_gather(distributed::ProcessGroup& group,
                               const std::vector<std::vector<ShardSegment>>& per_rank,
                               const at::Tensor& mine) {
  int64_t chunk = 0;
  for (const auto& segs : per_rank) chunk = std::max(chunk, segment_elements(segs));
  RangeGather g;
  if (chunk == 0) return g;
  auto padded = at::zeros({chunk}, mine.options());
  padded.narrow(0, 0, mine.numel()).copy_(mine);
  g.outputs.resize(1);
  for (size_t r = 0; r < per_rank.size(); ++r) g.outputs[0].push_back(at::empty_like(padded));
  std::vector<at::Tensor> inputs{padded};
  g.work = group.allgather(g.outputs, inputs);
  g.bytes_sent = chunk * static_cast<int64_t>(per_rank.size() - 1) *
                 static_cast<int64_t>(padded.element_size());
  return g;
}

void copy_gathered_ranges(const RangeGather& gather,
                          const std::vector<std::vector<ShardSegment>>& per_rank,
                          const std::function<at::Tensor(const ShardSegment&)>& dest,
                          size_t skip) {
  if (gather.outputs.empty()) return;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    if (r == skip) continue;
    int64_t off = 0;
    for (const auto& s : per_rank[r]) {
      dest(s).copy_(gather.outputs[0][r].narrow(0, off, s.end - s.begin));
      off += s.end - s.begin;
    }
  }
}

GradReduction::GradReduction(distributed::ProcessGroup& group, const std::vector<NamedParam>& params,
                             std::vector<std::vector<size_t>> buckets,
                             std::vector<int64_t> stage_of, bool whole,
                             const std::vector<int64_t>& units)
    : group_(group),
      params_(params),
      stage_of_(std::move(stage_of)),
      buckets_(std::move(buckets)),
      whole_(whole),
      started_(buckets_.size(), false) {
  std::vector<int64_t> numels;
  for (const auto& np : params_) numels.push_back(np.param.numel());
  layout_ = shard_layout(numels, buckets_, group_.size(), units);
}

void GradReduction::start(size_t b) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> flat_parts;
  for (size_t i : buckets_[b]) {
    const auto& p = params_[i].param;
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    flat_parts.push_back(p.grad().reshape(-1));
  }
  // The ranges lie in replica order in the flattening: range r goes to
  // replica r, and this replica receives its range from every replica.
  auto send = at::cat(flat_parts);
  const auto& per_rank = layout_.segments[b];
  const auto me = static_cast<size_t>(group_.rank());
  std::vector<int64_t> send_splits;
  for (const auto& segs : per_rank) send_splits.push_back(segment_elements(segs));
  const int64_t mine = send_splits[me];
  auto recv = at::empty({mine * group_.size()}, send.options());
  auto work = group_.alltoall(recv, send, std::vector<int64_t>(per_rank.size(), mine),
                              send_splits);
  bytes_sent_ += (send.numel() - mine) * static_cast<int64_t>(send.element_size());
  in_flight_.push_back({b, std::move(send), std::move(recv), std::move(work)});
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
  const auto me = static_cast<size_t>(group_.rank());
  const int dp = group_.size();
  // The whole sums' all-gathers, started bucket by bucket as their ranges
  // are summed.
  std::vector<std::pair<size_t, RangeGather>> gathers;
  for (auto& f : in_flight_) {
    f.work.wait(str(context, " data-parallel gradient reduce-scatter"));
    const auto& per_rank = layout_.segments[f.bucket];
    const int64_t mine = segment_elements(per_rank[me]);
    // Replica order, one addition at a time: the order is fixed whatever dp.
    at::Tensor sum = f.recv.narrow(0, 0, mine);
    if (dp > 1) {
      sum = sum.add(f.recv.narrow(0, mine, mine));
      for (int r = 2; r < dp; ++r) sum.add_(f.recv.narrow(0, r * mine, mine));
    }
    if (!whole_) {
      int64_t off = 0;
      for (const auto& s : per_rank[me]) {
        segment_of(params_[s.param].param.mutable_grad(), s)
            .copy_(sum.narrow(0, off, s.end - s.begin));
        off += s.end - s.begin;
      }
      continue;
    }
    auto g = start_range_gather(group_, per_rank, sum);
    bytes_sent_ += g.bytes_sent;
    gathers.emplace_back(f.bucket, std::move(g));
  }
  for (auto& [bucket, g] : gathers) {
    if (g.outputs.empty()) continue;
    g.work.wait(str(context, " data-parallel gradient all-gather"));
    copy_gathered_ranges(
        g, layout_.segments[bucket],
        [&](const ShardSegment& s) { return segment_of(params_[s.param].param.mutable_grad(), s); },
        static_cast<size_t>(dp));  // every replica's range, this one's included
  }
  in_flight_.clear();
  started_.assign(buckets_.size(), false);
  last_step_bytes_ = bytes_sent_;
  bytes_sent_ = 0;
  return early;
}

std::vector<GradReduction::NormPiece> GradReduction::norm_pieces() const {
  const auto dp = static_cast<size_t>(group_.size());
  const auto me = static_cast<size_t>(group_.rank());
  std::vector<NormPiece> pieces;
  for (const auto& per_rank : layout_.segments) {
    for (size_t r = 0; r < dp; ++r) {
      if (!whole_ && r != me) continue;
      for (const auto& s : per_rank[r]) {
        const auto& g = params_[s.param].param.grad();
        const bool all = s.begin == 0 && s.end == g.numel();
        pieces.push_back({s.param * dp + r, all ? g : segment_of(g, s)});
      }
    }
  }
  // Slot order: parameter, then replica (norm_pieces' contract).
  std::stable_sort(pieces.begin(), pieces.end(),
                   [](const NormPiece& a, const NormPiece& b) { return a.slot < b.slot; });
  return pieces;
}

}  // namespace viaduct
