// AdamW against its closed form, the LR schedule's shape, clipping.
#include <gtest/gtest.h>

#include <cmath>

#include "config/config.h"
#include "train/optimizer.h"

using namespace viaduct;

TEST(AdamW, MatchesClosedFormForTwoSteps) {
  auto p = torch::tensor({1.0, -2.0}, torch::kDouble).requires_grad_(true);
  AdamW opt({NamedParam{"w", p, true}}, 0.9, 0.99, 1e-8, 0.1);
  const double lr = 0.01;
  std::vector<double> g1 = {0.5, -1.0}, g2 = {0.25, 2.0};
  std::vector<double> x = {1.0, -2.0}, m = {0, 0}, v = {0, 0};
  for (int step = 1; step <= 2; ++step) {
    const auto& g = step == 1 ? g1 : g2;
    p.mutable_grad() = torch::tensor(g, torch::kDouble);
    opt.step(lr);
    for (int i = 0; i < 2; ++i) {
      x[i] *= 1 - lr * 0.1;
      m[i] = 0.9 * m[i] + 0.1 * g[i];
      v[i] = 0.99 * v[i] + 0.01 * g[i] * g[i];
      const double mh = m[i] / (1 - std::pow(0.9, step));
      const double vh = v[i] / (1 - std::pow(0.99, step));
      x[i] -= lr * mh / (std::sqrt(vh) + 1e-8);
    }
    for (int i = 0; i < 2; ++i) EXPECT_NEAR(p[i].item<double>(), x[i], 1e-12);
  }
}

TEST(AdamW, NoDecayOnNormsBiasesEmbeddings) {
  auto model = torch::nn::ModuleDict();
  model->update({{"tok_embeddings", torch::nn::Embedding(4, 3).ptr()},
                 {"proj", torch::nn::Linear(3, 3).ptr()}});
  auto np = named_params_for_training(*model);
  for (const auto& p : np) {
    if (p.fqn == "proj.weight") {
      EXPECT_TRUE(p.weight_decay);
    } else {
      EXPECT_FALSE(p.weight_decay) << p.fqn;
    }
  }
}

TEST(LrSchedule, WarmupThenCosineToMin) {
  auto cfg = Config::parse("", "t", {"optimizer.lr=1.0", "training.steps=110",
                                     "lr_scheduler.warmup_steps=10",
                                     "lr_scheduler.min_lr_factor=0.1"});
  EXPECT_DOUBLE_EQ(lr_at(cfg, 1), 0.1);
  EXPECT_DOUBLE_EQ(lr_at(cfg, 10), 1.0);
  EXPECT_NEAR(lr_at(cfg, 60), 0.1 + 0.9 * 0.5, 1e-12);  // half way: cos(pi/2) = 0
  EXPECT_NEAR(lr_at(cfg, 110), 0.1, 1e-12);
  auto lin = Config::parse("", "t", {"optimizer.lr=1.0", "training.steps=110",
                                     "lr_scheduler.warmup_steps=10",
                                     "lr_scheduler.decay_type=linear",
                                     "lr_scheduler.min_lr_factor=0"});
  EXPECT_NEAR(lr_at(lin, 60), 0.5, 1e-12);
}

TEST(Clipping, CoefficientClosedForm) {
  EXPECT_DOUBLE_EQ(clip_coefficient(5.0, 1.0), 1.0 / (5.0 + 1e-6));
  EXPECT_DOUBLE_EQ(clip_coefficient(0.5, 1.0), 1.0);   // under the limit
  EXPECT_DOUBLE_EQ(clip_coefficient(50.0, 0.0), 1.0);  // clipping off
}

TEST(Clipping, StepScaledEqualsScalingThenStepOnCpu) {
  // Off the fused kernel, step_scaled scales the gradients in place and
  // steps: the same bits as the two calls (Note [Clip folded into AdamW]).
  auto make = [] {
    torch::manual_seed(3);
    std::vector<NamedParam> ps;
    ps.push_back({"w", at::randn({8, 5}).requires_grad_(true), true});
    ps.push_back({"n", at::randn({5}).requires_grad_(true), false});
    return ps;
  };
  auto a = make(), b = make();
  AdamW oa(a, 0.9, 0.95, 1e-8, 0.1), ob(b, 0.9, 0.95, 1e-8, 0.1);
  for (double c : {0.25, 1.0, 0.7}) {
    for (size_t i = 0; i < a.size(); ++i) {
      auto g = at::randn(a[i].param.sizes());
      a[i].param.mutable_grad() = g.clone();
      b[i].param.mutable_grad() = g.clone();
    }
    oa.step_scaled(1e-2, c);
    multiply_grads(b, c);
    ob.step(1e-2);
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(at::equal(a[i].param.detach(), b[i].param.detach())) << a[i].fqn << " " << c;
    }
  }
  EXPECT_FALSE(at::equal(a[0].param.detach(), make()[0].param.detach()));  // it moved
}

TEST(Clipping, ScalesToMaxNormAndSumsInGivenOrder) {
  auto a = torch::tensor({3.0f}).requires_grad_(true);
  auto b = torch::tensor({4.0f}).requires_grad_(true);
  a.mutable_grad() = torch::tensor({3.0f});
  b.mutable_grad() = torch::tensor({4.0f});
  std::vector<NamedParam> ps = {{"a", a, true}, {"b", b, true}};
  const double n = total_norm(grad_squared_norms(ps));
  EXPECT_DOUBLE_EQ(n, 5.0);
  scale_grads(ps, n, 1.0);
  EXPECT_NEAR(a.grad().item<float>(), 0.6f, 1e-6);
  EXPECT_NEAR(b.grad().item<float>(), 0.8f, 1e-6);
  scale_grads(ps, 1.0, 2.0);  // under the limit: unchanged
  EXPECT_NEAR(a.grad().item<float>(), 0.6f, 1e-6);
}
