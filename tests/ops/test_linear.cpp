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

TEST(LinearSplit, PartsAreTheWeightsOutputsNarrowed) {
  // linear_split's finer parts on the CPU path: each weight's output
  // narrowed, bit for bit, with the gradients of those narrows; parts that
  // do not divide the weights' rows are refused.
  torch::manual_seed(4);
  const auto x0 = at::randn({2, 5, 6});
  const auto a0 = at::randn({4, 6}), b0 = at::randn({5, 6});
  const auto g = at::randn({2, 5, 9});
  auto run = [&](bool parts) {
    auto x = x0.clone().requires_grad_(true);
    auto a = a0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
    std::vector<at::Tensor> out;
    if (parts) {
      out = ops::linear_split(x, {a, b}, ops::KernelOptions{}, {}, {4, 3, 2});
    } else {
      const auto ya = at::linear(x, a), yb = at::linear(x, b);
      out = {ya, yb.narrow(-1, 0, 3), yb.narrow(-1, 3, 2)};
    }
    EXPECT_EQ(out.size(), 3u);
    (at::cat(out, -1) * g).sum().backward();
    out.insert(out.end(), {x.grad(), a.grad(), b.grad()});
    for (auto& t : out) t = t.detach();
    return out;
  };
  const auto split = run(true), reference = run(false);
  for (size_t i = 0; i < split.size(); ++i) {
    EXPECT_TRUE(at::equal(split[i], reference[i])) << i;
  }
  const auto x = at::randn({2, 5, 6});
  EXPECT_THROW(ops::linear_split(x, {a0, b0}, ops::KernelOptions{}, {}, {3, 3, 3}),
               std::exception);  // crosses the weights' boundary
  EXPECT_THROW(ops::linear_split(x, {a0, b0}, ops::KernelOptions{}, {}, {4, 5, 1}),
               std::exception);  // more rows than the weights have
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
