// ops::Documents: the spans, positions and cu_seqlens of hand-written
// document starts, and per_document putting every span's result back in
// place (against the same op run on each span by hand).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>

#include "ops/documents.h"

namespace viaduct::ops {
namespace {

at::Tensor starts_of(std::vector<std::vector<int>> rows) {
  std::vector<at::Tensor> r;
  for (const auto& row : rows) {
    r.push_back(at::tensor(std::vector<int64_t>(row.begin(), row.end()), at::kLong).to(at::kBool));
  }
  return at::stack(r);
}

TEST(Documents, SpansPositionsAndOffsets) {
  // Row 0 starts mid-document and holds two more; row 1 one document (its
  // first column is a start whatever it says).
  const Documents d(starts_of({{0, 0, 1, 0, 0, 1}, {1, 0, 0, 0, 0, 0}}), true);
  ASSERT_EQ(d.spans().size(), 4u);
  const std::vector<std::array<int64_t, 3>> want{{0, 0, 2}, {0, 2, 3}, {0, 5, 1}, {1, 0, 6}};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(d.spans()[i].row, want[i][0]);
    EXPECT_EQ(d.spans()[i].start, want[i][1]);
    EXPECT_EQ(d.spans()[i].length, want[i][2]);
  }
  EXPECT_TRUE(at::equal(d.positions(),
                        at::tensor({0, 1, 0, 1, 2, 0, 0, 1, 2, 3, 4, 5}, at::kLong).view({2, 6})));
  EXPECT_TRUE(at::equal(d.cu_seqlens(), at::tensor({0, 2, 5, 6, 12}, at::kInt)));
  const Documents window(starts_of({{0, 0, 1, 0, 0, 1}}), false);
  EXPECT_TRUE(at::equal(window.positions(), at::arange(6, at::kLong).view({1, 6})));
  EXPECT_EQ(window.first_position(window.spans()[1]), 2);
  EXPECT_EQ(d.first_position(d.spans()[1]), 0);
}

TEST(Documents, PerDocumentPutsResultsInPlace) {
  const Documents d(starts_of({{1, 0, 1, 0, 0, 1}, {0, 0, 0, 1, 0, 0}}), true);
  auto x = at::randn({2, 6, 3});
  // A running sum over each span: what a recurrence from zero gives.
  auto y = d.per_document({x}, [](const std::vector<at::Tensor>& s, const DocumentSpan&) {
    return s[0].cumsum(1);
  });
  auto reference = at::empty_like(x);
  for (const auto& s : d.spans()) {
    reference[s.row].narrow(0, s.start, s.length).copy_(x[s.row].narrow(0, s.start, s.length).cumsum(0));
  }
  EXPECT_TRUE(at::equal(y, reference));
}

}  // namespace
}  // namespace viaduct::ops
