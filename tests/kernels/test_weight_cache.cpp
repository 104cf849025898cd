// The low-precision weight cache (see Note [Low-precision weight cache]) on
// CPU tensors: its copies against fresh casts, its validity rule (version
// counters), the optimizer's slot protocol and one cache per owner. The CUDA
// path (the AdamW kernel writing the copies, the fused linear using them) is
// in test_fused_kernels; linear_parts on the CPU in tests/ops/test_linear.cpp.
#include <gtest/gtest.h>

#include "kernels/weight_cache.h"
#include "model/layers.h"

namespace viaduct {
namespace {

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         at::equal(a.view(at::kShort), b.view(at::kShort));
}

class WeightCache : public ::testing::Test {
 protected:
  void SetUp() override { torch::manual_seed(7); }
  kernels::WeightCache cache_;
};

TEST_F(WeightCache, ReusesTheCopyUntilTheWeightChanges) {
  auto w = at::randn({6, 5}).requires_grad_(true);
  const auto casts0 = cache_.casts();
  auto c1 = cache_.get({w}, at::kBFloat16);
  EXPECT_TRUE(bitwise_equal(c1, w.detach().to(at::kBFloat16)));
  EXPECT_FALSE(c1.requires_grad());
  EXPECT_EQ(cache_.casts(), casts0 + 1);
  auto c2 = cache_.get({w}, at::kBFloat16);
  EXPECT_EQ(c2.data_ptr(), c1.data_ptr());
  EXPECT_EQ(cache_.casts(), casts0 + 1);  // nothing changed: no cast
  EXPECT_EQ(cache_.bytes(), 6 * 5 * 2);
  {
    at::NoGradGuard g;
    w.add_(0.25);  // an ATen in-place write moves the version
  }
  auto c3 = cache_.get({w}, at::kBFloat16);
  EXPECT_EQ(cache_.casts(), casts0 + 2);
  EXPECT_TRUE(bitwise_equal(c3, w.detach().to(at::kBFloat16)));
}

// The bias gradients' row of ones: [1, n] of ones of the dtype asked for,
// shorter rows views of the one kept vector, a longer row growing it, each
// dtype its own; the same as a fresh row from the cache-less form.
TEST_F(WeightCache, OnesRowsAreViewsOfOneKeptVectorPerDtype) {
  const auto cpu = at::Device(at::kCPU);
  auto r8 = cache_.ones_row(8, at::kBFloat16, cpu);
  EXPECT_TRUE(bitwise_equal(r8, at::ones({1, 8}, at::kBFloat16)));
  auto r5 = cache_.ones_row(5, at::kBFloat16, cpu);
  EXPECT_TRUE(bitwise_equal(r5, at::ones({1, 5}, at::kBFloat16)));
  EXPECT_EQ(r5.data_ptr(), r8.data_ptr());
  auto r12 = cache_.ones_row(12, at::kBFloat16, cpu);
  EXPECT_TRUE(bitwise_equal(r12, at::ones({1, 12}, at::kBFloat16)));
  EXPECT_EQ(cache_.ones_row(12, at::kBFloat16, cpu).data_ptr(), r12.data_ptr());
  auto f = cache_.ones_row(3, at::kFloat, cpu);
  EXPECT_EQ(f.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(f, at::ones({1, 3})));
  EXPECT_TRUE(bitwise_equal(kernels::ones_row(nullptr, 4, at::kBFloat16, cpu),
                            cache_.ones_row(4, at::kBFloat16, cpu)));
}

TEST_F(WeightCache, PartsAreConcatenatedAndRecastOneByOne) {
  auto a = at::randn({4, 3}), b = at::randn({2, 3}), c = at::randn({5, 3});
  auto copy = cache_.get({a, b, c}, at::kBFloat16);
  EXPECT_TRUE(bitwise_equal(copy, at::cat({a, b, c}).to(at::kBFloat16)));
  const auto a_rows_before = copy.narrow(0, 0, 4).clone();
  b.mul_(-3.0);
  auto again = cache_.get({a, b, c}, at::kBFloat16);
  EXPECT_EQ(again.data_ptr(), copy.data_ptr());
  EXPECT_TRUE(bitwise_equal(again, at::cat({a, b, c}).to(at::kBFloat16)));
  EXPECT_TRUE(bitwise_equal(again.narrow(0, 0, 4), a_rows_before));
  // Another grouping of the same weights replaces the copy.
  auto alone = cache_.get({b}, at::kBFloat16);
  EXPECT_TRUE(bitwise_equal(alone, b.to(at::kBFloat16)));
  EXPECT_FALSE(cache_.slot_for(a).defined());  // a's copy went with its group
  EXPECT_THROW(cache_.get({a, at::randn({2, 4})}, at::kBFloat16), std::exception);
  EXPECT_THROW(cache_.get({a.to(at::kBFloat16)}, at::kBFloat16), std::exception);
}

TEST_F(WeightCache, BiasesAreCachedLikeWeights) {
  // 1-D parts (a linear's bias; q, k and v's biases concatenated) take the
  // same copies, validity rule and optimizer slots as weights.
  auto b = at::randn({6}).requires_grad_(true), c = at::randn({3}).requires_grad_(true);
  const auto casts0 = cache_.casts();
  auto copy = cache_.get({b}, at::kBFloat16);
  EXPECT_TRUE(bitwise_equal(copy, b.detach().to(at::kBFloat16)));
  EXPECT_EQ(cache_.get({b}, at::kBFloat16).data_ptr(), copy.data_ptr());
  EXPECT_EQ(cache_.casts(), casts0 + 1);
  auto both = cache_.get({b, c}, at::kBFloat16);
  EXPECT_TRUE(bitwise_equal(both, at::cat({b, c}).detach().to(at::kBFloat16)));
  auto slot = cache_.slot_for(c);
  ASSERT_TRUE(slot.defined());
  EXPECT_EQ(static_cast<char*>(slot.data_ptr()), static_cast<char*>(both.data_ptr()) + 6 * 2);
  {
    at::NoGradGuard g;
    c.mul_(2.0);
  }
  EXPECT_TRUE(bitwise_equal(cache_.get({b, c}, at::kBFloat16),
                            at::cat({b, c}).detach().to(at::kBFloat16)));
  // A weight and a bias are not parts of one copy.
  EXPECT_THROW(cache_.get({at::randn({2, 6}), b}, at::kBFloat16), std::exception);
}

TEST_F(WeightCache, OptimizerSlotProtocol) {
  // The optimizer writes the weight and its rows of the copy from the same
  // new values without moving any version (as the AdamW kernel does), then
  // calls mark_written: the next get() casts nothing and sees the values.
  auto q = at::randn({3, 4}).requires_grad_(true), k = at::randn({2, 4}).requires_grad_(true);
  auto copy = cache_.get({q, k}, at::kBFloat16);
  const auto casts0 = cache_.casts();
  auto slot = cache_.slot_for(k);
  ASSERT_TRUE(slot.defined());
  EXPECT_EQ(slot.numel(), k.numel());
  EXPECT_EQ(static_cast<char*>(slot.data_ptr()),
            static_cast<char*>(copy.data_ptr()) + 3 * 4 * 2);  // after q's rows
  const auto fresh = at::randn({2, 4});
  std::memcpy(k.data_ptr(), fresh.data_ptr(), fresh.nbytes());  // raw: no version bump
  std::memcpy(slot.data_ptr(), fresh.to(at::kBFloat16).data_ptr(), slot.nbytes());
  const auto version = k._version();
  cache_.mark_written(k);
  EXPECT_GT(k._version(), version);
  auto after = cache_.get({q, k}, at::kBFloat16);
  EXPECT_EQ(cache_.casts(), casts0);
  EXPECT_TRUE(bitwise_equal(after, at::cat({q, k}).detach().to(at::kBFloat16)));
  EXPECT_FALSE(cache_.slot_for(at::randn({2, 4})).defined());
  EXPECT_THROW(cache_.mark_written(at::randn({2, 4})), std::exception);
}

// The experts' w1 and w3 ([E, H, D] each) as one [E, 2H, D] copy (see Note
// [One gate-up GEMM for the experts]): the copy is the concatenation along
// dim 1; a weight's slot is a view of its sizes whose experts' blocks are
// each contiguous, at their places in the copy; a moved weight is re-cast
// alone; the slot protocol holds; a grouping along another dim replaces the
// copy, and parts that differ but along dim 1 are refused.
TEST_F(WeightCache, ExpertWeightsSideBySideAlongDimOne) {
  auto w1 = at::randn({3, 4, 5}).requires_grad_(true), w3 = at::randn({3, 2, 5}).requires_grad_(true);
  auto copy = cache_.get({w1, w3}, at::kBFloat16, 1);
  EXPECT_EQ(copy.sizes(), (std::vector<int64_t>{3, 6, 5}));
  EXPECT_TRUE(bitwise_equal(copy, at::cat({w1, w3}, 1).detach().to(at::kBFloat16)));
  EXPECT_TRUE(bitwise_equal(kernels::cast_weights(nullptr, {w1, w3}, at::kBFloat16, 1), copy));
  auto slot = cache_.slot_for(w3);
  ASSERT_TRUE(slot.defined());
  EXPECT_EQ(slot.sizes(), w3.sizes());
  EXPECT_FALSE(slot.is_contiguous());
  for (int64_t e = 0; e < 3; ++e) {
    EXPECT_TRUE(slot[e].is_contiguous());
    EXPECT_EQ(static_cast<char*>(slot[e].data_ptr()),
              static_cast<char*>(copy.data_ptr()) + (e * 6 + 4) * 5 * 2);  // after w1's rows
  }
  const auto w3_part = copy.narrow(1, 4, 2).clone();
  const auto casts0 = cache_.casts();
  {
    at::NoGradGuard g;
    w1.mul_(-2.0);
  }
  auto again = cache_.get({w1, w3}, at::kBFloat16, 1);
  EXPECT_EQ(again.data_ptr(), copy.data_ptr());
  EXPECT_EQ(cache_.casts(), casts0 + 1);
  EXPECT_TRUE(bitwise_equal(again, at::cat({w1, w3}, 1).detach().to(at::kBFloat16)));
  EXPECT_TRUE(bitwise_equal(again.narrow(1, 4, 2), w3_part));
  // The optimizer's protocol, expert by expert as ops/adamw.cpp writes it.
  const auto fresh = at::randn({3, 2, 5});
  std::memcpy(w3.data_ptr(), fresh.data_ptr(), fresh.nbytes());  // raw: no version bump
  for (int64_t e = 0; e < 3; ++e) slot[e].copy_(fresh[e].to(at::kBFloat16));
  cache_.mark_written(w3);
  auto after = cache_.get({w1, w3}, at::kBFloat16, 1);
  EXPECT_EQ(cache_.casts(), casts0 + 1);
  EXPECT_TRUE(bitwise_equal(after, at::cat({w1, w3}, 1).detach().to(at::kBFloat16)));
  // The same weights along dim 0: another copy, w1's slot now contiguous.
  auto stacked = cache_.get({w1, w1.detach().clone().requires_grad_(true)}, at::kBFloat16);
  EXPECT_EQ(stacked.size(0), 6);
  EXPECT_TRUE(cache_.slot_for(w1).is_contiguous());
  EXPECT_FALSE(cache_.slot_for(w3).defined());  // its copy went with the old group
  EXPECT_THROW(cache_.get({w1, at::randn({2, 2, 5})}, at::kBFloat16, 1), std::exception);
  EXPECT_THROW(cache_.get({w1, at::randn({3, 2, 4})}, at::kBFloat16, 1), std::exception);
  EXPECT_THROW(cache_.get({w1}, at::kBFloat16, 3), std::exception);
}

TEST_F(WeightCache, ViewsAreCastButNotKept) {
  // An expert's slice of stacked MoE weights is a new view every forward.
  auto stacked = at::randn({3, 4, 5}).requires_grad_(true);
  auto view = stacked.select(0, 1);
  ASSERT_FALSE(view.is_leaf());
  const auto casts0 = cache_.casts();
  auto c = cache_.get({view}, at::kBFloat16);
  EXPECT_TRUE(bitwise_equal(c, view.detach().to(at::kBFloat16)));
  EXPECT_EQ(cache_.casts(), casts0 + 1);
  EXPECT_EQ(cache_.bytes(), 0);
  EXPECT_FALSE(cache_.slot_for(view).defined());
}

TEST_F(WeightCache, FreedWeightsReleaseTheirCopies) {
  {
    auto w = at::randn({64, 64});
    cache_.get({w}, at::kBFloat16);
    EXPECT_EQ(cache_.bytes(), 64 * 64 * 2);
  }
  auto other = at::randn({8, 8});
  cache_.get({other}, at::kBFloat16);  // a new copy sweeps the dead ones
  EXPECT_EQ(cache_.bytes(), 8 * 8 * 2);
}

TEST_F(WeightCache, EachCacheHoldsItsOwnCopies) {
  // One cache per rank: another's copies, casts and clear() are its own.
  auto w = at::randn({4, 6}).requires_grad_(true);
  kernels::WeightCache other;
  auto c1 = cache_.get({w}, at::kBFloat16);
  EXPECT_FALSE(other.slot_for(w).defined());
  EXPECT_EQ(other.bytes(), 0);
  auto c2 = other.get({w}, at::kBFloat16);
  EXPECT_NE(c1.data_ptr(), c2.data_ptr());
  EXPECT_TRUE(bitwise_equal(c1, c2));
  EXPECT_EQ(other.casts(), 1);
  other.clear();
  EXPECT_EQ(other.bytes(), 0);
  EXPECT_EQ(cache_.bytes(), 4 * 6 * 2);
  EXPECT_EQ(cache_.get({w}, at::kBFloat16).data_ptr(), c1.data_ptr());
}

TEST_F(WeightCache, WithoutACacheEveryCastIsFresh) {
  // Options without a cache (a module built outside a training run): the
  // same bits, nothing kept.
  auto a = at::randn({3, 5}).requires_grad_(true), b = at::randn({2, 5}).requires_grad_(true);
  auto c1 = kernels::cast_weights(nullptr, {a, b}, at::kBFloat16);
  auto c2 = kernels::cast_weights(nullptr, {a, b}, at::kBFloat16);
  EXPECT_NE(c1.data_ptr(), c2.data_ptr());
  EXPECT_FALSE(c1.requires_grad());
  EXPECT_TRUE(bitwise_equal(c1, cache_.get({a, b}, at::kBFloat16)));
  EXPECT_EQ(kernels::cast_weights(&cache_, {a, b}, at::kBFloat16).data_ptr(),
            cache_.get({a, b}, at::kBFloat16).data_ptr());
  EXPECT_THROW(kernels::cast_weights(nullptr, {a.to(at::kBFloat16)}, at::kBFloat16),
               std::exception);
}

}  // namespace
}  // namespace viaduct
