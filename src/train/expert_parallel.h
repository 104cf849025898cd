// Expert parallelism's side in the trainer (see Note [Expert parallelism],
// model/moe.h): the MoE layers' exchange over the ep group, the sum of the
// local experts' gradients over their source ranks and the expert-replica
// group, and the checkpoint form of the sharded expert tensors (pieces of
// the whole tensors, so a save loads under any ep).
//
// Note [Expert gradient sum]
// At ep = 1 the data-parallel sum gives expert e the gradient
// ((G_0 + G_1) + G_2) + ... over the dp replicas r, G_r being replica r's
// micro-batches summed in order (see Note [Data-parallel sum in a fixed
// order], train/reduce.h). Under ep the owner of e in the ep group of dp
// block b holds G_r for the replicas r = b ep + s of its block (one per
// source rank s, MoeImpl::take_source_grads), and the owners of e in the
// other blocks hold the rest: the expert-replica group (one rank per block)
// cuts each expert tensor into dp / ep ranges at expert boundaries, an
// all-to-all sends range m of every source's G to member m, and member m
// adds the dp pieces in replica order (block, then source): every element
// gets the ep = 1 sum's bits. Plain data parallelism then all-gathers the
// summed ranges over the expert-replica group. Under
// parallelism.expert_gradient_sum = local each owner holds one piece, its
// sources already added, and member m adds the dp / ep pieces in block
// order.
//
// Note [Expert ranges and the clip norm]
// The norm of each expert tensor is formed from dp pieces in every layout:
// range q of the whole tensor holds experts [floor(E q / dp), floor(E (q +
// 1) / dp)). At ep = 1 the data-parallel buckets give each expert tensor a
// bucket of its own cut at those boundaries (grad_buckets' `own_bucket`,
// shard_layout's units); under ep, ep rank s's member m of the
// expert-replica group owns range q = s dp / ep + m, which is the same
// elements, and only it contributes that slot (the trainer sums the slots
// over dp).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "train/optimizer.h"
#include "train/reduce.h"

namespace viaduct {

class MoeImpl;
namespace distributed {
class ProcessGroup;
}  // namespace distributed

// One sharded expert tensor of a part: `fqn` (the whole tensor's name)
// holds rows [first_row, first_row + rows) of whole_rows.
struct ExpertShard {
  std::string fqn;
  MoeImpl* moe = nullptr;
  size_t weight = 0;  // 0, 1, 2: experts.w1, w2, w3
  int64_t first_row = 0;
  int64_t rows = 0;
  int64_t whole_rows = 0;
};

// What this rank's MoE exchanges moved since the trainer last read it.
struct ExpertExchangeStats {
  int64_t bytes_sent = 0;  // to the other ranks of the ep group
  double seconds = 0;      // host time in the all-to-alls
};

// Shards every MoE layer of `part` over `ep_group` (before init_weights);
// `context` names this rank in a timeout; the exchanges add into `stats`.
void shard_moe_experts(torch::nn::Module& part, distributed::ProcessGroup& ep_group,
                       const std::string& context,
                       std::shared_ptr<ExpertExchangeStats> stats, bool per_source);

// The MoE layers of `part` with their global layer index ("layers.N.moe").
struct MoeLayerRef {
  int64_t layer = 0;
  MoeImpl* moe = nullptr;
};
std::vector<MoeLayerRef> moe_layer_refs(torch::nn::Module& part);
// The sharded expert tensors of `part`, in parameter order (none at ep = 1).
std::vector<ExpertShard> expert_shards(torch::nn::Module& part);
// The FQNs of every routed-expert tensor of `part`, sharded or not: the
// tensors that see Note [Expert ranges and the clip norm] keeps in their own
// buckets, and each one's rows (experts).
std::vector<std::pair<std::string, int64_t>> routed_expert_tensors(torch::nn::Module& part);

// See Note [Expert gradient sum].
class ExpertGradReduction {
 public:
  // `replicas`: the expert-replica group (null when dp == ep); `params`:
  // the optimizer's, `shards`: every part's expert_shards. `whole`: every
  // member keeps the whole sum (else only its range, ZeRO-1).
  ExpertGradReduction(distributed::ProcessGroup* replicas, int dp, int ep, int ep_rank,
                      const std::vector<NamedParam>& params, std::vector<ExpertShard> shards,
                      bool whole);
  // Takes every source's gradients, sums them and writes the expert
  // parameters' .grad.
  void finish(const std::string& context);
  // The indices (into params) of the expert tensors.
  const std::vector<size_t>& param_indices() const { return param_index_; }
  // This member's range of every expert tensor, with its slot param * dp +
  // q (see Note [Expert ranges and the clip norm]); only this rank contributes
  // it.
  std::vector<GradReduction::NormPiece> norm_pieces() const;
  int64_t last_step_bytes() const { return last_step_bytes_; }

 private:
  // Member m's range of a local expert tensor, as elements of its flattening.
  std::pair<int64_t, int64_t> range(size_t shard, int member) const;

  distributed::ProcessGroup* replicas_;
  int dp_, ep_, ep_rank_, members_, member_;
  const std::vector<NamedParam>& params_;
  std::vector<ExpertShard> shards_;
  std::vector<size_t> param_index_;  // per shard
  bool whole_;
  int64_t last_step_bytes_ = 0;
};

// Rewrites the sharded expert tensors of a checkpoint part as pieces of the
// whole tensors (see Note [Tensors stored in pieces]): the weights under their
// FQNs and their optimizer state ("optim.<state>.<fqn>", shaped like the
// weight). `keep_rest`: keep every other tensor too (the part's first
// writer), else drop them (the ep group's other ranks write only their
// experts).
void store_experts_as_pieces(checkpoint::CheckpointPart& part,
                             const std::vector<ExpertShard>& shards, bool keep_rest);

// Loads a model part's tensors from a checkpoint, its sharded expert
// tensors as rows of the whole stored ones (strict: every tensor present).
void load_part_tensors(const checkpoint::TensorFileIndex& index, torch::nn::Module& part);

}  // namespace viaduct
