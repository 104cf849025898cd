// Mixture of experts with the selection-only balancing bias (see moe.h).
#include "model/moe.h"

#include <torch/csrc/autograd/functions/utils.h>

#include <cmath>
#include <numeric>

#include "core/check.h"
#include "core/rng.h"
#include "ops/recompute.h"
#include "ops/moe.h"

namespace viaduct {

GroupedExpertsImpl::GroupedExpertsImpl(int64_t n, int64_t dim, int64_t hidden) {
  // Left unwritten until init_weights: under expert parallelism the whole
  // tensors are replaced by this rank's rows first, and untouched pages of
  // a large allocation cost no memory.
  w1 = register_parameter("w1", torch::empty({n, hidden, dim}));
  w2 = register_parameter("w2", torch::empty({n, dim, hidden}));
  w3 = register_parameter("w3", torch::empty({n, hidden, dim}));
}

namespace {

using torch::autograd::variable_list;

// See Note [Expert parallelism]: the backward of an all-to-all is the
// all-to-all with the counts swapped. Every rank reaches this node in the
// same order (the same graph, the same schedule), so the collectives pair.
class ExchangeBackward : public torch::autograd::Node {
 public:
  ExchangeBackward(std::shared_ptr<ExpertExchange> ex, std::vector<int64_t> send,
                   std::vector<int64_t> recv, std::vector<int64_t> row_shape,
                   at::TensorOptions options)
      : ex_(std::move(ex)),
        send_(std::move(send)),
        recv_(std::move(recv)),
        row_shape_(std::move(row_shape)),
        options_(options) {}
  variable_list apply(variable_list&& grads) override {
    at::Tensor g = grads.at(0);
    if (!g.defined()) {
      // The peers wait for these rows whether or not they matter here.
      auto shape = row_shape_;
      shape.insert(shape.begin(), std::accumulate(send_.begin(), send_.end(), int64_t{0}));
      g = at::zeros(shape, options_);
    }
    at::NoGradGuard no_grad;
    return {ex_->exchange(g.contiguous(), send_, recv_)};
  }
  std::string name() const override { return "viaduct::ExpertExchangeBackward"; }

 private:
  std::shared_ptr<ExpertExchange> ex_;
  std::vector<int64_t> send_, recv_;  // of the backward's exchange
  std::vector<int64_t> row_shape_;
  at::TensorOptions options_;
};

// rows through ex.exchange(rows, send, recv), differentiable.
at::Tensor exchange_rows(const std::shared_ptr<ExpertExchange>& ex, const at::Tensor& rows,
                         const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = ex->exchange(rows.contiguous(), send, recv);
  }
  // Under grad mode every rank records the node, whether or not its rows
  // need a gradient, so that every rank's backward reaches the same
  // collectives.
  if (at::GradMode::is_enabled()) {
    std::shared_ptr<ExchangeBackward> node(
        new ExchangeBackward(ex, recv, send, rows.sizes().slice(1).vec(), out.options()),
        torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(rows));
    torch::autograd::set_history(out, node);
  }
  return out;
}

// See Note [Expert parallelism]: one source rank's use of a local expert weight.
// The backward adds the gradient into that source's slot (as AccumulateGrad
// adds into .grad: the first one stored, the next added in place) and
// passes nothing on; the edge to the weight stays so that a backward asked
// for the parameters only (the zero-bubble W pass) still runs this node.
class SourceGradSink : public torch::autograd::Node {
 public:
  SourceGradSink(std::shared_ptr<std::vector<std::vector<at::Tensor>>> grads, size_t source,
                 size_t weight)
      : grads_(std::move(grads)), source_(source), weight_(weight) {}
  variable_list apply(variable_list&& grads) override {
    const auto& g = grads.at(0);
    if (g.defined()) {
      at::NoGradGuard no_grad;
      auto& acc = (*grads_)[source_][weight_];
      if (acc.defined()) {
        acc.add_(g);
      } else {
        acc = g.clone(at::MemoryFormat::Contiguous);
      }
    }
    return {at::Tensor()};
  }
  std::string name() const override { return "viaduct::ExpertSourceGradSink"; }

 private:
  std::shared_ptr<std::vector<std::vector<at::Tensor>>> grads_;
  size_t source_, weight_;
};

at::Tensor source_use(const at::Tensor& w,
                      const std::shared_ptr<std::vector<std::vector<at::Tensor>>>& grads,
                      size_t source, size_t weight) {
  auto out = w.detach();
  if (at::GradMode::is_enabled() && w.requires_grad()) {
    std::shared_ptr<SourceGradSink> node(new SourceGradSink(grads, source, weight),
                                         torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(w));
    torch::autograd::set_history(out, node);
  }
  return out;
}

}  // namespace

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
  // Expert e's rows are drawn from (seed, "FQN#e"): a sharded rank draws
  // its own experts alone, with the bits every other layout gives them, and
  // holds one expert's rows at a time beyond its weights.
  auto init_experts = [&](at::Tensor& w, double std, const std::string& fqn) {
    const int64_t first = exchange_ ? first_local_expert() : 0;
    for (int64_t e = 0; e < w.size(0); ++e) {
      init_trunc_normal_(w[e], std, -2.0, 2.0, seed, fqn + "#" + std::to_string(first + e));
    }
  };
  init_experts(experts->w1, std_in, p + "experts.w1");
  init_experts(experts->w2, std_out, p + "experts.w2");
  init_experts(experts->w3, std_out, p + "experts.w3");
  if (shared_expert) {
    shared_expert->init_weights(seed, p + "shared_expert.", std_in, std_out);
  }
  torch::NoGradGuard g;
  expert_bias.zero_();
  tokens_per_expert.zero_();
}

std::pair<at::Tensor, at::Tensor> MoeImpl::route(const at::Tensor& x) {
  auto r = route_with(x, 0);
  return {r.idx, r.w};
}

MoeImpl::Routed MoeImpl::route_with(const at::Tensor& x, int64_t uses) {
  // x: [N, D]; scores in fp32 (fp64 under gradient checks).
  auto logits = ops::router_logits(x, router->weight, kernel_options_, uses);
  auto scores = at::sigmoid(logits.logits);  // [N, E]
  // Selection only: no gradient through the bias.
  auto idx = ops::top_experts(scores, expert_bias, opts_.n_activated_experts, kernel_options_);
  auto w = ops::gather_chosen(scores, idx);  // unbiased scores of the chosen experts
  w = w / w.sum(-1, /*keepdim=*/true) * opts_.route_scale;
  return {idx, w, std::move(logits.x)};
}

at::Tensor MoeImpl::forward(const at::Tensor& x) {
  // x: [B, T, D]
  const auto D = x.size(-1), K = opts_.n_activated_experts;
  const auto E = opts_.n_routed_experts;
  auto xf = x.reshape({-1, D});  // [N, D]
  const auto N = xf.size(0);
  // x's other consumers read the router's handles of it (see Note [The
  // router's backward sums x's gradient], kernels/moe_router_fn.cpp): the
  // routed experts, then the shared expert.
  auto routed = route_with(xf, shared_expert ? 2 : 1);
  const auto idx = routed.idx;
  auto w = routed.w;
  const auto& x_routed = routed.x[0];
  const auto& x_shared = shared_expert ? routed.x[1] : xf;
  // Only training forwards count toward the balance, once under activation
  // checkpointing (see Note [Activation checkpointing]). The counts live on the
  // routing's device: a copy to the host would wait for every kernel queued
  // so far, once per MoE layer.
  const auto dev = idx.device();
  auto count_tokens = [&](const at::Tensor& counts) {
    if (!ops::counts_training_statistics()) return;
    if (tokens_per_expert.device() != dev) tokens_per_expert = tokens_per_expert.to(dev);
    tokens_per_expert += counts.to(dev);
  };
  // See Note [Expert capacity]: the copies an expert takes (all when dropless).
  const auto keep = capacity_keep(idx);
  if (keep.defined() && ops::counts_training_statistics()) {
    if (!tokens_dropped.defined() || tokens_dropped.device() != dev) {
      tokens_dropped = at::zeros({1}, idx.options().dtype(at::kLong));
    }
    tokens_dropped += at::logical_not(keep).sum().view({1});
  }
  at::Tensor y;
  if (exchange_) {
    // See Note [Expert parallelism]: the copies in expert order through
    // their experts' owners.
    const auto eo = ops::expert_order(idx.reshape({-1}), keep, E);
    count_tokens(eo.routed);
    // Every slot's row (slot n K + j is token n's j-th choice), as copies of
    // the tokens; their gradients are summed back over the K copies.
    auto slots = x_routed.unsqueeze(1).expand({N, K, D}).reshape({N * K, D});
    y = ops::combine_experts(experts_over_ranks(slots, eo, keep.defined()).view({N, K, D}), w);
    if (shared_expert) y = y + shared_expert(x_shared);
  } else {
    // The shared experts' output is added to the routed experts' combine.
    std::function<at::Tensor()> shared;
    if (shared_expert) shared = [&] { return shared_expert(x_shared); };
    auto r = ops::moe_experts(x_routed, idx, w, keep, {experts->w1, experts->w2, experts->w3},
                              kernel_options_, shared);
    count_tokens(r.routed);
    y = r.out;
  }
  return y.view(x.sizes());
}

void MoeImpl::shard_experts(std::shared_ptr<ExpertExchange> exchange, bool per_source) {
  VIADUCT_CHECK(exchange && exchange->size() >= 1 &&
                    opts_.n_routed_experts % exchange->size() == 0,
                "parallelism.expert_parallel_degree (", exchange ? exchange->size() : 0,
                ") must divide model.n_routed_experts (", opts_.n_routed_experts, ")");
  exchange_ = std::move(exchange);
  const auto n = local_experts();
  for (auto* w : {&experts->w1, &experts->w2, &experts->w3}) {
    auto shape = w->sizes().vec();
    shape[0] = n;
    w->set_data(at::empty(shape, w->options()));
  }
  source_grads_ = std::make_shared<std::vector<std::vector<at::Tensor>>>(
      per_source ? static_cast<size_t>(exchange_->size()) : 1, std::vector<at::Tensor>(3));
}

int64_t MoeImpl::local_experts() const {
  return exchange_ ? opts_.n_routed_experts / exchange_->size() : opts_.n_routed_experts;
}

int64_t MoeImpl::first_local_expert() const {
  return exchange_ ? exchange_->rank() * local_experts() : 0;
}

std::vector<std::vector<at::Tensor>> MoeImpl::take_source_grads() {
  if (!source_grads_) return {};
  auto out = *source_grads_;
  for (auto& per_source : *source_grads_) {
    for (auto& g : per_source) g = at::Tensor();
  }
  return out;
}

at::Tensor MoeImpl::experts_over_ranks(const at::Tensor& slots, const ops::ExpertOrder& eo,
                                       bool dropped) {
  const int64_t E = opts_.n_routed_experts, P = exchange_->size(), El = local_experts();
  const auto& order = eo.order;
  const auto& counts = eo.counts;
  at::Tensor recv_counts;
  {
    torch::NoGradGuard g;
    // Every rank sends each owner its experts' counts: [P El], source-major.
    recv_counts = exchange_->exchange(counts.view({E, 1}), std::vector<int64_t>(P, El),
                                      std::vector<int64_t>(P, El))
                      .reshape({-1})
                      .to(at::kCPU)
                      .contiguous();
  }
  VIADUCT_CHECK(recv_counts.numel() == P * El, "expert parallelism: received ",
                recv_counts.numel(), " expert counts from the ", P,
                " ranks of the expert-parallel group, expected ", P * El);
  const auto* cnt = counts.data_ptr<int64_t>();
  const auto* rcnt = recv_counts.data_ptr<int64_t>();
  std::vector<int64_t> send(P, 0), recv(P, 0), pieces(rcnt, rcnt + P * El);
  for (int64_t q = 0; q < P; ++q) {
    for (int64_t e = 0; e < El; ++e) {
      send[q] += cnt[q * El + e];
      VIADUCT_CHECK(rcnt[q * El + e] >= 0, "expert parallelism: rank ", q,
                    " of the expert-parallel group sent a negative count for expert ",
                    exchange_->rank() * El + e);
      recv[q] += rcnt[q * El + e];
    }
  }
  if (ops::counts_training_statistics()) {
    tokens_received += std::accumulate(recv.begin(), recv.end(), int64_t{0});
  }
  // The copies in expert order go to their owners; the rows received are
  // grouped by source rank, then expert, each group in its source's slot
  // order.
  auto rows = exchange_rows(exchange_, slots.index_select(0, order), send, recv);
  auto out = run_local_experts(rows, pieces);
  // The outputs back to their sources, in each source's expert order.
  auto back = exchange_rows(exchange_, out, recv, send);  // [kept, D]
  return ops::to_slot_order(back, order, slots.size(0), dropped);
}

at::Tensor MoeImpl::run_local_experts(const at::Tensor& rows, const std::vector<int64_t>& pieces) {
  // Each source's use of the local experts: its own gradient sinks when
  // kept per source, else every source's into one (see Note [Expert
  // parallelism]).
  const bool per_source = source_grads_->size() > 1;
  auto weights = [&](int64_t s) {
    const auto src = per_source ? static_cast<size_t>(s) : size_t{0};
    return ops::ExpertWeights{source_use(experts->w1, source_grads_, src, 0),
                              source_use(experts->w2, source_grads_, src, 1),
                              source_use(experts->w3, source_grads_, src, 2)};
  };
  return ops::moe_local_experts(rows, pieces, exchange_->size(), opts_.hidden_dim, per_source,
                                weights, kernel_options_);
}

at::Tensor MoeImpl::capacity_keep(const at::Tensor& idx) {
  if (opts_.capacity_factor <= 0) return {};
  torch::NoGradGuard g;
  const int64_t E = opts_.n_routed_experts;
  const auto flat = idx.reshape({-1});
  const int64_t S = flat.size(0);
  const auto C = std::max<int64_t>(
      1, static_cast<int64_t>(std::ceil(opts_.capacity_factor * static_cast<double>(S) /
                                        static_cast<double>(E))));
  // Each slot's place among its expert's slots, in slot order. Each
  // expert's first sorted slot comes from a search of the sorted experts:
  // bincount would read the largest expert id to the host (a device sync
  // per MoE layer on a GPU).
  const auto order = std::get<1>(at::sort(flat, /*stable=*/true, 0, false));
  const auto sorted = flat.index_select(0, order);
  const auto first = at::searchsorted(sorted, at::arange(E, flat.options()));
  const auto place_sorted = at::arange(S, flat.options()) - first.index_select(0, sorted);
  const auto place = at::empty_like(place_sorted).index_copy_(0, order, place_sorted);
  return place < C;
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
