// AdamW against its closed form, the LR schedule's shape, clipping, and
// ZeRO-1's shard layout.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "config/config.h"
#include "config/job_config.h"
#include "train/optimizer.h"
#include "train/sharded_optimizer.h"

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
  auto cfg = JobConfig::parse("", "t", {"optimizer.lr=1.0", "training.steps=110",
                                     "lr_scheduler.warmup_steps=10",
                                     "lr_scheduler.min_lr_factor=0.1"});
  EXPECT_DOUBLE_EQ(lr_at(cfg, 1), 0.1);
  EXPECT_DOUBLE_EQ(lr_at(cfg, 10), 1.0);
  EXPECT_NEAR(lr_at(cfg, 60), 0.1 + 0.9 * 0.5, 1e-12);  // half way: cos(pi/2) = 0
  EXPECT_NEAR(lr_at(cfg, 110), 0.1, 1e-12);
  auto lin = JobConfig::parse("", "t", {"optimizer.lr=1.0", "training.steps=110",
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
  // steps: the same bits as the two calls (see Note [Clip folded into AdamW]).
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

// See Note [ZeRO-1]: the ranges of a bucket over dp replicas.
TEST(ShardLayout, SplitsEachBucketAtAlignedPointsInsideParameters) {
  using viaduct::kShardAlign;
  using viaduct::ShardSegment;
  auto seg = [](const ShardSegment& s) {
    return std::vector<int64_t>{static_cast<int64_t>(s.param), s.begin, s.end};
  };
  // One bucket of 100 + 28 elements over 2: the middle (64) is inside the
  // first parameter, on an aligned point already.
  auto two = viaduct::shard_layout({100, 28}, {{0, 1}}, 2);
  ASSERT_EQ(two.segments.size(), 1u);
  ASSERT_EQ(two.segments[0][0].size(), 1u);
  EXPECT_EQ(seg(two.segments[0][0][0]), (std::vector<int64_t>{0, 0, 64}));
  ASSERT_EQ(two.segments[0][1].size(), 2u);
  EXPECT_EQ(seg(two.segments[0][1][0]), (std::vector<int64_t>{0, 64, 100}));
  EXPECT_EQ(seg(two.segments[0][1][1]), (std::vector<int64_t>{1, 0, 28}));
  // Over 3: floor(128/3) = 42 moves down to 0 (the first replica gets
  // nothing), floor(256/3) = 85 down to 64.
  auto three = viaduct::shard_layout({100, 28}, {{0, 1}}, 3);
  EXPECT_TRUE(three.segments[0][0].empty());
  EXPECT_EQ(seg(three.segments[0][1][0]), (std::vector<int64_t>{0, 0, 64}));
  EXPECT_EQ(seg(three.segments[0][2][0]), (std::vector<int64_t>{0, 64, 100}));

  // Random parameters and buckets: every bucket is tiled exactly, in order,
  // every cut inside a parameter is a multiple of kShardAlign from its start
  // and no replica is short of its share by kShardAlign or more.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int dp = 1 + static_cast<int>(rng() % 6);
    std::vector<int64_t> numels;
    std::vector<std::vector<size_t>> buckets;
    for (int b = 0, i = 0; b < 1 + static_cast<int>(rng() % 4); ++b) {
      buckets.emplace_back();
      for (int k = 0; k < 1 + static_cast<int>(rng() % 5); ++k, ++i) {
        numels.push_back(1 + static_cast<int64_t>(rng() % 5000));
        buckets.back().push_back(static_cast<size_t>(i));
      }
    }
    const auto layout = viaduct::shard_layout(numels, buckets, dp);
    ASSERT_EQ(layout.segments.size(), buckets.size());
    for (size_t b = 0; b < buckets.size(); ++b) {
      ASSERT_EQ(layout.segments[b].size(), static_cast<size_t>(dp));
      int64_t n = 0;
      for (size_t i : buckets[b]) n += numels[i];
      size_t k = 0;       // position in the bucket: parameter k ...
      int64_t at = 0;     // ... element `at`
      for (int r = 0; r < dp; ++r) {
        int64_t mine = 0;
        for (const auto& s : layout.segments[b][static_cast<size_t>(r)]) {
          if (at == numels[buckets[b][k]]) {
            ++k;
            at = 0;
          }
          ASSERT_LT(k, buckets[b].size());
          EXPECT_EQ(s.param, buckets[b][k]);
          EXPECT_EQ(s.begin, at);
          EXPECT_GT(s.end, s.begin);
          if (s.begin != 0) {
            EXPECT_EQ(s.begin % kShardAlign, 0);
          }
          at = s.end;
          mine += s.end - s.begin;
        }
        // x_{r+1} - x_r >= floor(n(r+1)/dp) - kShardAlign + 1 - floor(nr/dp)
        EXPECT_GT(mine, n * (r + 1) / dp - n * r / dp - kShardAlign) << "replica " << r;
      }
      EXPECT_EQ(k + 1, buckets[b].size());
      EXPECT_EQ(at, numels[buckets[b].back()]);
    }
  }
}
