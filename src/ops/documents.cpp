#include "ops/documents.h"

#include "core/check.h"

namespace viaduct::ops {

Documents::Documents(const at::Tensor& starts, bool reset_positions)
    : reset_positions_(reset_positions) {
  VIADUCT_CHECK(starts.dim() == 2 && starts.scalar_type() == at::kBool && !starts.is_cuda(),
                "document starts must be a [B, T] bool tensor on the CPU, got ",
                starts.sizes(), " ", starts.scalar_type());
  rows_ = starts.size(0);
  seq_len_ = starts.size(1);
  const auto s = starts.contiguous();
  const bool* p = s.data_ptr<bool>();
  positions_ = at::empty({rows_, seq_len_}, at::kLong);
  int64_t* pos = positions_.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows_; ++b) {
    int64_t start = 0;
    for (int64_t t = 0; t < seq_len_; ++t) {
      if (t > 0 && p[b * seq_len_ + t]) {
        spans_.push_back({b, start, t - start});
        start = t;
      }
      pos[b * seq_len_ + t] = reset_positions_ ? t - start : t;
    }
    if (seq_len_ > 0) spans_.push_back({b, start, seq_len_ - start});
  }
}

at::Tensor Documents::cu_seqlens() const {
  std::vector<int32_t> cu{0};
  for (const auto& s : spans_) {
    cu.push_back(static_cast<int32_t>(s.row * seq_len_ + s.start + s.length));
  }
  return at::tensor(cu, at::kInt);
}

at::Tensor Documents::per_document(const std::vector<at::Tensor>& xs, const SpanFn& fn) const {
  VIADUCT_CHECK(!xs.empty(), "per_document needs at least one input");
  for (const auto& x : xs) {
    VIADUCT_CHECK(x.dim() >= 2 && x.size(0) == rows_ && x.size(1) == seq_len_,
                  "per_document: an input of shape ", x.sizes(), " for documents over [",
                  rows_, ", ", seq_len_, "] tokens");
  }
  std::vector<at::Tensor> rows, pieces;
  std::vector<at::Tensor> args(xs.size());
  for (size_t i = 0; i < spans_.size(); ++i) {
    const auto& s = spans_[i];
    for (size_t j = 0; j < xs.size(); ++j) {
      args[j] = xs[j].narrow(0, s.row, 1).narrow(1, s.start, s.length);
    }
    pieces.push_back(fn(args, s));
    const bool row_ends = i + 1 == spans_.size() || spans_[i + 1].row != s.row;
    if (row_ends) {
      rows.push_back(pieces.size() == 1 ? pieces[0] : at::cat(pieces, 1));
      pieces.clear();
    }
  }
  return rows.size() == 1 ? rows[0] : at::cat(rows, 0);
}

}  // namespace viaduct::ops
