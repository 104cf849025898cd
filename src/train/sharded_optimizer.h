// ZeRO-1: the optimizer state of one pipeline rank split over its
// data-parallel replicas.
//
// Note [ZeRO-1]
// parallelism.dp_shard_optimizer = true. Every gradient bucket of the
// data-parallel sum (grad_buckets, reduce.h) is cut into dp contiguous
// ranges of about equal size (shard_layout); replica r keeps the optimizer
// state (AdamW's two fp32 moments) for range r only. A step:
//  1. the gradients are summed over the replicas by the same all-reduce as
//     without sharding, and the clip norm is read from the whole summed
//     gradients as before;
//  2. each replica runs the inner optimizer on its ranges: the parameters
//     and gradients there are views into the whole tensors, so the update
//     writes the weights in place;
//  3. the replicas all-gather the updated ranges, bucket by bucket.
// AdamW is elementwise, so every element sees the arithmetic of the
// unsharded run: the same bits. The gradients are all-reduced rather than
// reduce-scattered: a reduce-scatter sums in an order of its own once
// dp > 2 (Gloo 1.13 has none at all), and equal bits are the contract.
// Range boundaries inside a parameter fall on multiples of kShardAlign
// elements from its start, so every slice starts aligned for vector loads.
//
// Checkpoints stay FQN-keyed: each replica saves its slices of the moments
// as pieces (Note [Tensors stored in pieces]) into its own file, with no
// gather; loading reads the pieces covering this replica's ranges from
// whichever files hold them, so a sharded checkpoint resumes unsharded, on
// another dp or pp, and an unsharded one resumes sharded.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "train/optimizer.h"

namespace viaduct {

namespace dist {
class ProcessGroup;
}  // namespace dist

inline constexpr int64_t kShardAlign = 64;

// Elements [begin, end) of parameter `param`'s row-major flattening.
struct ShardSegment {
  size_t param = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

// segments[b][r]: replica r's segments of bucket b, in parameter order
// (together one contiguous range of the bucket's flattening).
struct ShardLayout {
  std::vector<std::vector<std::vector<ShardSegment>>> segments;
};

// Splits each bucket (indices into `numels`) over `dp` replicas: replica r
// gets elements [x_r, x_{r+1}) of the bucket's flattening, x_r = floor(n r /
// dp) moved down to the nearest multiple of kShardAlign from the start of
// the parameter it falls in.
ShardLayout shard_layout(const std::vector<int64_t>& numels,
                         const std::vector<std::vector<size_t>>& buckets, int dp);

class ShardedOptimizer : public Optimizer {
 public:
  using MakeInner = std::function<std::unique_ptr<Optimizer>(std::vector<NamedParam>)>;
  // `params`: this rank's parameters (identical on every replica of
  // `dp_group`); `buckets`: their grad_buckets; `make_inner` builds the
  // optimizer over this replica's slices.
  ShardedOptimizer(std::vector<NamedParam> params, dist::ProcessGroup& dp_group,
                   std::vector<std::vector<size_t>> buckets, const MakeInner& make_inner);

  void step(double lr) override;
  void step_scaled(double lr, double grad_scale) override;
  bool takes_device_scale() const override { return inner_->takes_device_scale(); }
  void step_device_scaled(double lr, const at::Tensor& scale) override;
  // This replica's slices, as pieces named "<state fqn>@<offset>".
  std::vector<std::pair<std::string, at::Tensor>> state() const override;
  std::map<std::string, std::string> state_file_metadata() const override;
  // Whole-tensor keys, as an unsharded optimizer names them.
  std::vector<std::string> state_keys() const override { return inner_->state_keys(); }
  // Whole tensors (state_keys()); this replica keeps its slices.
  void load_state(const std::map<std::string, at::Tensor>& tensors) override;
  void load_from(const checkpoint::TensorFileIndex& index) override;

  const ShardLayout& layout() const { return layout_; }
  // Elements of the parameters whose state this replica keeps.
  int64_t owned_elements() const;

 private:
  // The update through `run` with the slices' gradients attached, then the
  // all-gather of the new weights.
  void update(const std::function<void()>& run);
  void all_gather_weights();
  std::vector<std::pair<std::string, at::Tensor>> state_pieces(
      std::map<std::string, std::string>* metadata) const;
  // The index in mine_ of the parameter a state key names.
  size_t slice_of_state_key(const std::string& key) const;
  // This replica's elements of the whole state tensor `whole` of `key`.
  at::Tensor cut(const std::string& key, const at::Tensor& whole) const;
  // The inner optimizer's state from this replica's elements of each whole
  // tensor `whole(key)` returns.
  void load_slices(const std::function<at::Tensor(const std::string&)>& whole);

  dist::ProcessGroup& group_;
  std::vector<std::vector<size_t>> buckets_;
  ShardLayout layout_;
  std::vector<ShardSegment> mine_;  // the inner optimizer's params, in order
  std::unique_ptr<Optimizer> inner_;
};

}  // namespace viaduct
