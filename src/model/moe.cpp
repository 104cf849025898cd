// Mixture of experts with the selection-only balancing bias (see moe.h).
#include "model/moe.h"

#include "core/check.h"
#include "core/rng.h"
#include "ops/checkpoint.h"
#include "ops/moe.h"

namespace viaduct {

GroupedExpertsImpl::GroupedExpertsImpl(int64_t n, int64_t dim, int64_t hidden) {
  w1 = register_parameter("w1", torch::zeros({n, hidden, dim}));
  w2 = register_parameter("w2", torch::zeros({n, dim, hidden}));
  w3 = register_parameter("w3", torch::zeros({n, hidden, dim}));
}

// Note [MoE dispatch without per-expert gradient fills]: the experts run
// one at a time, each on its own rows. Taken as `w1[e]` and
// `x.index_select(0, rows_e)`, every expert's slice has a backward that
// fills a zero tensor of the whole weight ([E, H, D]) or the whole input
// ([N, D]) around its part, which the engine then adds up: E full-size
// fills and adds per tensor, quadratic in the expert count for the weights
// (E = 128 in the full flavor: 128 x 1 GiB a weight a layer). Here the
// weights are unbound once (one node whose backward stacks the E
// gradients) and the rows are gathered once for every slot in expert order
// and split (one node whose backward concatenates). The forward's values
// and the weights' gradients are the same bits as the per-expert slices';
// x's gradient sums the same terms in another order (test
// Moe.DispatchHasThePerExpertFormsBits).
std::vector<at::Tensor> GroupedExpertsImpl::forward_all(const std::vector<at::Tensor>& rows) {
  const at::Tensor none;  // no bias
  const auto w1s = w1.unbind(0), w2s = w2.unbind(0), w3s = w3.unbind(0);
  std::vector<at::Tensor> outs;
  for (size_t e = 0; e < rows.size(); ++e) {
    const auto& x = rows[e];
    if (x.size(0) == 0) continue;
    const auto& k = kernel_options_;
    outs.push_back(ops::linear(at::silu(ops::linear(x, w1s[e], none, k)) *
                                   ops::linear(x, w3s[e], none, k),
                               w2s[e], none, k));
  }
  return outs;
}

MoeImpl::MoeImpl(const MoeOptions& o) : opts_(o) {
  VIADUCT_CHECK(o.n_routed_experts > 0 && o.n_activated_experts > 0 &&
                    o.n_activated_experts <= o.n_routed_experts,
                "model.n_activated_experts (", o.n_activated_experts,
                ") must be between 1 and model.n_routed_experts (",
                o.n_routed_experts, ")");
  VIADUCT_CHECK(o.hidden_dim > 0, "model.moe_hidden_dim must be > 0");
  router = make_linear(*this, "router", o.dim, o.n_routed_experts, false);
  experts = register_module(
      "experts", GroupedExperts(o.n_routed_experts, o.dim, o.hidden_dim));
  if (o.n_shared_experts > 0) {
    shared_expert = register_module(
        "shared_expert", SwiGLU(o.dim, o.hidden_dim * o.n_shared_experts));
  }
  expert_bias = register_buffer("expert_bias",
                                torch::zeros({o.n_routed_experts}));
  tokens_per_expert = torch::zeros({o.n_routed_experts}, torch::kLong);
}

int64_t MoeImpl::count_params(const MoeOptions& o) {
  return o.dim * o.n_routed_experts                          // router
         + 3 * o.n_routed_experts * o.dim * o.hidden_dim     // routed
         + 3 * o.dim * o.hidden_dim * o.n_shared_experts;    // shared
}

int64_t MoeImpl::active_params(const MoeOptions& o) {
  return o.dim * o.n_routed_experts +
         3 * o.dim * o.hidden_dim *
             (o.n_activated_experts + o.n_shared_experts);
}

void MoeImpl::init_weights(uint64_t seed, const std::string& p, double std_in,
                           double std_out) {
  init_trunc_normal_(router->weight, std_in, -2.0, 2.0, seed,
                     p + "router.weight");
  init_trunc_normal_(experts->w1, std_in, -2.0, 2.0, seed, p + "experts.w1");
  init_trunc_normal_(experts->w2, std_out, -2.0, 2.0, seed, p + "experts.w2");
  init_trunc_normal_(experts->w3, std_out, -2.0, 2.0, seed, p + "experts.w3");
  if (shared_expert) {
    shared_expert->init_weights(seed, p + "shared_expert.", std_in, std_out);
  }
  torch::NoGradGuard g;
  expert_bias.zero_();
  tokens_per_expert.zero_();
}

std::pair<at::Tensor, at::Tensor> MoeImpl::route(const at::Tensor& x) {
  // x: [N, D]; scores in fp32 (fp64 under gradient checks).
  const auto st = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto scores = at::sigmoid(linear(x.to(st), router, kernel_options_));  // [N, E]
  // Selection only: no gradient through the bias.
  auto idx = ops::top_experts(scores, expert_bias, opts_.n_activated_experts, kernel_options_);
  auto w = scores.gather(-1, idx);  // unbiased scores of the chosen experts
  w = w / w.sum(-1, /*keepdim=*/true) * opts_.route_scale;
  return {idx, w};
}

at::Tensor MoeImpl::forward(const at::Tensor& x) {
  // x: [B, T, D]
  const auto D = x.size(-1), K = opts_.n_activated_experts;
  const auto E = opts_.n_routed_experts;
  auto xf = x.reshape({-1, D});  // [N, D]
  const auto N = xf.size(0);
  auto [idx, w] = route(xf);
  // Every slot's row (slot n K + j is token n's j-th choice), as copies of
  // the tokens; their gradients are summed back over the K copies.
  auto slots = xf.unsqueeze(1).expand({N, K, D}).reshape({N * K, D});
  // Only training forwards count toward the balance, once under activation
  // checkpointing (Note [Activation checkpointing]). The counts live on the
  // routing's device: a copy to the host would wait for every kernel queued
  // so far, once per MoE layer.
  const auto dev = idx.device();
  auto count_tokens = [&](const at::Tensor& counts) {
    if (!ops::counts_training_statistics()) return;
    if (tokens_per_expert.device() != dev) tokens_per_expert = tokens_per_expert.to(dev);
    tokens_per_expert += counts.to(dev);
  };
  at::Tensor y;
  if (ops::grouped_experts_run(xf, opts_.hidden_dim, kernel_options_)) {
    // Grouped GEMMs over padded expert groups (Note [MoE dispatch into
    // padded groups], ops/moe.h): no host sync.
    auto d = ops::dispatch_experts(idx, E, kernel_options_);
    count_tokens(d.counts);
    auto xs = at::zeros({d.rows, D}, xf.options()).index_copy(0, d.pos, slots);
    auto ys = ops::grouped_swiglu_experts(xs, d.offs, experts->w1, experts->w2, experts->w3);
    y = ops::gather_distinct_rows(ys, d.pos).view({N, K, D});
  } else {
    auto flat = idx.reshape({-1});  // [N K]
    at::Tensor order, counts;
    {
      torch::NoGradGuard g;
      order = std::get<1>(at::sort(flat, /*stable=*/true, 0, false));
      counts = at::bincount(flat, {}, E).to(at::kCPU);
    }
    count_tokens(counts);
    // The slots in expert order, split by expert (Note [MoE dispatch
    // without per-expert gradient fills]). The gather is a permutation of
    // the slots, so its backward adds into no row twice, and the sum over a
    // token's k copies is a reduction: no scatter-add anywhere,
    // deterministic.
    const auto* cnt = counts.data_ptr<int64_t>();
    auto rows = slots.index_select(0, order).split_with_sizes(
        std::vector<int64_t>(cnt, cnt + E), 0);
    // Expert outputs in expert order, then back to (token, slot) order.
    auto sorted_out = at::cat(experts->forward_all(rows), 0);  // [N K, D]
    y = sorted_out.index_select(0, at::argsort(order)).view({N, K, D});
  }
  y = (y * w.to(y.scalar_type()).unsqueeze(-1)).sum(1);  // [N, D]
  if (shared_expert) y = y + shared_expert(xf);
  return y.view(x.sizes());
}

void MoeImpl::update_bias() {
  torch::NoGradGuard g;
  auto load = tokens_per_expert.to(expert_bias.scalar_type())
                  .to(expert_bias.device());
  // No test of the load on the host (a device sync after every optimizer
  // step): with no tokens counted, every sign is 0 and the bias adds zeros.
  auto delta = opts_.bias_update_rate * at::sign(load.mean() - load);
  expert_bias.add_(delta - delta.mean());
  tokens_per_expert.zero_();
}

}  // namespace viaduct
