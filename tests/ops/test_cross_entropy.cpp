// ops::chunked_head_cross_entropy (the head's matmul and the cross entropy
// a chunk of tokens at a time) against the logits then cross entropy in
// fp64, for chunks smaller than, equal to and larger than the tokens.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ops/cross_entropy.h"

namespace viaduct {
namespace {

TEST(ChunkedHeadLoss, MatchesLogitsThenCrossEntropyInFp64) {
  at::manual_seed(3);
  const int64_t N = 37, D = 16, V = 50;
  auto h = torch::randn({N, D}, torch::kDouble).requires_grad_(true);
  auto w = torch::randn({V, D}, torch::kDouble).requires_grad_(true);
  auto t = torch::randint(0, V, {N}, torch::kLong);
  t[5] = -100;  // ignored
  t[20] = -100;
  auto reference = at::cross_entropy_loss(at::matmul(h, w.t()), t, {}, at::Reduction::Sum, -100);
  (reference * 0.25).backward();
  const auto gh = h.grad().clone(), gw = w.grad().clone();
  for (int64_t chunk : {1, 8, 37, 64}) {
    h.mutable_grad() = at::Tensor();
    w.mutable_grad() = at::Tensor();
    auto loss = ops::chunked_head_cross_entropy(h, w, t, chunk, ops::KernelOptions{});
    (loss * 0.25).backward();
    EXPECT_NEAR(loss.item<double>(), reference.item<double>(), 1e-11) << chunk;
    EXPECT_TRUE(torch::allclose(h.grad(), gh, 1e-10, 1e-12)) << chunk;
    EXPECT_TRUE(torch::allclose(w.grad(), gw, 1e-10, 1e-12)) << chunk;
  }
}

// A split backward, as the zero-bubble schedules run it: the input's
// gradient first over a kept graph, then the weight's, each asked of the
// loss's node once. The two parts are the one backward's bits; asking the
// node for a gradient it has already handed on is an error, not a
// gradient scaled twice.
TEST(ChunkedHeadLoss, SplitBackwardHasTheOneBackwardsGradients) {
  at::manual_seed(4);
  const int64_t N = 21, D = 8, V = 30;
  auto h = torch::randn({N, D}, torch::kFloat).requires_grad_(true);
  auto w = torch::randn({V, D}, torch::kFloat).requires_grad_(true);
  auto t = torch::randint(0, V, {N}, torch::kLong);
  const auto scale = at::scalar_tensor(0.375f);
  (ops::chunked_head_cross_entropy(h, w, t, 8, ops::KernelOptions{}) * scale).backward();
  const auto gh = h.grad().clone(), gw = w.grad().clone();
  h.mutable_grad() = at::Tensor();
  w.mutable_grad() = at::Tensor();

  auto loss = ops::chunked_head_cross_entropy(h, w, t, 8, ops::KernelOptions{}) * scale;
  const auto dh = torch::autograd::grad({loss}, {h}, {}, /*retain_graph=*/true)[0];
  EXPECT_TRUE(torch::equal(dh, gh));
  torch::autograd::backward({loss}, {}, /*retain_graph=*/true, /*create_graph=*/false, {w});
  EXPECT_TRUE(torch::equal(w.grad(), gw));
  EXPECT_FALSE(h.grad().defined());
  EXPECT_THROW(torch::autograd::backward({loss}, {}, false, false, {w}), std::exception);
}

}  // namespace
}  // namespace viaduct
