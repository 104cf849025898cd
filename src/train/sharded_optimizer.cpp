// ZeRO-1 (see Note [ZeRO-1] in sharded_optimizer.h).
#include "train/sharded_optimizer.h"

#include <c10/util/accumulate.h>

#include <algorithm>

#include "checkpoint/tensor_index.h"
#include "core/check.h"
#include "distributed/distributed.h"

namespace viaduct {

ShardedOptimizer::ShardedOptimizer(std::vector<NamedParam> params,
                                   distributed::ProcessGroup& dp_group,
                                   std::vector<std::vector<size_t>> buckets,
                                   const MakeInner& make_inner,
                                   const std::vector<int64_t>& units,
                                   distributed::ProcessGroup* expert_group,
                                   std::vector<std::vector<size_t>> expert_buckets)
    : Optimizer(std::move(params)), buckets_(std::move(buckets)) {
  VIADUCT_ASSERT(expert_buckets.empty() || expert_group != nullptr,
                 "expert buckets without their group");
  std::vector<int64_t> numels;
  for (const auto& np : params_) {
    VIADUCT_CHECK(np.param.is_contiguous(), "ZeRO-1: parameter '", np.fqn,
                  "' is not contiguous");
    numels.push_back(np.param.numel());
  }
  layout_ = shard_layout(numels, buckets_, dp_group.size(), units);
  groups_.assign(buckets_.size(), &dp_group);
  if (!expert_buckets.empty()) {
    auto experts = shard_layout(numels, expert_buckets, expert_group->size(), units);
    for (auto& per_rank : experts.segments) layout_.segments.push_back(std::move(per_rank));
    for (auto& b : expert_buckets) {
      buckets_.push_back(std::move(b));
      groups_.push_back(expert_group);
    }
  }
  std::vector<NamedParam> slices;
  torch::NoGradGuard no_grad;
  for (size_t b = 0; b < layout_.segments.size(); ++b) {
    const auto& per_rank = layout_.segments[b];
    for (const auto& s : per_rank[static_cast<size_t>(groups_[b]->rank())]) {
      const auto& np = params_[s.param];
      // A detached view shares the parameter's storage and version counter:
      // the inner optimizer's in-place update writes the weights and moves
      // the counter the weight cache watches.
      slices.push_back({np.fqn, segment_of(np.param.detach(), s), np.weight_decay});
      mine_.push_back(s);
    }
  }
  inner_ = make_inner(std::move(slices));
}

int64_t ShardedOptimizer::owned_elements() const { return segment_elements(mine_); }

void ShardedOptimizer::update(const std::function<void()>& run) {
  torch::NoGradGuard no_grad;
  const auto& slices = inner_->params();
  for (size_t k = 0; k < mine_.size(); ++k) {
    const auto& g = params_[mine_[k].param].param.grad();
    auto slice = slices[k].param;
    slice.mutable_grad() = g.defined() ? segment_of(g, mine_[k]) : at::Tensor();
  }
  inner_->set_steps_taken(steps_);
  struct Detach {  // the slices never keep the gradients alive
    Optimizer& inner;
    ~Detach() { inner.zero_grad(); }
  } detach{*inner_};
  run();
  steps_ = inner_->steps_taken();
  all_gather_weights();
}

void ShardedOptimizer::step(double lr) {
  update([&] { inner_->step(lr); });
}

void ShardedOptimizer::step_scaled(double lr, double grad_scale) {
  update([&] { inner_->step_scaled(lr, grad_scale); });
}

void ShardedOptimizer::step_device_scaled(double lr, const at::Tensor& scale) {
  update([&] { inner_->step_device_scaled(lr, scale); });
}

void ShardedOptimizer::all_gather_weights() {
  torch::NoGradGuard no_grad;
  last_step_bytes_ = 0;
  for (size_t b = 0; b < layout_.segments.size(); ++b) {
    auto& group = *groups_[b];
    const auto me = static_cast<size_t>(group.rank());
    const auto& per_rank = layout_.segments[b];
    // This replica's range flattened; empty, it still joins the gather.
    std::vector<at::Tensor> pieces{at::empty({0}, params_[buckets_[b].front()].param.options())};
    for (const auto& s : per_rank[me]) pieces.push_back(segment_of(params_[s.param].param, s));
    auto g = start_range_gather(group, per_rank, at::cat(pieces));
    if (g.outputs.empty()) continue;
    last_step_bytes_ += g.bytes_sent;
    g.work.wait(str("ZeRO-1 all-gather of the updated weights over ", group.name()));
    copy_gathered_ranges(
        g, per_rank,
        [&](const ShardSegment& s) { return segment_of(params_[s.param].param.detach(), s); }, me);
  }
}

size_t ShardedOptimizer::slice_of_state_key(const std::string& key) const {
  // "optim.<slot>.<fqn>" (checkpoint::optim_state_fqn; slot names have no
  // dots): the inner optimizer's parameter of that FQN.
  const std::string prefix = "optim.";
  const auto dot = key.find('.', prefix.size());
  VIADUCT_CHECK(key.rfind(prefix, 0) == 0 && dot != std::string::npos,
                "ZeRO-1: optimizer state '", key, "' is not named optim.<slot>.<parameter>");
  const auto fqn = key.substr(dot + 1);
  const auto& slices = inner_->params();
  for (size_t k = 0; k < slices.size(); ++k) {
    if (slices[k].fqn == fqn) return k;
  }
  throw Error(str("ZeRO-1: optimizer state '", key, "' names no parameter of this replica"));
}

std::vector<std::pair<std::string, at::Tensor>> ShardedOptimizer::state_pieces(
    std::map<std::string, std::string>* metadata) const {
  std::vector<checkpoint::TensorPiece> pieces;
  for (const auto& [name, t] : inner_->state()) {
    const auto& seg = mine_[slice_of_state_key(name)];
    const auto& np = params_[seg.param];
    // A sharded expert tensor's rows sit at their place in the whole one.
    auto shape = np.param.sizes().vec();
    int64_t offset = seg.begin;
    if (np.whole_rows > 0) {
      offset += np.first_row * (np.param.numel() / np.param.size(0));
      shape[0] = np.whole_rows;
    }
    pieces.push_back({name, shape, offset, t.reshape(-1)});
  }
  auto [tensors, meta] = checkpoint::piece_entries(pieces);
  if (metadata) *metadata = std::move(meta);
  return tensors;
}

std::vector<std::pair<std::string, at::Tensor>> ShardedOptimizer::state() const {
  return state_pieces(nullptr);
}

std::map<std::string, std::string> ShardedOptimizer::state_file_metadata() const {
  std::map<std::string, std::string> meta;
  state_pieces(&meta);
  return meta;
}

std::pair<int64_t, int64_t> ShardedOptimizer::kept_range(const std::string& key,
                                                         const std::vector<int64_t>& shape) const {
  const auto& seg = mine_[slice_of_state_key(key)];
  const auto& np = params_[seg.param];
  const int64_t stored = c10::multiply_integers(shape);
  // A sharded expert tensor's state is stored whole: its rows first.
  const bool whole_expert = np.whole_rows > 0 && !shape.empty() && shape[0] == np.whole_rows;
  const int64_t row = whole_expert ? stored / np.whole_rows : 0;
  const int64_t rows = whole_expert ? row * np.param.size(0) : stored;
  VIADUCT_CHECK_T(FileError, rows == np.param.numel(), "optimizer state '", key, "' has ",
                  stored, " elements, expected ", np.param.numel());
  const int64_t offset = whole_expert ? np.first_row * row : 0;
  return {offset + seg.begin, offset + seg.end};
}

void ShardedOptimizer::load_state(const std::map<std::string, at::Tensor>& tensors) {
  std::map<std::string, at::Tensor> slices;
  for (const auto& key : inner_->state_keys()) {
    auto it = tensors.find(key);
    VIADUCT_CHECK_T(FileError, it != tensors.end(), "optimizer state '", key,
                    "' is missing from the checkpoint");
    const auto [begin, end] = kept_range(key, it->second.sizes().vec());
    slices[key] = it->second.reshape(-1).slice(0, begin, end).clone();
  }
  inner_->load_state(slices);
}

void ShardedOptimizer::load_from(const checkpoint::TensorFileIndex& index) {
  // Only this replica's elements of each state are read.
  std::map<std::string, at::Tensor> slices;
  for (const auto& key : inner_->state_keys()) {
    VIADUCT_CHECK_T(FileError, index.contains(key), "optimizer state '", key,
                    "' is missing from the checkpoint");
    const auto [begin, end] = kept_range(key, index.info(key).shape);
    slices[key] = index.load_range(key, begin, end);
  }
  inner_->load_state(slices);
}

}  // namespace viaduct
