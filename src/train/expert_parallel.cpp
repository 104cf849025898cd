// Expert parallelism in the trainer (see expert_parallel.h).
#include "train/expert_parallel.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <numeric>

#include "checkpoint/tensor_index.h"
#include "core/check.h"
#include "distributed/distributed.h"
#include "model/moe.h"

namespace viaduct {
namespace ck = checkpoint;

namespace {

constexpr const char* kExpertWeights[] = {"experts.w1", "experts.w2", "experts.w3"};

// An MoE layer's exchange over the ep group: the rows travel as one 1-D
// all-to-all on the group's device.
class GroupExchange : public ExpertExchange {
 public:
  GroupExchange(distributed::ProcessGroup& group, std::string context,
                std::shared_ptr<ExpertExchangeStats> stats)
      : group_(group), context_(std::move(context)), stats_(std::move(stats)) {}
  int rank() const override { return group_.rank(); }
  int size() const override { return group_.size(); }
  at::Tensor exchange(const at::Tensor& rows, const std::vector<int64_t>& send,
                      const std::vector<int64_t>& recv) override {
    int64_t row = 1;
    for (int64_t d = 1; d < rows.dim(); ++d) row *= rows.size(d);
    auto scaled = [row](std::vector<int64_t> v) {
      for (auto& x : v) x *= row;
      return v;
    };
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t n_recv = std::accumulate(recv.begin(), recv.end(), int64_t{0});
    auto in = rows.to(group_.device()).contiguous().reshape({-1});
    auto out = at::empty({n_recv * row}, in.options());
    group_.alltoall(out, in, scaled(recv), scaled(send)).wait(context_);
    if (stats_) {
      const int64_t away = in.numel() - send.at(static_cast<size_t>(group_.rank())) * row;
      stats_->bytes_sent += away * static_cast<int64_t>(in.element_size());
      stats_->seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    auto shape = rows.sizes().vec();
    shape[0] = n_recv;
    return out.view(shape).to(rows.device());
  }

 private:
  distributed::ProcessGroup& group_;
  std::string context_;
  std::shared_ptr<ExpertExchangeStats> stats_;
};

// Every MoE layer of `part` with its module FQN ("layers.3.moe").
std::vector<std::pair<std::string, MoeImpl*>> moe_layers(torch::nn::Module& part) {
  std::vector<std::pair<std::string, MoeImpl*>> out;
  for (const auto& item : part.named_modules()) {
    if (auto* moe = dynamic_cast<MoeImpl*>(item.value().get())) {
      out.emplace_back(item.key(), moe);
    }
  }
  return out;
}

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

}  // namespace

void shard_moe_experts(torch::nn::Module& part, distributed::ProcessGroup& ep_group,
                       const std::string& context,
                       std::shared_ptr<ExpertExchangeStats> stats, bool per_source) {
  for (auto& [name, moe] : moe_layers(part)) {
    moe->shard_experts(
        std::make_shared<GroupExchange>(
            ep_group, str(context, " ", name, " expert all-to-all over ", ep_group.name()), stats),
        per_source);
  }
}

std::vector<MoeLayerRef> moe_layer_refs(torch::nn::Module& part) {
  std::vector<MoeLayerRef> out;
  for (auto& [name, moe] : moe_layers(part)) {
    // "layers.<i>.moe"
    const std::string prefix = "layers.";
    int64_t layer = -1;
    if (name.rfind(prefix, 0) == 0) layer = std::atoll(name.c_str() + prefix.size());
    VIADUCT_ASSERT(layer >= 0, "an MoE layer outside layers.<i>: ", name);
    out.push_back({layer, moe});
  }
  return out;
}

std::vector<ExpertShard> expert_shards(torch::nn::Module& part) {
  std::vector<ExpertShard> out;
  for (auto& [name, moe] : moe_layers(part)) {
    if (!moe->experts_sharded()) continue;
    for (size_t w = 0; w < 3; ++w) {
      out.push_back({join(name, kExpertWeights[w]), moe, w, moe->first_local_expert(),
                     moe->local_experts(), moe->opts_.n_routed_experts});
    }
  }
  return out;
}

std::vector<std::pair<std::string, int64_t>> routed_expert_tensors(torch::nn::Module& part) {
  std::vector<std::pair<std::string, int64_t>> out;
  for (auto& [name, moe] : moe_layers(part)) {
    for (const auto* w : kExpertWeights) out.emplace_back(join(name, w), moe->local_experts());
  }
  return out;
}

// ---- the gradient sum --------------------------------------------------------

ExpertGradReduction::ExpertGradReduction(distributed::ProcessGroup* replicas, int dp, int ep,
                                         int ep_rank, const std::vector<NamedParam>& params,
                                         std::vector<ExpertShard> shards, bool whole)
    : replicas_(replicas),
      dp_(dp),
      ep_(ep),
      ep_rank_(ep_rank),
      members_(dp / ep),
      member_(replicas != nullptr ? replicas->rank() : 0),
      params_(params),
      shards_(std::move(shards)),
      whole_(whole) {
  VIADUCT_ASSERT(ep >= 1 && dp % ep == 0, "dp ", dp, " ep ", ep);
  VIADUCT_ASSERT(members_ == 1 || (replicas != nullptr && replicas->size() == members_),
                 "the expert-replica group has ", replicas ? replicas->size() : 0,
                 " ranks, expected ", members_);
  for (const auto& s : shards_) {
    const auto it = std::find_if(params_.begin(), params_.end(),
                                 [&](const NamedParam& p) { return p.fqn == s.fqn; });
    VIADUCT_ASSERT(it != params_.end(), "the expert tensor ", s.fqn, " is not trained");
    param_index_.push_back(static_cast<size_t>(it - params_.begin()));
  }
}

std::pair<int64_t, int64_t> ExpertGradReduction::range(size_t shard, int member) const {
  const auto& s = shards_[shard];
  const int64_t unit = params_[param_index_[shard]].param.numel() / s.rows;
  return {s.rows * member / members_ * unit, s.rows * (member + 1) / members_ * unit};
}

void ExpertGradReduction::finish(const std::string& context) {
  torch::NoGradGuard no_grad;
  // Each MoE layer's gradients once, by layer.
  std::vector<MoeImpl*> layers;
  std::vector<std::vector<std::vector<at::Tensor>>> taken;
  std::vector<std::vector<at::Tensor>> sources(shards_.size());  // [shard][source]
  for (size_t k = 0; k < shards_.size(); ++k) {
    auto* moe = shards_[k].moe;
    auto it = std::find(layers.begin(), layers.end(), moe);
    if (it == layers.end()) {
      layers.push_back(moe);
      taken.push_back(moe->take_source_grads());
      it = layers.end() - 1;
    }
    const auto& per_source = taken[static_cast<size_t>(it - layers.begin())];
    VIADUCT_ASSERT(static_cast<int>(per_source.size()) == ep_ || per_source.size() == 1,
                   shards_[k].fqn, ": ", per_source.size(), " sources, ep ", ep_);
    const auto& p = params_[param_index_[k]].param;
    for (const auto& g : per_source) {
      // No token of that source reached these experts: a zero gradient, as
      // the unsharded weight's stacked gradient holds for them.
      sources[k].push_back(g[shards_[k].weight].defined()
                               ? g[shards_[k].weight].reshape({-1})
                               : at::zeros({p.numel()}, p.options()));
    }
  }
  int64_t bytes = 0;
  // Adds the pieces in order, as GradReduction::finish does.
  auto fold = [](const std::vector<at::Tensor>& pieces) {
    at::Tensor sum = pieces[0];
    if (pieces.size() > 1) {
      sum = sum.add(pieces[1]);
      for (size_t i = 2; i < pieces.size(); ++i) sum.add_(pieces[i]);
    }
    return sum;
  };
  for (size_t k = 0; k < shards_.size(); ++k) {
    auto& param = params_[param_index_[k]].param;
    if (members_ == 1) {
      param.mutable_grad() = fold(sources[k]).view(param.sizes());
      continue;
    }
    // Range m of every source to member m; the pieces arrive by block,
    // each block's by source: replica order.
    const auto n_sources = static_cast<int64_t>(sources[k].size());
    std::vector<at::Tensor> send_parts;
    std::vector<int64_t> send_splits, recv_splits;
    for (int m = 0; m < members_; ++m) {
      const auto [b, e] = range(k, m);
      for (const auto& g : sources[k]) send_parts.push_back(g.slice(0, b, e));
      send_splits.push_back(n_sources * (e - b));
    }
    const auto [mb, me] = range(k, member_);
    const int64_t mine = me - mb;
    recv_splits.assign(static_cast<size_t>(members_), n_sources * mine);
    auto send = at::cat(send_parts);
    auto recv = at::empty({mine * n_sources * members_}, send.options());
    replicas_->alltoall(recv, send, recv_splits, send_splits)
        .wait(str(context, " expert gradient reduce-scatter of ", shards_[k].fqn));
    bytes += (send.numel() - send_splits[static_cast<size_t>(member_)]) *
             static_cast<int64_t>(send.element_size());
    std::vector<at::Tensor> pieces;
    for (int64_t r = 0; r < n_sources * members_; ++r) {
      pieces.push_back(recv.narrow(0, r * mine, mine));
    }
    const auto sum = fold(pieces);
    if (!param.grad().defined()) param.mutable_grad() = at::zeros_like(param);
    auto flat = param.mutable_grad().view({-1});
    if (!whole_) {
      flat.slice(0, mb, me).copy_(sum);
      continue;
    }
    // The summed ranges to every member.
    std::vector<std::vector<ShardSegment>> per_member;
    for (int m = 0; m < members_; ++m) {
      const auto [b, e] = range(k, m);
      per_member.push_back(b < e ? std::vector<ShardSegment>{{0, b, e}}
                                 : std::vector<ShardSegment>{});
    }
    auto gather = start_range_gather(*replicas_, per_member, sum);
    bytes += gather.bytes_sent;
    if (!gather.outputs.empty()) {
      gather.work.wait(str(context, " expert gradient all-gather of ", shards_[k].fqn));
      copy_gathered_ranges(
          gather, per_member, [&](const ShardSegment& s) { return flat.slice(0, s.begin, s.end); },
          static_cast<size_t>(members_));
    }
  }
  last_step_bytes_ = bytes;
}

std::vector<GradReduction::NormPiece> ExpertGradReduction::norm_pieces() const {
  std::vector<GradReduction::NormPiece> out;
  const auto dp = static_cast<size_t>(dp_);
  for (size_t k = 0; k < shards_.size(); ++k) {
    const auto& g = params_[param_index_[k]].param.grad();
    const auto [b, e] = range(k, member_);
    if (b == e) continue;
    const auto q = static_cast<size_t>(ep_rank_ * members_ + member_);
    out.push_back({param_index_[k] * dp + q,
                   b == 0 && e == g.numel() ? g : g.reshape({-1}).slice(0, b, e)});
  }
  return out;
}

// ---- checkpoints ---------------------------------------------------------------

void store_experts_as_pieces(ck::CheckpointPart& part, const std::vector<ExpertShard>& shards,
                             bool keep_rest) {
  // The FQN a tensor of the part belongs to: the weight itself or
  // "optim.<state>.<fqn>".
  auto shard_of = [&](const std::string& name) -> const ExpertShard* {
    for (const auto& s : shards) {
      if (name == s.fqn) return &s;
      if (name.rfind("optim.", 0) == 0 && name.size() > s.fqn.size() &&
          name.compare(name.size() - s.fqn.size(), s.fqn.size(), s.fqn) == 0 &&
          name[name.size() - s.fqn.size() - 1] == '.') {
        return &s;
      }
    }
    return nullptr;
  };
  ck::NamedTensors kept;
  std::vector<ck::TensorPiece> pieces;
  for (auto& [name, t] : part.tensors) {
    const auto* s = shard_of(name);
    // A per-tensor scalar (a step count) is the same on every rank: the
    // first writer keeps it whole.
    if (s == nullptr || t.dim() == 0 || t.size(0) != s->rows) {
      if (keep_rest) kept.emplace_back(name, t);
      continue;
    }
    auto shape = t.sizes().vec();
    shape[0] = s->whole_rows;
    const int64_t row = t.numel() / s->rows;
    pieces.push_back({name, shape, s->first_row * row, t.contiguous().reshape({-1})});
  }
  auto [entries, meta] = ck::piece_entries(pieces);
  for (auto& e : entries) kept.push_back(std::move(e));
  part.tensors = std::move(kept);
  for (auto& [k, v] : meta) {
    auto it = part.metadata.find(k);
    if (it == part.metadata.end()) {
      part.metadata[k] = v;
      continue;
    }
    // Both tables list pieces: one table of both.
    auto merged = nlohmann::json::parse(it->second);
    merged.update(nlohmann::json::parse(v));
    it->second = merged.dump();
  }
}

void load_part_tensors(const ck::TensorFileIndex& index, torch::nn::Module& part) {
  const auto shards = expert_shards(part);
  if (shards.empty()) {
    index.load_into(part);
    return;
  }
  ck::NamedTensors whole;
  for (const auto& item : part.named_parameters(/*recurse=*/true)) {
    const bool sharded = std::any_of(shards.begin(), shards.end(),
                                     [&](const ExpertShard& s) { return s.fqn == item.key(); });
    if (!sharded) whole.emplace_back(item.key(), item.value());
  }
  index.load_into(whole);
  torch::NoGradGuard no_grad;
  for (const auto& s : shards) {
    auto dest = part.named_parameters(/*recurse=*/true)[s.fqn];
    const auto info = index.info(s.fqn);
    auto want = dest.sizes().vec();
    want[0] = s.whole_rows;
    VIADUCT_CHECK_T(FileError, info.shape == want, "checkpoint tensor ", s.fqn, " has shape ",
                    c10::IntArrayRef(info.shape), ", the model's is ", c10::IntArrayRef(want));
    dest.copy_(index.load_rows(s.fqn, s.first_row, s.rows));
  }
}

}  // namespace viaduct
