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
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "model/layers.h"

namespace viaduct {

struct MoeOptions {
  int64_t dim = 0;
  int64_t n_routed_experts = 0;
  int64_t n_activated_experts = 0;  // top-k
  int64_t hidden_dim = 0;           // per expert
  int64_t n_shared_experts = 1;     // one SwiGLU of n_shared * hidden_dim
  double route_scale = 1.0;
  double bias_update_rate = 1e-3;
};

// FQNs: router.weight [E, D], expert_bias [E] (buffer), experts.w1 [E, H, D],
// experts.w2 [E, D, H], experts.w3 [E, H, D], shared_expert.{w1,w2,w3}.
class GroupedExpertsImpl : public torch::nn::Module, public ops::KernelUser {
 public:
  GroupedExpertsImpl(int64_t n_experts, int64_t dim, int64_t hidden);
  // SwiGLU of every expert e on its rows[e]: [n_e, D] -> [n_e, D]; the
  // outputs of the experts with rows, in expert order.
  std::vector<at::Tensor> forward_all(const std::vector<at::Tensor>& rows);
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
  static int64_t count_params(const MoeOptions& o);
  static int64_t active_params(const MoeOptions& o);

  MoeOptions opts_;
  torch::nn::Linear router{nullptr};
  GroupedExperts experts{nullptr};
  SwiGLU shared_expert{nullptr};
  at::Tensor expert_bias;        // [E] buffer, selection only
  at::Tensor tokens_per_expert;  // [E] int64 on the routing's device, not in the state dict
};
TORCH_MODULE(Moe);

}  // namespace viaduct
