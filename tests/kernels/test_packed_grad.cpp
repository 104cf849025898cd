// split_packed and the packed gradient's columns (see Note [Packed
// projection gradients in place], kernels/fused.h), on CPU tensors: the
// gradient split_packed hands on against autograd's own split backward,
// bit for bit, with a consumer that writes its gradient into its columns,
// a part used twice and a part left unused.
#include <gtest/gtest.h>

#include "kernels/fused.h"

namespace viaduct {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Where the in-place consumer's backwards wrote.
std::vector<const void*> g_written;

// y = 3 x, whose backward writes dx = 3 dy into x's columns of the packed
// gradient where x is a split_packed part, as the short convolutions do.
class TimesThreeInPlaceFn : public torch::autograd::Function<TimesThreeInPlaceFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            const kernels::PackedGradColumns* into) {
    kernels::save_packed_grad_columns(ctx, *into);
    ctx->saved_data["width"] = x.size(-1);
    return x * 3;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto into = kernels::saved_packed_grad_columns(ctx);
    if (!into.slot.defined()) return {grads[0] * 3, at::Tensor()};
    auto dx = kernels::packed_grad_view(into, ctx->saved_data["width"].toInt());
    at::mul_out(dx, grads[0], 3);
    g_written.push_back(dx.data_ptr());
    return {dx, at::Tensor()};
  }
};

at::Tensor times_three(const at::Tensor& x) {
  const auto into = kernels::packed_grad_columns(x);
  return TimesThreeInPlaceFn::apply(x, &into);
}

struct SplitRun {
  at::Tensor grad;        // the leaf's gradient
  at::Tensor handed_on;   // the packed product's gradient
};

// packed = leaf * 2 ([2, 5, 10]) split into widths 3, 4, 1, 2: part 0
// through the in-place consumer twice (the second gets columns of its
// own), part 1 through it and a plain op (a sum of two gradients), part 2
// unused, part 3 through a plain op.
SplitRun run(const at::Tensor& leaf_in, const at::Tensor& r, bool use_split_packed) {
  auto leaf = leaf_in.detach().requires_grad_(true);
  auto packed = leaf * 2;
  SplitRun out;
  packed.register_hook([&out](const at::Tensor& g) { out.handed_on = g; });
  const std::vector<int64_t> widths{3, 4, 1, 2};
  const auto parts = use_split_packed ? kernels::split_packed(packed, widths)
                                      : packed.split_with_sizes(widths, -1);
  auto y0 = times_three(parts[0]) + times_three(parts[0]).cos();
  auto y1 = times_three(parts[1]) + parts[1].sin();
  auto y3 = parts[3].exp();
  auto loss = (y0 * r.narrow(-1, 0, 3)).sum() + (y1 * r.narrow(-1, 3, 4)).sum() +
              (y3 * r.narrow(-1, 8, 2)).sum();
  loss.backward();
  out.grad = leaf.grad();
  return out;
}

TEST(PackedGrad, SplitPackedHandsOnAutogradsSplitGradient) {
  at::manual_seed(7);
  const auto leaf = at::randn({2, 5, 10});
  const auto r = at::randn({2, 5, 10});
  g_written.clear();
  const auto reference = run(leaf, r, false);
  EXPECT_TRUE(g_written.empty()) << "autograd's split parts offered columns";
  const auto packed = run(leaf, r, true);
  EXPECT_TRUE(at::equal(packed.handed_on, reference.handed_on));
  EXPECT_TRUE(at::equal(packed.grad, reference.grad));
  // The unused part's columns are zeros, not what the buffer held.
  EXPECT_TRUE(at::equal(packed.handed_on.narrow(-1, 7, 1), at::zeros({2, 5, 1})));
}

TEST(PackedGrad, InPlaceConsumerWritesIntoTheHandedOnGradient) {
  at::manual_seed(8);
  const auto leaf = at::randn({2, 5, 10});
  const auto r = at::randn({2, 5, 10});
  g_written.clear();
  const auto packed = run(leaf, r, true);
  ASSERT_EQ(g_written.size(), 3u);
  // Part 0's first consumer and part 1's wrote into their columns of the
  // very tensor handed on; part 0's second consumer into a tensor of its
  // own (the sums of both parts are then copied over their columns).
  const auto* base = static_cast<const char*>(packed.handed_on.data_ptr());
  const auto part1 = static_cast<ptrdiff_t>(3 * sizeof(float));  // column 3
  int at_part0 = 0, at_part1 = 0;
  for (const auto* p : g_written) {
    at_part0 += static_cast<const char*>(p) == base;
    at_part1 += static_cast<const char*>(p) == base + part1;
  }
  EXPECT_EQ(at_part0, 1);
  EXPECT_EQ(at_part1, 1);
  // A second backward through a fresh graph starts from an empty slot.
  const auto again = run(leaf, r, true);
  EXPECT_TRUE(at::equal(again.grad, packed.grad));
}

TEST(PackedGrad, OtherTensorsOfferNoColumns) {
  const auto x = at::randn({2, 3, 4}).requires_grad_(true);
  EXPECT_FALSE(kernels::packed_grad_columns(x).slot.defined());
  EXPECT_FALSE(kernels::packed_grad_columns(x * 2).slot.defined());
  const auto parts = at::randn({2, 3, 4}).requires_grad_(true).split_with_sizes({1, 3}, -1);
  EXPECT_FALSE(kernels::packed_grad_columns(parts[1]).slot.defined());
  const auto mine = kernels::split_packed((x * 2), {1, 3});
  const auto c = kernels::packed_grad_columns(mine[1]);
  ASSERT_TRUE(c.slot.defined());
  EXPECT_EQ(c.column, 1);
  EXPECT_EQ(c.sizes, (std::vector<int64_t>{2, 3, 4}));
}

}  // namespace
}  // namespace viaduct
