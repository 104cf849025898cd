// The documents packed into a micro-batch's windows, and how the token
// mixers run on them: each document as a sequence of its own.
//
// Note [Document boundaries]
// Pre-training packs documents end to end into windows. Under
// model.attn_mask_type = "block_causal" the documents of a window do not
// see each other: a token attends only to the tokens of its own document
// before it, KDA's recurrent state starts from zero at each document, its
// short convolutions see zeros before a document's first token, positions
// (RoPE, gpt2's learned positions) restart at 0 under reset_position_ids,
// and the loss does not train a document's first token on the previous
// document's last (that target is ignored, data::mask_document_start_targets).
//
// Where documents start comes from the data: the token files record their
// document marker (data::DocumentMarker: a token that starts or one that
// ends each document), and data::document_starts finds the starts of a
// micro-batch's input tokens; a row's first token always starts a span.
// Every rank draws the same batches from the sampler, so every pipeline
// rank derives the same Documents from the micro-batch's inputs itself
// (train/trainer.cpp) and hands them to its model parts before each
// forward (ModelPart::set_documents); nothing about documents crosses a
// stage boundary. A layer that checkpoints its activations keeps the
// Documents of its micro-batch for the recompute.
//
// Each token mixer runs its documents as sequences of their own, in one of
// three ways. Attention and MLA run per_document on the CPU (every span of
// every row as [1, L, ...] through the op's one path, the outputs put back
// in place) and as flash's variable-length batch (cu_seqlens) on a GPU.
// KDA's recurrence and the short convolutions run in place on viaduct's
// kernels (see Note [KDA chunks over documents]) and packed on ATen's
// forms (see Note [Packed documents]). Either way a span meets the same
// arithmetic as its document alone from position 0; token-wise layers
// (projections, norms, the FFN and a dropless MoE) need nothing. One caveat
// on the CPU: ATen's elementwise loops take a tensor's last partial vector
// through scalar transcendentals (exp, a few ulp from the vector ones), so
// a sigmoid or softmax over a per-token width that is not a multiple of
// the vector length can round a token by its place in the micro-batch.
//
// Note [Packed documents]
// A mixer whose work is laid out along the sequence in fixed blocks runs a
// micro-batch's documents with each row's spans moved apart:
// Documents::packed(align, gap) places a row's spans one after another in
// a row of its own, the first at 0, each next on a multiple of `align` and
// at least `gap` rows after the previous one ends, zero rows between and
// after (every packed row as long as the longest). The short convolution
// packs with gap = kernel - 1: a span's first tokens read the zeros before
// it, as they read the padding alone, and nothing of the previous span.
// KDA packs with align = its chunk: no chunk holds two spans, the zero rows
// after a span change nothing (beta = 0, g = 0), and the scan over chunks
// starts the state from zero at each span's first chunk
// (PackedSpans::chunk_starts). The KDA layer packs once for both: align =
// chunk and gap = kernel - 1, its three convolutions and the recurrence on
// the same packed rows, one unpack of the output (a span's arithmetic does
// not depend on where its row places it, so the bits are those of two
// packings). One call serves every document, where a
// call per span would launch once per span; the rows stay rows, so the
// scan keeps its B H independent chains, each longer only by the padding.
// Pack and unpack are gathers by index in both directions (their backward
// is the other's forward), so no sum is reordered and no atomics run.
// Each op packs for itself (the convolution with gap = kernel - 1, the
// recurrence with align = chunk): this is the ATen forms' way, where the
// gathers cost little beside the arithmetic; viaduct's kernels need none.
//
// Note [KDA chunks over documents]
// viaduct's KDA kernels read each chunk's rows through an index, so the
// chunks can lie over the documents where they are: Documents::kda_chunks
// cuts each row's spans into chunks of C tokens from each span's start (a
// span's last chunk is partial), a table of (first token, count) per
// chunk. They are the packed chunks at align = C (see Note [Packed documents]),
// in the same order, holding the same tokens at the same in-chunk rows, and
// a chunk's rows past its count read as zero as the packed zero rows do;
// so every output and gradient has the packed form's bits, without the
// gathers (five inputs and the output each way) or the padded rows in the
// layers around the recurrence. The scan restarts the state at each span's
// first chunk as before. The recurrence's per-chunk products live in a
// chunk layout [B H N, C]: the output's products write each chunk row
// straight to its token's row (the chunk table says which), and the
// backward gathers the output's gradient into the chunks by index (read)
// where the plain chunks take a transpose, and dbeta back (places).
// The short convolution runs in place too: each token's offset in its
// document (Documents::offsets) bounds how far back its taps reach, and a
// skipped tap is the zero product the padding before a document alone
// would add. The convolution's weight gradient sums over the micro-batch
// in blocks of tokens, so its order follows the tokens' places (not
// bitwise the packed form's).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/fused.h"

namespace viaduct::ops {

// The tokens [start, start + length) of row `row`: one document, or the
// piece of one that the window holds.
struct DocumentSpan {
  int64_t row = 0;
  int64_t start = 0;
  int64_t length = 0;
};

// A micro-batch's spans packed row by row (see Note [Packed documents]).
struct PackedSpans {
  int64_t length = 0;         // tokens of each packed row
  int64_t align = 1;          // every span starts at a multiple of it
  at::Tensor gather;          // [B length] int64: each place's token b T + t, or B T (zeros)
  at::Tensor scatter;         // [B T] int64: each token's place b length + i
  at::Tensor gather_read;     // gather with the zero places reading token 0
  at::Tensor zero_places;     // [places] int64: where gather reads no token
  std::vector<int64_t> span_rows;  // where each span starts in its packed row
  // [B, ceil(length / align)] uint8: 1 where a span starts the block (chunk).
  at::Tensor chunk_starts;
};

class Documents {
 public:
  // `starts`: [B, T] bool on the CPU, true where a document starts (column
  // 0 starts a span whatever it holds). `reset_positions`: positions
  // restart at each span (model.reset_position_ids); else they run through
  // the window.
  Documents(const at::Tensor& starts, bool reset_positions);

  int64_t rows() const { return rows_; }
  int64_t seq_len() const { return seq_len_; }
  bool reset_positions() const { return reset_positions_; }
  // Row-major: by row, then by start.
  const std::vector<DocumentSpan>& spans() const { return spans_; }
  // The position of span s's first token: 0, or s.start when positions run
  // through the window.
  int64_t first_position(const DocumentSpan& s) const { return reset_positions_ ? 0 : s.start; }
  // [B, T] int64 on the CPU: each token's position (see first_position).
  const at::Tensor& positions() const { return positions_; }
  // The same on `device`, copied once per device and kept (every layer of
  // the micro-batch gathers its rotary tables or positions by it).
  at::Tensor positions(at::Device device) const;
  // [spans + 1] int32 on `device`: where each span starts in the B x T
  // tokens flattened row by row, then B x T (flash's cu_seqlens). Made once
  // per device and kept: every layer of the micro-batch asks for it.
  at::Tensor cu_seqlens(at::Device device = at::kCPU) const;
  // The spans packed with `align` and `gap` (see Note [Packed documents]),
  // its index tensors on `device`; made once and kept.
  const PackedSpans& packed(int64_t align, int64_t gap, at::Device device) const;
  // [B, T] int32 on `device`: each token's offset in its span (0 at a
  // span's first token); made once per device and kept.
  at::Tensor offsets(at::Device device) const;
  // KDA's chunks of `chunk` tokens over the spans in place, for `heads`
  // heads (see Note [KDA chunks over documents]), on `device`; made once and
  // kept.
  const kernels::KdaDocumentChunks& kda_chunks(int64_t chunk, int64_t heads,
                                               at::Device device) const;

  // Runs `fn` on every span: its arguments are each of `xs` ([B, T, ...],
  // one row and its span cut along dim 1: [1, L, ...]); it returns
  // [1, L, ...]. The results, put back at their spans: [B, T, ...].
  using SpanFn = std::function<at::Tensor(const std::vector<at::Tensor>&, const DocumentSpan&)>;
  at::Tensor per_document(const std::vector<at::Tensor>& xs, const SpanFn& fn) const;

 private:
  int64_t rows_ = 0;
  int64_t seq_len_ = 0;
  bool reset_positions_ = true;
  std::vector<DocumentSpan> spans_;
  at::Tensor positions_;
  at::Tensor offsets_;
  // What cu_seqlens, positions, offsets, packed and kda_chunks made, by
  // device and layout; a
  // micro-batch's layers share one Documents, so the mutex guards the first
  // use of each.
  mutable std::mutex cache_mutex_;
  mutable std::map<std::string, at::Tensor> cu_seqlens_;
  mutable std::map<std::string, at::Tensor> positions_on_;
  mutable std::map<std::string, at::Tensor> offsets_on_;
  mutable std::map<std::string, std::unique_ptr<PackedSpans>> packed_;
  mutable std::map<std::string, std::unique_ptr<kernels::KdaDocumentChunks>> kda_chunks_;
};

// x [B, T, ...] -> [B, length, ...] and back; differentiable.
at::Tensor pack_spans(const at::Tensor& x, const PackedSpans& p);
at::Tensor unpack_spans(const at::Tensor& y, const PackedSpans& p, int64_t rows, int64_t seq_len);

// Shared by a micro-batch's forward and any recompute of it; null: plain
// causal (the whole window one sequence).
using DocumentsPtr = std::shared_ptr<const Documents>;

}  // namespace viaduct::ops
