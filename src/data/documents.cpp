#include "data/documents.h"

#include "core/check.h"

namespace viaduct::data {

at::Tensor document_starts(const at::Tensor& inputs, const DocumentMarker& marker) {
  VIADUCT_CHECK(marker.recorded(), "document starts need a recorded document marker");
  VIADUCT_CHECK(inputs.dim() == 2, "tokens must be [B, T], got ", inputs.sizes());
  if (marker.kind == DocumentMarker::Kind::kStarts) return inputs == marker.token;
  // The token after an end marker starts the next document.
  auto starts = at::zeros(inputs.sizes(), inputs.options().dtype(at::kBool));
  const auto T = inputs.size(1);
  if (T > 1) starts.narrow(1, 1, T - 1).copy_(inputs.narrow(1, 0, T - 1) == marker.token);
  return starts;
}

void mask_document_start_targets(TokenBatch& batch, const DocumentMarker& marker) {
  VIADUCT_CHECK(marker.recorded(), "document starts need a recorded document marker");
  // targets[t] is window token t + 1: a start when it is the start marker,
  // or when inputs[t] (window token t) ends a document.
  const auto first = marker.kind == DocumentMarker::Kind::kStarts ? batch.targets == marker.token
                                                                  : batch.inputs == marker.token;
  batch.targets = batch.targets.masked_fill(first, -100);
}

}  // namespace viaduct::data
