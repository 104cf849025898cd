// The documents packed into a micro-batch's windows, and the one way a
// token mixer runs on them: on each document alone.
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
// Each token mixer (attention, MLA, KDA's recurrence, the short
// convolutions) runs per_document: every span of every row as a sequence of
// its own, [1, L, ...], through the op's one path, and the outputs put back
// in place -- the variable-length batch of flash's cu_seqlens, evaluated
// span by span. A span runs the same op on the same shape as its document
// alone from position 0, so its mixer outputs are those bits; token-wise
// layers (projections, norms, the FFN and a dropless MoE) need nothing.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace viaduct::ops {

// The tokens [start, start + length) of row `row`: one document, or the
// piece of one that the window holds.
struct DocumentSpan {
  int64_t row = 0;
  int64_t start = 0;
  int64_t length = 0;
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
  // [spans + 1] int32 on the CPU: where each span starts in the B x T
  // tokens flattened row by row, then B x T (flash's cu_seqlens).
  at::Tensor cu_seqlens() const;

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
};

// Shared by a micro-batch's forward and any recompute of it; null: plain
// causal (the whole window one sequence).
using DocumentsPtr = std::shared_ptr<const Documents>;

}  // namespace viaduct::ops
