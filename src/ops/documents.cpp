#include "ops/documents.h"

#include <algorithm>

#include "core/check.h"
#include "core/device.h"

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
  offsets_ = at::empty({rows_, seq_len_}, at::kInt);
  int64_t* pos = positions_.data_ptr<int64_t>();
  int32_t* off = offsets_.data_ptr<int32_t>();
  for (int64_t b = 0; b < rows_; ++b) {
    int64_t start = 0;
    for (int64_t t = 0; t < seq_len_; ++t) {
      if (t > 0 && p[b * seq_len_ + t]) {
        spans_.push_back({b, start, t - start});
        start = t;
      }
      pos[b * seq_len_ + t] = reset_positions_ ? t - start : t;
      off[b * seq_len_ + t] = static_cast<int32_t>(t - start);
    }
    if (seq_len_ > 0) spans_.push_back({b, start, seq_len_ - start});
  }
}

at::Tensor Documents::cu_seqlens(at::Device device) const {
  std::lock_guard<std::mutex> lock(cache_mutex_);
  auto& kept = cu_seqlens_[device.str()];
  if (!kept.defined()) {
    std::vector<int32_t> cu{0};
    for (const auto& s : spans_) {
      cu.push_back(static_cast<int32_t>(s.row * seq_len_ + s.start + s.length));
    }
    kept = to_device_async(at::tensor(cu, at::kInt), device);
  }
  return kept;
}

at::Tensor Documents::positions(at::Device device) const {
  if (device.is_cpu()) return positions_;
  std::lock_guard<std::mutex> lock(cache_mutex_);
  auto& kept = positions_on_[device.str()];
  if (!kept.defined()) kept = to_device_async(positions_, device);
  return kept;
}

at::Tensor Documents::offsets(at::Device device) const {
  if (device.is_cpu()) return offsets_;
  std::lock_guard<std::mutex> lock(cache_mutex_);
  auto& kept = offsets_on_[device.str()];
  if (!kept.defined()) kept = to_device_async(offsets_, device);
  return kept;
}

const kernels::KdaDocumentChunks& Documents::kda_chunks(int64_t chunk, int64_t heads,
                                                        at::Device device) const {
  VIADUCT_CHECK(chunk >= 1 && heads >= 1, "KDA chunks over documents: chunk ", chunk,
                " and heads ", heads, " (both >= 1)");
  std::lock_guard<std::mutex> lock(cache_mutex_);
  auto& kept = kda_chunks_[std::to_string(chunk) + "/" + std::to_string(heads) + "/" +
                           device.str()];
  if (kept) return *kept;
  // Each row's chunks in order: every span cut into pieces of `chunk`
  // tokens from its first, the last piece partial. The host makes this
  // table ([B, N] entries) and each token's slot in its row's chunks ([B,
  // T]); the per-(token, head) indices follow from them by a few
  // whole-tensor ops on `device`, so a micro-batch's first KDA layer does
  // not wait on the host writing and copying B T H of them.
  std::vector<int64_t> pieces(static_cast<size_t>(rows_), 0);
  for (const auto& s : spans_) {
    pieces[static_cast<size_t>(s.row)] += (s.length + chunk - 1) / chunk;
  }
  const int64_t N = rows_ == 0 ? 0 : *std::max_element(pieces.begin(), pieces.end());
  const int64_t H = heads, T = seq_len_, C = chunk;
  auto spans = at::zeros({rows_, N, 2}, at::kInt);
  auto restarts = at::zeros({rows_, N}, at::kByte);
  // Each token's row in its head's chunks, n C + i (chunk n, row i).
  auto slot = at::empty({rows_, T}, at::kLong);
  {
    auto sp = spans.accessor<int32_t, 3>();
    auto rs = restarts.accessor<uint8_t, 2>();
    auto sl = slot.accessor<int64_t, 2>();
    std::vector<int64_t> next(static_cast<size_t>(rows_), 0);
    for (const auto& s : spans_) {
      int64_t& n = next[static_cast<size_t>(s.row)];
      for (int64_t at = 0; at < s.length; at += C, ++n) {
        const int64_t count = std::min(C, s.length - at);
        sp[s.row][n][0] = static_cast<int32_t>(s.start + at);
        sp[s.row][n][1] = static_cast<int32_t>(count);
        rs[s.row][n] = at == 0 ? 1 : 0;
        for (int64_t i = 0; i < count; ++i) sl[s.row][s.start + at + i] = n * C + i;
      }
    }
  }
  auto c = std::make_unique<kernels::KdaDocumentChunks>();
  c->spans = to_device_async(spans, device);
  c->restarts = to_device_async(restarts, device);
  const auto ilong = at::TensorOptions().dtype(at::kLong).device(device);
  // Chunk row (b, h, n, i) holds token b T + first(b, n) + i of head h when
  // i < count(b, n); rows past a chunk's count read -1 (zeros).
  const auto first = c->spans.select(2, 0).to(at::kLong).reshape({rows_, 1, N, 1});
  const auto count = c->spans.select(2, 1).to(at::kLong).reshape({rows_, 1, N, 1});
  const auto i = at::arange(C, ilong).view({1, 1, 1, C});
  const auto token = at::arange(rows_, ilong).view({rows_, 1, 1, 1}) * T + first + i;
  const auto held = i < count;  // [B, 1, N, C]: every head alike
  const auto at_head = token * H + at::arange(H, ilong).view({1, H, 1, 1});  // [B, H, N, C]
  c->read = at::where(held, at_head, at::full({}, -1, ilong)).flatten();
  // (token, head)'s place: head h's chunks start at (b H + h) N C.
  c->places = (to_device_async(slot, device).view({rows_, T, 1}) +
               at::arange(H, ilong).view({1, 1, H}) * (N * C) +
               at::arange(rows_, ilong).view({rows_, 1, 1}) * (H * N * C))
                  .flatten();
  kept = std::move(c);
  return *kept;
}

const PackedSpans& Documents::packed(int64_t align, int64_t gap, at::Device device) const {
  VIADUCT_CHECK(align >= 1 && gap >= 0, "packed documents: align ", align, " and gap ", gap,
                " (align >= 1, gap >= 0)");
  std::lock_guard<std::mutex> lock(cache_mutex_);
  auto& kept = packed_[std::to_string(align) + "/" + std::to_string(gap) + "/" + device.str()];
  if (kept) return *kept;
  auto p = std::make_unique<PackedSpans>();
  p->align = align;
  // Each span's packed place in its row: the row's first at 0, each next
  // at least `gap` after the one before it ends, on a multiple of `align`.
  std::vector<int64_t> end_of_row(static_cast<size_t>(rows_), 0);
  for (size_t i = 0; i < spans_.size(); ++i) {
    const auto& s = spans_[i];
    int64_t& end = end_of_row[static_cast<size_t>(s.row)];
    const bool first = i == 0 || spans_[i - 1].row != s.row;
    const int64_t at = first ? 0 : (end + gap + align - 1) / align * align;
    p->span_rows.push_back(at);
    end = at + s.length;
  }
  const int64_t length =
      rows_ == 0 ? 0 : *std::max_element(end_of_row.begin(), end_of_row.end());
  p->length = length;
  const int64_t tokens = rows_ * seq_len_;
  // Every packed place reads the zero row (index B T) unless a token goes there.
  std::vector<int64_t> gather(static_cast<size_t>(rows_ * length), tokens);
  std::vector<int64_t> scatter(static_cast<size_t>(tokens));
  const int64_t blocks = (length + align - 1) / align;
  std::vector<uint8_t> starts(static_cast<size_t>(rows_ * blocks), 0);
  for (size_t i = 0; i < spans_.size(); ++i) {
    const auto& s = spans_[i];
    const int64_t at = s.row * length + p->span_rows[i];
    for (int64_t t = 0; t < s.length; ++t) {
      const int64_t token = s.row * seq_len_ + s.start + t;
      gather[static_cast<size_t>(at + t)] = token;
      scatter[static_cast<size_t>(token)] = at + t;
    }
    starts[static_cast<size_t>(s.row * blocks + p->span_rows[i] / align)] = 1;
  }
  p->gather = to_device_async(at::tensor(gather, at::kLong), device);
  // The gather as the device runs it: zero places read token 0, then are
  // cleared (one pass over the rows, not a copy of them with a zero row).
  std::vector<int64_t> zero_places;
  for (size_t i = 0; i < gather.size(); ++i) {
    if (gather[i] == tokens) {
      zero_places.push_back(static_cast<int64_t>(i));
      gather[i] = 0;
    }
  }
  p->gather_read = to_device_async(at::tensor(gather, at::kLong), device);
  p->zero_places = to_device_async(at::tensor(zero_places, at::kLong), device);
  p->scatter = to_device_async(at::tensor(scatter, at::kLong), device);
  p->chunk_starts =
      to_device_async(at::from_blob(starts.data(), {rows_, blocks}, at::kByte).clone(), device);
  kept = std::move(p);
  return *kept;
}

namespace {

// The rows of x2 [B T, rest] at the packed places: PackedSpans::gather,
// zeros where it reads no token.
at::Tensor take_rows(const at::Tensor& x2, const at::Tensor& read, const at::Tensor& zeros) {
  auto out = x2.index_select(0, read);
  if (zeros.numel() > 0) out.index_fill_(0, zeros, 0);
  return out;
}

// x's first `leading` entries along its flattened leading dims as rows.
at::Tensor as_rows(const at::Tensor& x, int64_t leading) {
  return x.reshape({leading, -1});
}

// `lead` followed by x's sizes from dim `drop` on.
std::vector<int64_t> with_leading(const at::Tensor& x, int64_t drop, std::vector<int64_t> lead) {
  for (int64_t d = drop; d < x.dim(); ++d) lead.push_back(x.size(d));
  return lead;
}

// Pack and unpack as one gather each way (see Note [Packed documents]):
// packing reads each token once, so its backward reads each token's
// gradient at its packed place; unpacking reads each packed place at most
// once (zero places never), so its backward gathers by the packing's index.
class PackFn : public torch::autograd::Function<PackFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const PackedSpans* p) {
    ctx->saved_data["scatter"] = p->scatter;
    ctx->saved_data["shape"] = x.sizes().vec();
    const int64_t tokens = x.size(0) * x.size(1);
    return take_rows(as_rows(x, tokens), p->gather_read, p->zero_places)
        .view(with_leading(x, 2, {x.size(0), p->length}));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto scatter = ctx->saved_data["scatter"].toTensor();
    const auto shape = ctx->saved_data["shape"].toIntVector();
    auto g = grads[0].reshape({grads[0].size(0) * grads[0].size(1), -1}).index_select(0, scatter);
    return {g.view(shape), at::Tensor()};
  }
};

class UnpackFn : public torch::autograd::Function<UnpackFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y,
                            const PackedSpans* p, int64_t rows, int64_t seq_len) {
    ctx->saved_data["read"] = p->gather_read;
    ctx->saved_data["zeros"] = p->zero_places;
    ctx->saved_data["shape"] = y.sizes().vec();
    return as_rows(y, y.size(0) * y.size(1))
        .index_select(0, p->scatter)
        .view(with_leading(y, 2, {rows, seq_len}));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto read = ctx->saved_data["read"].toTensor();
    const auto zeros = ctx->saved_data["zeros"].toTensor();
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const int64_t tokens = grads[0].size(0) * grads[0].size(1);
    auto g = take_rows(as_rows(grads[0], tokens), read, zeros);
    return {g.view(shape), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor pack_spans(const at::Tensor& x, const PackedSpans& p) {
  VIADUCT_CHECK(x.dim() >= 2 && x.size(0) * x.size(1) == p.scatter.numel(),
                "pack_spans: an input of shape ", x.sizes(), " for ", p.scatter.numel(),
                " tokens");
  return PackFn::apply(x, &p);
}

at::Tensor unpack_spans(const at::Tensor& y, const PackedSpans& p, int64_t rows,
                        int64_t seq_len) {
  VIADUCT_CHECK(y.dim() >= 2 && y.size(0) == rows && y.size(1) == p.length &&
                    rows * seq_len == p.scatter.numel(),
                "unpack_spans: a packed input of shape ", y.sizes(), " for ", p.length,
                " rows and ", rows, " x ", seq_len, " tokens");
  return UnpackFn::apply(y, &p, rows, seq_len);
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
