// ops::linear_parts (one linear over weights given in parts) on the CPU
// against separate linears in fp64.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ops/linear.h"

namespace viaduct {
namespace {

TEST(LinearParts, MatchesSeparateLinears) {
  // The CPU path concatenates; values and each part's gradient equal those
  // of three linears (fp64, so only summation order differs).
  torch::manual_seed(3);
  auto x = at::randn({2, 5, 6}, at::kDouble).requires_grad_(true);
  auto a = at::randn({4, 6}, at::kDouble).requires_grad_(true);
  auto b = at::randn({2, 6}, at::kDouble).requires_grad_(true);
  auto bias = at::randn({6}, at::kDouble).requires_grad_(true);
  auto y = ops::linear_parts(x, {a, b}, bias, ops::KernelOptions{});
  auto reference = at::cat({at::linear(x, a, bias.narrow(0, 0, 4)), at::linear(x, b, bias.narrow(0, 4, 2))}, -1);
  EXPECT_TRUE(at::allclose(y, reference, 1e-12, 1e-12));
  auto g = at::randn_like(y);
  auto grads = torch::autograd::grad({y}, {x, a, b, bias}, {g});
  auto rgrads = torch::autograd::grad({reference}, {x, a, b, bias}, {g});
  for (size_t i = 0; i < grads.size(); ++i) {
    EXPECT_TRUE(at::allclose(grads[i], rgrads[i], 1e-12, 1e-12)) << i;
  }
}

}  // namespace
}  // namespace viaduct
