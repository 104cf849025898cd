// ZeRO-1: the optimizer state of one pipeline rank split over its
// data-parallel replicas.
//
// Note [ZeRO-1]
// parallelism.dp_shard_optimizer = true. Every gradient bucket of the
// data-parallel sum (grad_buckets, reduce.h) is cut into dp contiguous
// ranges of about equal size (shard_layout); replica r keeps the optimizer
// state (AdamW's two fp32 moments) for range r only. A step:
//  1. the gradients are reduce-scattered: replica r gets the sum of range r
//     only, added in the order of the unsharded run (see Note [Data-parallel
//     sum in a fixed order], reduce.h), and the clip norm is formed from
//     the ranges' pieces (see Note [Gradient norm in shard pieces]);
//  2. each replica runs the inner optimizer on its ranges: the parameters
//     and gradients there are views into the whole tensors, so the update
//     writes the weights in place;
//  3. the replicas all-gather the updated ranges, bucket by bucket.
// AdamW is elementwise, so every element sees the arithmetic of the
// unsharded run: the same bits. The traffic is the unsharded run's: a
// reduce-scatter and an all-gather (of weights rather than gradients).
//
// Checkpoints stay FQN-keyed: each replica saves its slices of the moments
// as pieces (see Note [Tensors stored in pieces]) into its own file, with no
// gather; loading reads the pieces covering this replica's ranges from
// whichever files hold them, so a sharded checkpoint resumes unsharded, on
// another dp or pp, and an unsharded one resumes sharded.
//
// Under expert parallelism the sharded expert tensors (see Note [Expert
// parallelism], model/moe.h) are buckets of their own over the
// expert-replica group instead, cut at expert boundaries as their gradient
// sum keeps them (see Note [Expert gradient sum], expert_parallel.h); their
// pieces are written at their place in the whole tensors.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "train/optimizer.h"
#include "train/reduce.h"

namespace viaduct {

namespace distributed {
class ProcessGroup;
}  // namespace distributed

class ShardedOptimizer : public Optimizer {
 public:
  using MakeInner = std::function<std::unique_ptr<Optimizer>(std::vector<NamedParam>)>;
  // `params`: this rank's parameters (identical on every replica of
  // `dp_group`); `buckets`: their grad_buckets; `make_inner` builds the
  // optimizer over this replica's slices.
  // `units`: shard_layout's, as the gradient reduction's.
  // `expert_buckets`: one per sharded expert tensor, cut over
  // `expert_group` (set when there are any).
  ShardedOptimizer(std::vector<NamedParam> params, distributed::ProcessGroup& dp_group,
                   std::vector<std::vector<size_t>> buckets, const MakeInner& make_inner,
                   const std::vector<int64_t>& units = {},
                   distributed::ProcessGroup* expert_group = nullptr,
                   std::vector<std::vector<size_t>> expert_buckets = {});

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
  // Bytes this replica sent in the last step's all-gather of the weights.
  int64_t last_step_bytes() const override { return last_step_bytes_; }

 private:
  // The update through `run` with the slices' gradients attached, then the
  // all-gather of the new weights.
  void update(const std::function<void()>& run);
  void all_gather_weights();
  std::vector<std::pair<std::string, at::Tensor>> state_pieces(
      std::map<std::string, std::string>* metadata) const;
  // The index in mine_ of the parameter a state key names.
  size_t slice_of_state_key(const std::string& key) const;
  // This replica's elements [begin, end) of the flattening of `key`'s whole
  // state tensor, stored with `shape`; a FileError unless the shape fits.
  std::pair<int64_t, int64_t> kept_range(const std::string& key,
                                         const std::vector<int64_t>& shape) const;

  std::vector<distributed::ProcessGroup*> groups_;  // per bucket
  std::vector<std::vector<size_t>> buckets_;
  ShardLayout layout_;
  std::vector<ShardSegment> mine_;  // the inner optimizer's params, in order
  std::unique_ptr<Optimizer> inner_;
  int64_t last_step_bytes_ = 0;
};

}  // namespace viaduct
