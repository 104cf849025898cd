// Where documents start in a batch's windows, from the token files'
// document marker: what block_causal training (see Note [Document
// boundaries], ops/documents.h) keeps apart, and the targets it does not
// train.
#pragma once

#include <torch/torch.h>

#include "data/sampler.h"
#include "data/token_file.h"

namespace viaduct::data {

// inputs: [B, T] int64 tokens. [B, T] bool: true where a document starts as
// `marker` says -- at the marker itself when it starts documents, after it
// when it ends them (column 0 then only where the window does not say,
// false). `marker` must be recorded.
at::Tensor document_starts(const at::Tensor& inputs, const DocumentMarker& marker);

// Sets to -100 (ignored by the loss and the token count) every target that
// is a document's first token: the model is not trained to predict a
// document from the end of the one before it.
void mask_document_start_targets(TokenBatch& batch, const DocumentMarker& marker);

}  // namespace viaduct::data
