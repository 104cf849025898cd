// ops::linear_parts (one linear over weights given in parts) on the CPU
// against separate linears in fp64, and attention over one qkv product's
// slices against the same slices taken apart.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ops/linear.h"
#include "ops/options.h"
#include "ops/rope.h"

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

TEST(QkvProduct, AttentionOverItsSlicesHasTheGradientOfTheSlicesApart) {
  // See Note [The unrotated qkv gradient written whole]: attention given
  // the product q, k and v are slices of (gpt2's path on the GPU) against
  // the same slices with no product named (their gradients through
  // narrow's backward): the same output and the same product gradient, in
  // fp32 and in bf16, where an inexact sum would show.
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    torch::manual_seed(5);
    const int64_t B = 2, T = 7, H = 3, hd = 4;
    const auto o = at::TensorOptions().dtype(dtype);
    const auto qkv0 = at::randn({B, T, 3 * H * hd}, o);
    const auto dy = at::randn({B, H, T, hd}, o);
    auto run = [&](bool product) {
      auto qkv = qkv0.clone().requires_grad_(true);
      auto q = qkv.narrow(-1, 0, H * hd).view({B, T, H, hd});
      auto k = qkv.narrow(-1, H * hd, H * hd).view({B, T, H, hd});
      auto v = qkv.narrow(-1, 2 * H * hd, H * hd).view({B, T, H, hd});
      auto y = ops::causal_attention(q, k, v, nullptr, ops::KernelOptions{}, nullptr,
                                     product ? qkv : at::Tensor());
      y.backward(dy);
      return std::vector<at::Tensor>{y.detach(), qkv.grad()};
    };
    const auto whole = run(true), apart = run(false);
    EXPECT_TRUE(at::equal(whole[0], apart[0])) << dtype;
    EXPECT_TRUE(at::equal(whole[1], apart[1])) << dtype;
    // v's gradient is not zero everywhere: the test compares something.
    EXPECT_GT(whole[1].narrow(-1, 2 * H * hd, H * hd).abs().sum().item<double>(), 0.0);
  }
}

}  // namespace
}  // namespace viaduct
