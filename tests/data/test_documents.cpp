// Where documents start in a batch's windows, from the two kinds of
// document marker, and the targets block_causal does not train, against
// hand-written windows.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/check.h"
#include "data/documents.h"

namespace viaduct::data {
namespace {

constexpr int64_t kMarker = 9;

// One window of 7 tokens: inputs are its first 6, targets its last 6.
TokenBatch one_window(std::vector<int64_t> w) {
  auto t = at::tensor(w, at::kLong).unsqueeze(0);
  return {t.narrow(1, 0, 6).clone(), t.narrow(1, 1, 6).clone()};
}

TEST(DocumentStarts, AtAStartMarker) {
  // 1 2 | 9 3 | 9 9 4: three documents start inside the window.
  auto b = one_window({1, 2, 9, 3, 9, 9, 4});
  const DocumentMarker m{kMarker, DocumentMarker::Kind::kStarts};
  EXPECT_TRUE(at::equal(document_starts(b.inputs, m),
                        at::tensor({0, 0, 1, 0, 1, 1}, at::kLong).to(at::kBool).unsqueeze(0)));
  mask_document_start_targets(b, m);
  // Targets 9 (window tokens 2, 4, 5) are document starts.
  EXPECT_TRUE(at::equal(b.targets, at::tensor({2, -100, 3, -100, -100, 4}, at::kLong).unsqueeze(0)));
}

TEST(DocumentStarts, AfterAnEndMarker) {
  // 1 9 | 2 3 9 | 9 | 4: the token after each 9 starts a document.
  auto b = one_window({1, 9, 2, 3, 9, 9, 4});
  const DocumentMarker m{kMarker, DocumentMarker::Kind::kEnds};
  EXPECT_TRUE(at::equal(document_starts(b.inputs, m),
                        at::tensor({0, 0, 1, 0, 0, 1}, at::kLong).to(at::kBool).unsqueeze(0)));
  mask_document_start_targets(b, m);
  // The end marker itself is trained; what follows it is not.
  EXPECT_TRUE(at::equal(b.targets, at::tensor({9, -100, 3, 9, -100, -100}, at::kLong).unsqueeze(0)));
}

TEST(DocumentStarts, NeedARecordedMarker) {
  auto b = one_window({1, 2, 3, 4, 5, 6, 7});
  EXPECT_THROW(document_starts(b.inputs, DocumentMarker{}), Error);
  EXPECT_THROW(mask_document_start_targets(b, DocumentMarker{}), Error);
}

}  // namespace
}  // namespace viaduct::data
