// The Kimi-K3 layers against references: the KDA layer chunked against its
// recurrent form, AttnRes against its closed forms, every layer's gradient
// against central differences in fp64, and the MoE bias's selection-only
// rule. The ops under them (chunked KDA, the MoE dispatch) are in tests/ops.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>

#include "model/attn_res.h"
#include "model/kda.h"
#include "model/mla.h"
#include "model/moe.h"
#include "model/vision.h"
#include "grad_check.h"

namespace viaduct {
namespace {

using testing::expect_gradients_match;
using testing::named_params;

// Equal biased scores pick the lower expert ids, in order: a router of
// zeros scores every expert 0.5, so every token takes experts 0 .. k-1;
// with a bias on expert 5 it comes first.
TEST(MoeRoute, TiesGoToTheLowerExpertId) {
  MoeOptions o;
  o.dim = 8;
  o.n_routed_experts = 8;
  o.n_activated_experts = 3;
  o.hidden_dim = 4;
  Moe m(o);
  m->init_weights(1, "moe.", 0.1, 0.1);
  torch::NoGradGuard g;
  m->router->weight.zero_();
  auto x = torch::randn({5, 8});
  auto idx = m->route(x).first;
  for (int64_t n = 0; n < 5; ++n) {
    for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(idx[n][j].item<int64_t>(), j);
  }
  m->expert_bias[5] = 0.1;
  idx = m->route(x).first;
  for (int64_t n = 0; n < 5; ++n) {
    EXPECT_EQ(idx[n][0].item<int64_t>(), 5);
    EXPECT_EQ(idx[n][1].item<int64_t>(), 0);
    EXPECT_EQ(idx[n][2].item<int64_t>(), 1);
  }
}

TEST(KdaLayer, ChunkedEqualsRecurrentAndGradcheck) {
  KdaOptions o{12, 2, 4, 3, 5, 1e-5};
  Kda layer(o);
  layer->init_weights(7, "kda.", 0.3, 0.3);
  layer->to(torch::kDouble);
  torch::manual_seed(5);
  auto x = torch::randn({2, 11, 12}, torch::kDouble).requires_grad_(true);
  auto y = layer(x);
  // The same layer with the step-by-step form of the rule (ops/kda.h)
  // between its two halves in place of the chunked one.
  const auto p = layer->project(x);
  const auto in = layer->rule_inputs(p);
  auto y_reference = layer->output(p, ops::kda_recurrent(in.q, in.k, in.v, in.g, in.beta));
  EXPECT_LT((y - y_reference).abs().max().item<double>(), 1e-12);
  auto tensors = named_params(*layer);
  tensors.emplace_back("x", x);
  expect_gradients_match([&] { return layer(x); }, tensors);
}

TEST(AttnRes, ZeroQueryIsUniformMean) {
  AttnResRead read(16, 1e-5);
  read->init_weights();
  torch::manual_seed(6);
  std::vector<at::Tensor> src;
  for (int i = 0; i < 5; ++i) src.push_back(torch::randn({2, 3, 16}) * (i + 1));
  auto out = read(src);
  auto mean = at::stack(src, 0).mean(0);
  EXPECT_TRUE(torch::allclose(out, mean, 1e-6, 1e-6));
  auto w = read->weights(src);
  EXPECT_TRUE(torch::allclose(w, torch::full_like(w, 0.2), 0, 1e-7));
  // One source passes through unchanged.
  EXPECT_TRUE(torch::equal(read(std::vector<at::Tensor>{src[2]}), src[2]));
}

TEST(AttnRes, SoftmaxOverDepthWithNormedKeys) {
  AttnResRead read(8, 1e-6);
  read->init_weights();
  torch::manual_seed(7);
  {
    torch::NoGradGuard g;
    read->query.copy_(torch::randn({8}));
    read->norm->weight.copy_(torch::rand({8}) + 0.5);
  }
  std::vector<at::Tensor> src;
  for (int i = 0; i < 3; ++i) src.push_back(torch::randn({1, 4, 8}));
  // Reference written out: alpha_i = softmax_i(w . RMSNorm(v_i)).
  auto logits = std::vector<at::Tensor>{};
  for (auto& v : src) {
    auto kn = v * torch::rsqrt(v.pow(2).mean(-1, true) + 1e-6) * read->norm->weight;
    logits.push_back((kn * read->query).sum(-1));
  }
  auto alpha = torch::softmax(torch::stack(logits, 0), 0);
  auto reference = (alpha.unsqueeze(-1) * torch::stack(src, 0)).sum(0);
  EXPECT_TRUE(torch::allclose(read(src), reference, 1e-5, 1e-6));
}

TEST(AttnRes, Gradcheck) {
  AttnResRead read(6, 1e-5);
  read->to(torch::kDouble);
  torch::manual_seed(8);
  {
    torch::NoGradGuard g;
    read->query.copy_(torch::randn({6}, torch::kDouble));
  }
  std::vector<std::pair<std::string, at::Tensor>> tensors = named_params(*read);
  std::vector<at::Tensor> src;
  for (int i = 0; i < 3; ++i) {
    src.push_back(torch::randn({2, 3, 6}, torch::kDouble).requires_grad_(true));
    tensors.emplace_back("source" + std::to_string(i), src.back());
  }
  expect_gradients_match([&] { return read(src); }, tensors);
}

MlaOptions small_mla(int64_t q_lora, bool rope) {
  MlaOptions o;
  o.dim = 12;
  o.n_heads = 2;
  o.q_lora_rank = q_lora;
  o.kv_lora_rank = 6;
  o.qk_nope_head_dim = 4;
  o.qk_rope_head_dim = 4;
  o.v_head_dim = 3;
  o.rope = rope;
  o.max_seq_len = 16;
  return o;
}

// The rotary tables are the module's buffers: they go where the module goes
// (one move, not a host-to-device copy per call), and they are not
// checkpointed state (kimi_k3's extra_state keeps the expert biases only).
TEST(Mla, RopeTablesMoveWithTheModule) {
  Mla mla(small_mla(5, true));
  const auto ref = make_rope_tables(4, 16, 10000.0);
  std::map<std::string, at::Tensor> buffers;
  for (const auto& b : mla->named_buffers()) buffers[b.key()] = b.value();
  ASSERT_EQ(buffers.size(), 2u);
  EXPECT_TRUE(at::equal(buffers.at("rope_cos"), ref.cos));
  EXPECT_TRUE(at::equal(buffers.at("rope_sin"), ref.sin));
  if (!torch::cuda::is_available()) return;
  mla->to(torch::Device(torch::kCUDA, 0));
  for (const auto& b : mla->named_buffers()) EXPECT_TRUE(b.value().is_cuda()) << b.key();
  torch::NoGradGuard g;
  auto x = torch::randn({2, 7, 12}, torch::Device(torch::kCUDA, 0));
  EXPECT_TRUE(mla(x).is_cuda());
}

TEST(Mla, GradcheckLowRankQueryWithRope) {
  Mla mla(small_mla(5, true));
  mla->init_weights(9, "mla.", 0.3, 0.3);
  mla->to(torch::kDouble);
  torch::manual_seed(10);
  auto x = torch::randn({2, 7, 12}, torch::kDouble).requires_grad_(true);
  auto tensors = named_params(*mla);
  tensors.emplace_back("x", x);
  expect_gradients_match([&] { return mla(x); }, tensors);
}

TEST(Mla, GradcheckNoPEAndCausal) {
  Mla mla(small_mla(0, false));
  mla->init_weights(11, "mla.", 0.3, 0.3);
  mla->to(torch::kDouble);
  torch::manual_seed(12);
  auto x = torch::randn({1, 6, 12}, torch::kDouble).requires_grad_(true);
  auto tensors = named_params(*mla);
  tensors.emplace_back("x", x);
  expect_gradients_match([&] { return mla(x); }, tensors);
  // Causal: changing the last token leaves earlier outputs alone.
  torch::NoGradGuard g;
  auto y = mla(x);
  auto x2 = x.clone();
  x2.select(1, 5).add_(1.0);
  auto y2 = mla(x2);
  EXPECT_TRUE(torch::equal(y.narrow(1, 0, 5), y2.narrow(1, 0, 5)));
  EXPECT_FALSE(torch::equal(y.select(1, 5), y2.select(1, 5)));
}

MoeOptions small_moe() { return MoeOptions{8, 6, 2, 5, 1, 1.5, 0.01}; }

TEST(Moe, Gradcheck) {
  Moe moe(small_moe());
  moe->init_weights(13, "moe.", 0.4, 0.4);
  moe->to(torch::kDouble);
  torch::manual_seed(14);
  auto x = torch::randn({2, 5, 8}, torch::kDouble).requires_grad_(true);
  auto tensors = named_params(*moe);
  tensors.emplace_back("x", x);
  expect_gradients_match([&] { return moe(x); }, tensors);
}

// See Note [MoE dispatch without per-expert gradient fills]: the layer against
// the per-expert form it replaced (each expert's rows and weights sliced
// out one at a time), written out here, with an expert left without
// tokens: the output and every weight's gradient are the same bits; x's
// gradient sums the same terms (its k expert copies, the router's and the
// shared expert's) in another order, so it agrees to rounding.
TEST(Moe, DispatchHasThePerExpertFormsBits) {
  Moe moe(small_moe());
  moe->init_weights(19, "moe.", 0.4, 0.4);
  {
    torch::NoGradGuard g;  // expert 5 gets no token
    moe->expert_bias.copy_(torch::tensor({0.0, 0.0, 0.0, 0.0, 0.0, -50.0}));
  }
  torch::manual_seed(20);
  auto x = torch::randn({3, 7, 8}).requires_grad_(true);
  auto dy = torch::randn({3, 7, 8});
  auto y = moe(x);
  y.backward(dy);
  std::vector<at::Tensor> got{y.detach(), x.grad().clone()};
  for (const auto& p : moe->parameters()) got.push_back(p.grad().clone());
  moe->zero_grad();

  // The per-expert form.
  auto xr = x.detach().clone().requires_grad_(true);
  const auto K = moe->opts_.n_activated_experts, E = moe->opts_.n_routed_experts;
  auto xf = xr.reshape({-1, 8});
  const auto N = xf.size(0);
  auto [idx, w] = moe->route(xf);
  auto order = std::get<1>(at::sort(idx.reshape({-1}), /*stable=*/true, 0, false));
  auto counts = at::bincount(idx.reshape({-1}), {}, E);
  EXPECT_EQ(counts[5].item<int64_t>(), 0);
  auto token_of = at::div(order, K, "floor");
  auto& ex = *moe->experts;
  std::vector<at::Tensor> outs;
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    const auto c = counts[e].item<int64_t>();
    if (c == 0) continue;
    auto rows = xf.index_select(0, token_of.narrow(0, start, c));
    outs.push_back(at::linear(at::silu(at::linear(rows, ex.w1[e])) * at::linear(rows, ex.w3[e]),
                              ex.w2[e]));
    start += c;
  }
  auto yr = at::cat(outs, 0).index_select(0, at::argsort(order)).view({N, K, 8});
  yr = (yr * w.unsqueeze(-1)).sum(1);
  if (moe->shared_expert) yr = yr + moe->shared_expert(xf);
  yr = yr.view(x.sizes());
  yr.backward(dy);
  std::vector<at::Tensor> reference{yr.detach(), xr.grad()};
  for (const auto& p : moe->parameters()) {
    reference.push_back(p.grad().defined() ? p.grad() : at::zeros_like(p));
  }
  ASSERT_EQ(got.size(), reference.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (i == 1) {
      EXPECT_TRUE(torch::allclose(got[i], reference[i], 1e-6, 1e-7));
      EXPECT_GT(got[i].abs().sum().item<double>(), 0);
    } else {
      EXPECT_TRUE(torch::equal(got[i], reference[i])) << "tensor " << i;
    }
  }
  // The expert without tokens has zero weight gradients, not undefined ones.
  for (const auto* w : {&ex.w1, &ex.w2, &ex.w3}) {
    ASSERT_TRUE(w->grad().defined());
    EXPECT_EQ(w->grad().select(0, 5).abs().sum().item<double>(), 0.0);
  }
  moe->zero_grad();
  moe(x).backward(dy);
  for (const auto* w : {&ex.w1, &ex.w2, &ex.w3}) {
    EXPECT_EQ(w->grad().select(0, 5).abs().sum().item<double>(), 0.0);
    EXPECT_GT(w->grad().abs().sum().item<double>(), 0.0);
  }
}

TEST(Moe, BiasGetsNoGradientAndChangesSelectionOnly) {
  Moe moe(small_moe());
  moe->init_weights(15, "moe.", 0.4, 0.4);
  EXPECT_FALSE(moe->expert_bias.requires_grad());
  for (const auto& p : moe->named_parameters()) {
    EXPECT_NE(p.key(), "expert_bias");
  }
  EXPECT_EQ(moe->named_buffers().size(), 1u);
  torch::manual_seed(16);
  auto x = torch::randn({40, 8});
  auto [idx0, w0] = moe->route(x);
  {
    torch::NoGradGuard g;
    moe->expert_bias.copy_(torch::tensor({5.0, 5.0, 0.0, 0.0, 0.0, 0.0}));
  }
  auto [idx1, w1] = moe->route(x);
  // A large bias on experts 0 and 1 makes them every token's choice...
  auto sorted = std::get<0>(idx1.sort(-1));
  EXPECT_TRUE(torch::equal(sorted.select(1, 0), torch::zeros({40}, torch::kLong)));
  EXPECT_TRUE(torch::equal(sorted.select(1, 1), torch::ones({40}, torch::kLong)));
  EXPECT_FALSE(torch::equal(idx0, idx1));
  // ...but their gating weights are the unbiased scores, renormalised.
  auto s = torch::sigmoid(torch::matmul(x, moe->router->weight.t()));
  auto chosen = s.gather(-1, idx1);
  auto expect = chosen / chosen.sum(-1, true) * 1.5;
  EXPECT_TRUE(torch::allclose(w1, expect, 1e-6, 1e-7));
  // The bias still gets no gradient through a full forward/backward.
  auto y = moe(x.view({4, 10, 8}));
  y.sum().backward();
  EXPECT_FALSE(moe->expert_bias.grad().defined());
  EXPECT_TRUE(moe->router->weight.grad().defined());
}

TEST(Moe, BiasUpdateFollowsLoadImbalance) {
  Moe moe(small_moe());
  moe->init_weights(17, "moe.", 0.4, 0.4);
  torch::manual_seed(18);
  auto x = torch::randn({1, 64, 8});
  moe(x);  // counts in grad mode
  auto load = moe->tokens_per_expert.clone();
  EXPECT_EQ(load.sum().item<int64_t>(), 64 * 2);
  {
    torch::NoGradGuard g;
    moe(x);  // evaluation forwards do not count
  }
  EXPECT_TRUE(torch::equal(moe->tokens_per_expert, load));
  moe->update_bias();
  auto b = moe->expert_bias;
  auto loadf = load.to(torch::kFloat);
  auto sign = torch::sign(loadf.mean() - loadf);
  auto expect = 0.01 * (sign - sign.mean());
  EXPECT_TRUE(torch::allclose(b, expect, 0, 1e-7));
  EXPECT_NEAR(b.sum().item<double>(), 0.0, 1e-6);
  EXPECT_EQ(moe->tokens_per_expert.sum().item<int64_t>(), 0);
}

// An update with no tokens counted leaves the bias bit for bit (the update
// runs without reading the load on the host).
TEST(Moe, BiasUpdateWithoutTokensChangesNothing) {
  Moe moe(small_moe());
  moe->init_weights(17, "moe.", 0.4, 0.4);
  {
    torch::NoGradGuard g;
    moe->expert_bias.copy_(torch::randn({moe->opts_.n_routed_experts}));
  }
  auto before = moe->expert_bias.clone();
  ASSERT_EQ(moe->tokens_per_expert.sum().item<int64_t>(), 0);
  moe->update_bias();
  EXPECT_TRUE(torch::equal(moe->expert_bias, before));
}

TEST(Vision, GradcheckAndMerge) {
  VisionOptions o;
  o.out_dim = 6;
  o.dim = 8;
  o.n_heads = 2;
  o.channels = 2;
  o.image_size = 4;
  o.patch_size = 2;
  VisionTower tower(o);
  tower->init_weights(19, "vision_tower.");
  tower->to(torch::kDouble);
  torch::manual_seed(20);
  auto images = torch::randn({2, 1, 2, 4, 4}, torch::kDouble).requires_grad_(true);
  auto tensors = named_params(*tower);
  tensors.emplace_back("images", images);
  expect_gradients_match([&] { return tower(images); }, tensors);

  // Merge: placeholders (id 9) take the patches in order, others keep h.
  auto tokens = torch::tensor({{1, 9, 9, 2, 9, 9}, {9, 9, 9, 9, 3, 4}});
  auto h = torch::randn({2, 6, 6}, torch::kDouble);
  auto patches = tower(images);  // [2, 4, 6]
  auto m = merge_image_embeddings(h, tokens, patches, 9);
  EXPECT_TRUE(torch::equal(m[0][0], h[0][0]));
  EXPECT_TRUE(torch::equal(m[0][1], patches[0][0]));
  EXPECT_TRUE(torch::equal(m[0][5], patches[0][3]));
  EXPECT_TRUE(torch::equal(m[1][3], patches[1][3]));
  EXPECT_TRUE(torch::equal(m[1][4], h[1][4]));
  auto bad = torch::tensor({{1, 9, 9, 2, 9, 3}, {9, 9, 9, 9, 3, 4}});
  EXPECT_THROW(merge_image_embeddings(h, bad, patches, 9), std::exception);
}

}  // namespace
}  // namespace viaduct
