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

}  // namespace
}  // namespace viaduct
