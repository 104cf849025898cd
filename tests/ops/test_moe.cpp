// The MoE's dispatch into padded expert groups and its combine gather
// (ops/moe.h) against their closed forms and index_select's bits.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "ops/moe.h"

namespace viaduct {
namespace {

// The grouped experts' dispatch (see Note [MoE dispatch into padded groups]):
// every slot in its expert's group in slot order, each group padded to the
// alignment and at least one alignment long, the buffer sized without a
// look at the counts.
TEST(MoeDispatch, GroupsArePaddedAndInSlotOrder) {
  const int64_t A = ops::kExpertAlign;
  // Tokens' choices: [3, 0], [3, 1], [0, 3]; expert 2 gets none.
  auto idx = at::tensor(std::vector<int64_t>{3, 0, 3, 1, 0, 3}).view({3, 2});
  auto d = ops::dispatch_experts(idx, 4, {});
  auto vec = [](const at::Tensor& t) {
    auto c = t.to(at::kLong).contiguous();
    return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  };
  EXPECT_EQ(vec(d.counts), (std::vector<int64_t>{2, 1, 0, 3}));
  EXPECT_EQ(vec(d.offs), (std::vector<int64_t>{A, 2 * A, 3 * A, 4 * A}));
  EXPECT_EQ(vec(d.pos), (std::vector<int64_t>{3 * A, 0, 3 * A + 1, A, 1, 3 * A + 2}));
  EXPECT_EQ(d.rows, 6 + 4 * A);
  // A group longer than the alignment is rounded up to its next multiple.
  auto many = at::zeros({A + 1, 1}, at::kLong);
  auto m = ops::dispatch_experts(many, 2, {});
  EXPECT_EQ(vec(m.offs), (std::vector<int64_t>{2 * A, 3 * A}));
  EXPECT_EQ(vec(m.pos).back(), A);
}

// The MoE's combine gather: index_select's values, and a gradient written
// into place equal to index_select's added into zeros.
TEST(MoeDispatch, GatherDistinctRowsHasIndexSelectsBits) {
  torch::manual_seed(5);
  auto src = torch::randn({11, 6}, torch::requires_grad());
  auto pos = torch::randperm(11, torch::kLong).narrow(0, 0, 7);
  auto y = ops::gather_distinct_rows(src, pos);
  auto src2 = src.detach().clone().requires_grad_(true);
  auto y2 = src2.index_select(0, pos);
  EXPECT_TRUE(torch::equal(y, y2));
  auto g = torch::randn({7, 6});
  y.backward(g);
  y2.backward(g);
  EXPECT_TRUE(torch::equal(src.grad(), src2.grad()));
  EXPECT_EQ(src.grad().abs().sum(1).nonzero().size(0), 7);  // the 4 unread rows are zero
}

// The chosen scores (see Note [The chosen scores' gradient without an index
// op]): gather's values, and its gradient's bits (gather's own backward adds
// into zeros), signed zeros among the incoming gradients included.
TEST(MoeDispatch, GatherChosenHasGathersBits) {
  torch::manual_seed(7);
  for (auto dtype : {at::kFloat, at::kDouble}) {
    const int64_t N = 9, E = 6, K = 3;
    auto scores = torch::rand({N, E}, at::TensorOptions(dtype)).requires_grad_(true);
    auto idx = torch::stack(std::vector<at::Tensor>(
        {torch::randperm(E, torch::kLong).narrow(0, 0, K), torch::tensor({5L, 0L, 2L}),
         torch::tensor({1L, 4L, 3L}), torch::tensor({0L, 1L, 2L}), torch::tensor({3L, 5L, 4L}),
         torch::tensor({2L, 3L, 0L}), torch::tensor({4L, 2L, 1L}), torch::tensor({5L, 4L, 3L}),
         torch::tensor({1L, 0L, 5L})}));
    auto y = ops::gather_chosen(scores, idx);
    auto scores2 = scores.detach().clone().requires_grad_(true);
    auto y2 = scores2.gather(-1, idx);
    EXPECT_TRUE(torch::equal(y, y2));
    auto g = torch::randn({N, K}, at::TensorOptions(dtype));
    g[0][0] = -0.0;  // a negative zero: 0 + (-0) is +0 both ways
    g[1][1] = 0.0;
    y.backward(g);
    y2.backward(g);
    EXPECT_TRUE(torch::equal(scores.grad(), scores2.grad()));
    EXPECT_TRUE(torch::equal(scores.grad().signbit(), scores2.grad().signbit()));
    // Each row's unchosen columns get nothing.
    EXPECT_EQ((scores.grad() != 0).sum().item<int64_t>(), N * K - 2);
  }
}

}  // namespace
}  // namespace viaduct
