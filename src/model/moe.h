// The Kimi-K3 / DeepSeek-V3 mixture of experts: a sigmoid router, top-k
// selection with an auxiliary-loss-free balancing bias, and shared experts.
//
// Note [Selection-only bias]
// `expert_bias` is a buffer, never a parameter: it is added to the router's
// scores to pick the top-k experts (equal scores: the lower expert id first)
// and nowhere else. The gating weights of
// the chosen experts come from the unbiased sigmoid scores (renormalised over
// the chosen k, times route_scale). After every optimizer step the bias moves
// by `bias_update_rate * sign(mean load - load)` (centred), from the tokens
// each expert received since the previous update. Counts are local: with data
// parallelism they must be all-reduced before update_bias().
//
// Note [Expert parallelism]
// Under parallelism.expert_parallel_degree = ep > 1 the routed experts of a
// layer are split over the ep ranks of an ExpertExchange group (data-parallel
// replicas of one stage, dist/dist.h): rank q holds experts [q E/ep,
// (q+1) E/ep) as local tensors [E/ep, ...] under the whole tensors' FQNs.
// Every rank routes its own tokens over all E experts (router, bias and
// counts as at ep = 1), sorts its token copies by expert (a stable sort:
// slot order within an expert), sends the copies of rank q's experts to q
// with one all-to-all (the counts first, then the rows), and gets the
// outputs back with a second; the backward swaps the two. The owner runs
// each expert on each source rank's rows separately, so every GEMM has the
// shape and the rows it has at ep = 1 on that source, and it keeps the
// weights' gradient per source rank (SourceGradSink: not in .grad) summed
// over the step's micro-batches. The trainer adds the sources in replica
// order, as the data-parallel sum adds replicas (train/expert_parallel.h):
// the sums, outputs and token gradients have the bits of ep = 1: the experts
// run as one chain of GEMMs per (source, expert). Keeping a gradient per
// source holds ep x the local experts' gradients -- the whole layer's --
// until the step's sum; parallelism.expert_gradient_sum = local keeps one,
// the sources added as the backward meets them (the same bits run to run,
// not those of ep = 1), and where the grouped GEMMs run (ops/moe.h) the
// local experts take every source's rows in one grouped GEMM each.
//
// Note [Expert capacity]
// With model.moe_capacity_factor = f > 0 each expert takes at most C =
// max(1, ceil(f N K / E)) of the N K token copies of one forward (a
// micro-batch on one rank): the first C routed to it in slot order (token,
// then choice). The others are dropped before dispatch -- no expert runs
// on them, they add nothing to the combine -- and counted. The rule reads
// one rank's routing alone, so every layout (ep, pp, checkpointing) drops
// the same copies. The counts for the balancing bias are of the routing,
// before the drop. On the grouped-GEMM path the dropped copies' gating
// weights are zeroed instead (they run and add zeros).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/layers.h"
#include "ops/moe.h"

namespace viaduct {

struct MoeOptions {
  int64_t dim = 0;
  int64_t n_routed_experts = 0;
  int64_t n_activated_experts = 0;  // top-k
  int64_t hidden_dim = 0;           // per expert
  int64_t n_shared_experts = 1;     // one SwiGLU of n_shared * hidden_dim
  double route_scale = 1.0;
  double bias_update_rate = 1e-3;
  // See Note [Expert capacity]; 0: dropless.
  double capacity_factor = 0.0;
};

// The exchange of token rows between the ranks of an expert-parallel group,
// over c10d in train/ (model/ sees no process group). Every rank of the group
// calls exchange() in the same order.
class ExpertExchange {
 public:
  virtual ~ExpertExchange() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // rows: [sum(send), ...] on any device, its first send[0] rows for rank 0,
  // the next send[1] for rank 1, ...; returns [sum(recv), ...] on the same
  // device: recv[r] rows from rank r, in rank order.
  virtual at::Tensor exchange(const at::Tensor& rows, const std::vector<int64_t>& send,
                              const std::vector<int64_t>& recv) = 0;
};

// FQNs: router.weight [E, D], expert_bias [E] (buffer), experts.w1 [E, H, D],
// experts.w2 [E, D, H], experts.w3 [E, H, D], shared_expert.{w1,w2,w3}.
// The routed experts' stacked SwiGLU weights; they run through
// ops::moe_experts (ops/moe.h).
class GroupedExpertsImpl : public torch::nn::Module {
 public:
  GroupedExpertsImpl(int64_t n_experts, int64_t dim, int64_t hidden);
  at::Tensor w1, w2, w3;
};
TORCH_MODULE(GroupedExperts);

class MoeImpl : public torch::nn::Module, public ops::KernelUser {
 public:
  explicit MoeImpl(const MoeOptions& opts);
  at::Tensor forward(const at::Tensor& x);  // x: [B, T, D] -> [B, T, D]
  // Router decisions, for tests: top-k expert ids [N, k] and their gating
  // weights [N, k] (fp32) for x: [N, D].
  std::pair<at::Tensor, at::Tensor> route(const at::Tensor& x);
  void init_weights(uint64_t seed, const std::string& prefix, double std_in,
                    double std_out);
  // Move expert_bias from the counts gathered since the last call; resets them.
  void update_bias();
  // See Note [Expert parallelism]: keeps this rank's E / size experts (before
  // init_weights; their values are the whole tensors' rows) and reaches the
  // others through `exchange`. `per_source`: their gradients kept per source
  // rank (else one sum of the sources in the backward's order).
  void shard_experts(std::shared_ptr<ExpertExchange> exchange, bool per_source = true);
  bool experts_sharded() const { return exchange_ != nullptr; }
  int64_t first_local_expert() const;
  int64_t local_experts() const;
  // The local experts' weight gradients from source rank s: [s][w] for w1,
  // w2, w3, summed over the micro-batches since the last take; undefined
  // where no token of s reached them (one [0][w] of every source without
  // per_source). Taking resets them.
  std::vector<std::vector<at::Tensor>> take_source_grads();
  static int64_t count_params(const MoeOptions& o);
  static int64_t active_params(const MoeOptions& o);

  MoeOptions opts_;
  torch::nn::Linear router{nullptr};
  GroupedExperts experts{nullptr};
  SwiGLU shared_expert{nullptr};
  at::Tensor expert_bias;        // [E] buffer, selection only
  at::Tensor tokens_per_expert;  // [E] int64 on the routing's device, not in the state dict
  // See Note [Expert parallelism]: the token copies this rank's experts
  // received from the ep group in training forwards (counted once under
  // activation checkpointing), for the metrics; the trainer resets it.
  int64_t tokens_received = 0;
  // See Note [Expert capacity]: copies dropped in training forwards since the
  // trainer's last read, [1] int64 on the routing's device.
  at::Tensor tokens_dropped;

 private:
  // route's decisions, with `uses` handles of x for x's other consumers
  // (ops::router_logits).
  struct Routed {
    at::Tensor idx, w;
    std::vector<at::Tensor> x;
  };
  Routed route_with(const at::Tensor& x, int64_t uses);
  // See Note [Expert parallelism]: the token copies `slots` [N K, D] that run
  // (`eo`) through their experts' owners; the outputs [N K, D] in slot
  // order, zero for a dropped copy.
  at::Tensor experts_over_ranks(const at::Tensor& slots, const ops::ExpertOrder& eo,
                                bool dropped);
  // The local experts on the received rows [R, D] (`pieces`: rows per
  // source and local expert, source-major): outputs [R, D].
  at::Tensor run_local_experts(const at::Tensor& rows, const std::vector<int64_t>& pieces);
  // See Note [Expert capacity]: which of the slots idx [N, K] an expert takes
  // (bool [N K]); undefined when dropless.
  at::Tensor capacity_keep(const at::Tensor& idx);
  std::shared_ptr<ExpertExchange> exchange_;
  // [source][w]; shared with the backward nodes, which add into it.
  std::shared_ptr<std::vector<std::vector<at::Tensor>>> source_grads_;
};
TORCH_MODULE(Moe);

}  // namespace viaduct
