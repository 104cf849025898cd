// ops::Documents: the spans, positions and cu_seqlens of hand-written
// document starts, per_document putting every span's result back in place
// (against the same op run on each span by hand), the packed layout against
// hand-placed rows, pack and unpack and their gradients against gathers
// written out, and the packed mixers (KDA's chunked recurrence, the short
// convolution) against each document run alone.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>

#include "core/rng.h"
#include "ops/documents.h"
#include "ops/kda.h"
#include "ops/short_conv.h"

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
  EXPECT_TRUE(at::equal(d.offsets(at::kCPU),
                        at::tensor({0, 1, 0, 1, 2, 0, 0, 1, 2, 3, 4, 5}, at::kInt).view({2, 6})));
  const Documents window(starts_of({{0, 0, 1, 0, 0, 1}}), false);
  EXPECT_TRUE(at::equal(window.positions(), at::arange(6, at::kLong).view({1, 6})));
  // Offsets stay within the document when positions run through the window.
  EXPECT_TRUE(at::equal(window.offsets(at::kCPU),
                        at::tensor({0, 1, 0, 1, 2, 0}, at::kInt).view({1, 6})));
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

TEST(Documents, PackedPlacesSpansOnAlignedRows) {
  // Spans: row 0 [0, 2) [2, 5) [5, 6); row 1 [0, 6) (6 tokens a row).
  const Documents d(starts_of({{0, 0, 1, 0, 0, 1}, {1, 0, 0, 0, 0, 0}}), true);
  // align 4, no gap: row 0's spans at 0, 4, 8 (ends 9), row 1's at 0
  // (ends 6): packed rows of 9.
  const auto& a = d.packed(4, 0, at::kCPU);
  EXPECT_EQ(a.length, 9);
  EXPECT_EQ(a.span_rows, (std::vector<int64_t>{0, 4, 8, 0}));
  const int64_t z = 12;  // the zero row's index (B T)
  EXPECT_TRUE(at::equal(a.gather, at::tensor(std::vector<int64_t>{0, 1, z, z, 2, 3, 4, z, 5,  //
                                                                   6, 7, 8, 9, 10, 11, z, z, z})));
  EXPECT_TRUE(at::equal(a.scatter, at::tensor(std::vector<int64_t>{0, 1, 4, 5, 6, 8,  //
                                                                    9, 10, 11, 12, 13, 14})));
  EXPECT_TRUE(at::equal(a.chunk_starts,
                        at::tensor(std::vector<uint8_t>{1, 1, 1, 1, 0, 0}).view({2, 3})));
  // align 1, gap 2: two zero rows between a row's spans, none before its
  // first: row 0's at 0, 4, 9 (ends 10).
  const auto& c = d.packed(1, 2, at::kCPU);
  EXPECT_EQ(c.span_rows, (std::vector<int64_t>{0, 4, 9, 0}));
  EXPECT_EQ(c.length, 10);
  EXPECT_TRUE(at::equal(c.scatter, at::tensor(std::vector<int64_t>{0, 1, 4, 5, 6, 9,  //
                                                                    10, 11, 12, 13, 14, 15})));
  // Asked again: the same object, made once.
  EXPECT_EQ(&d.packed(4, 0, at::kCPU), &a);
  EXPECT_EQ(d.cu_seqlens(at::kCPU).data_ptr(), d.cu_seqlens().data_ptr());
}

// KDA's chunks over the documents in place (see Note [KDA chunks over
// documents]) against a second construction: the packed rows at align =
// chunk cut into chunks. Same chunk count, each chunk's first token and
// count read off the packed gather, the same restarts, and the chunk
// layout [B H N C, D] that `read` (zeros where it reads -1) takes from the
// tokens equal to the packed rows' transpose; `places` takes it back.
TEST(Documents, KdaChunksAreThePackedChunksInPlace) {
  const int64_t B = 3, T = 29, H = 3, D = 2, C = 4;
  for (const uint64_t seed : {1u, 2u, 3u}) {
    auto gen = make_generator(seed, "starts");
    auto starts = at::rand({B, T}, gen) < 0.2;
    starts[2].fill_(false);  // a row of one document
    starts[1][1] = true;     // a one-token span
    const Documents d(starts, true);
    const auto& k = d.kda_chunks(C, H, at::kCPU);
    const auto& p = d.packed(C, 0, at::kCPU);
    const int64_t N = (p.length + C - 1) / C;
    ASSERT_EQ(k.spans.sizes(), (std::vector<int64_t>{B, N, 2})) << "seed " << seed;
    EXPECT_TRUE(at::equal(k.restarts, p.chunk_starts)) << "seed " << seed;
    for (int64_t b = 0; b < B; ++b) {
      int64_t tokens = 0;
      for (int64_t n = 0; n < N; ++n) {
        int64_t count = 0, first = -1;
        for (int64_t c = 0; c < C && n * C + c < p.length; ++c) {
          const int64_t t = p.gather[b * p.length + n * C + c].item<int64_t>();
          if (t == B * T) continue;
          if (count == 0) first = t - b * T;
          EXPECT_EQ(c, count) << "a chunk's tokens fill it from its first row";
          ++count;
        }
        EXPECT_EQ(k.spans[b][n][1].item<int32_t>(), count) << "seed " << seed << " chunk " << n;
        if (count > 0) {
          EXPECT_EQ(k.spans[b][n][0].item<int32_t>(), first) << "seed " << seed << " chunk " << n;
        }
        tokens += count;
      }
      EXPECT_EQ(tokens, T) << "every token in one chunk, seed " << seed;
    }
    auto x = at::randn({B, T, H, D}, at::kDouble);
    auto padded = at::constant_pad_nd(pack_spans(x, p), {0, 0, 0, 0, 0, N * C - p.length});
    auto want = padded.view({B, N, C, H, D}).permute({0, 3, 1, 2, 4}).reshape({-1, D});
    // A chunk row that holds no token reads -1: zeros.
    const auto held = k.read >= 0;
    auto got = x.reshape({B * T * H, D}).index_select(0, k.read.clamp_min(0)) *
               held.unsqueeze(1).to(at::kDouble);
    EXPECT_TRUE(at::equal(got, want)) << "seed " << seed;
    EXPECT_TRUE(at::equal(want.index_select(0, k.places).view({B, T, H, D}), x))
        << "seed " << seed;
  }
}

TEST(Documents, PackAndUnpackAreGathersBothWays) {
  const Documents d(starts_of({{1, 0, 1, 0, 0, 1, 0}, {0, 1, 0, 0, 0, 0, 1}}), true);
  const auto& p = d.packed(4, 1, at::kCPU);
  auto x = at::randn({2, 7, 3}, at::kDouble).requires_grad_();
  auto packed = pack_spans(x, p);
  ASSERT_EQ(packed.sizes(), (std::vector<int64_t>{2, p.length, 3}));
  // Each packed place holds its token's row, or zeros.
  auto rows = x.detach().reshape({14, 3});
  auto places = packed.detach().reshape({2 * p.length, 3});
  for (int64_t r = 0; r < 2 * p.length; ++r) {
    const int64_t t = p.gather[r].item<int64_t>();
    const auto want = t == 14 ? at::zeros({3}, at::kDouble) : rows[t];
    EXPECT_TRUE(at::equal(places[r], want)) << "packed place " << r;
  }
  // Unpacking gives x back exactly.
  auto back = unpack_spans(packed, p, 2, 7);
  EXPECT_TRUE(at::equal(back, x.detach()));
  // Gradients: through pack, each token's weight at its packed row; through
  // unpack, each packed row's token weight, zero rows nothing.
  auto w_packed = at::randn({2, p.length, 3}, at::kDouble);
  auto gx = torch::autograd::grad({(pack_spans(x, p) * w_packed).sum()}, {x})[0];
  EXPECT_TRUE(at::equal(
      gx, w_packed.reshape({2 * p.length, 3}).index_select(0, p.scatter).view({2, 7, 3})));
  auto y = at::randn({2, p.length, 3}, at::kDouble).requires_grad_();
  auto w = at::randn({2, 7, 3}, at::kDouble);
  auto gy = torch::autograd::grad({(unpack_spans(y, p, 2, 7) * w).sum()}, {y})[0];
  auto want =
      at::cat({w.reshape({14, 3}), at::zeros({1, 3}, at::kDouble)}).index_select(0, p.gather);
  EXPECT_TRUE(at::equal(gy, want.view({2, p.length, 3})));
}

// Documents of lengths that cross chunk edges and stop short of them; a
// span of one token; both rows cut mid-document.
at::Tensor mixed_starts() {
  std::vector<int> r0(23, 0), r1(23, 0);
  for (int t : {5, 6, 14}) r0[t] = 1;
  for (int t : {9, 17}) r1[t] = 1;
  return starts_of({r0, r1});
}

// Each input's span, alone: [1, L, ...].
std::vector<at::Tensor> span_of(const std::vector<at::Tensor>& xs, const DocumentSpan& s) {
  std::vector<at::Tensor> out;
  for (const auto& x : xs) out.push_back(x.narrow(0, s.row, 1).narrow(1, s.start, s.length));
  return out;
}

// The op over packed documents against the same op on each document alone,
// outputs and every input's gradient, each span compared bitwise.
void expect_packed_as_alone(const Documents& d, std::vector<at::Tensor> xs,
                            const std::function<at::Tensor(const std::vector<at::Tensor>&,
                                                           const Documents*)>& op) {
  for (auto& x : xs) x.requires_grad_();
  auto y = op(xs, &d);
  auto w = at::randn(y.sizes(), y.options());
  auto grads = torch::autograd::grad({(y * w).sum()}, xs);
  for (const auto& s : d.spans()) {
    std::vector<at::Tensor> alone;
    for (const auto& x : span_of(xs, s)) alone.push_back(x.detach().clone().requires_grad_());
    auto ya = op(alone, nullptr);
    const auto wa = span_of({w}, s)[0];
    auto ga = torch::autograd::grad({(ya * wa).sum()}, alone);
    EXPECT_TRUE(at::equal(span_of({y.detach()}, s)[0], ya.detach()))
        << "row " << s.row << " span at " << s.start << " length " << s.length << ": max diff "
        << (span_of({y.detach()}, s)[0] - ya.detach()).abs().max().item<double>();
    for (size_t i = 0; i < xs.size(); ++i) {
      EXPECT_TRUE(at::equal(span_of({grads[i]}, s)[0], ga[i]))
          << "input " << i << ", row " << s.row << " span at " << s.start << ": max diff "
          << (span_of({grads[i]}, s)[0] - ga[i]).abs().max().item<double>();
    }
  }
}

TEST(Documents, PackedKdaIsEachDocumentAlone) {
  const Documents d(mixed_starts(), true);
  for (const auto dtype : {at::kDouble, at::kFloat}) {
    torch::manual_seed(3);
    const auto o = at::TensorOptions().dtype(dtype);
    const int64_t B = 2, T = 23, H = 2, D = 4;
    auto nrm = [](const at::Tensor& x) { return x / x.norm(2, -1, true); };
    std::vector<at::Tensor> xs{nrm(at::randn({B, T, H, D}, o)) * 0.5,
                               nrm(at::randn({B, T, H, D}, o)), at::randn({B, T, H, D}, o),
                               -at::rand({B, T, H, D}, o), at::sigmoid(at::randn({B, T, H}, o))};
    expect_packed_as_alone(d, xs, [](const std::vector<at::Tensor>& x, const Documents* docs) {
      return kda(x[0], x[1], x[2], x[3], x[4], /*chunk_size=*/4, KernelOptions{}, {}, docs);
    });
  }
}

TEST(Documents, PackedShortConvIsEachDocumentAlone) {
  const Documents d(mixed_starts(), true);
  for (const auto dtype : {at::kDouble, at::kFloat}) {
    torch::manual_seed(4);
    const auto o = at::TensorOptions().dtype(dtype);
    // 16 channels, as a model's widths are multiples of the vector width:
    // ATen's elementwise loops take a scalar exp (silu) on a row's tail
    // past the last full vector, a few ulp from the vector one, and a
    // packed token's place in the row differs from its place alone.
    auto weight = at::randn({16, 4}, o.dtype(at::kFloat));
    expect_packed_as_alone(d, {at::randn({2, 23, 16}, o)},
                           [&](const std::vector<at::Tensor>& x, const Documents* docs) {
                             return short_conv_silu(x[0], weight, KernelOptions{}, docs);
                           });
  }
}

}  // namespace
}  // namespace viaduct::ops
