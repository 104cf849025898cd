// Document layouts for the layer benchmarks: each row of a [B, T] window
// cut into documents of lengths drawn from an exponential law (seeded, at
// least one token), as packed pre-training data looks.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <random>

namespace viaduct::bench {

// [B, T] bool: true where a document starts; lengths of mean `mean`.
inline at::Tensor document_starts(int64_t B, int64_t T, double mean, uint64_t seed = 7) {
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> length(1.0 / mean);
  auto starts = at::zeros({B, T}, at::kBool);
  auto* s = starts.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; t += std::max<int64_t>(1, static_cast<int64_t>(length(rng)))) {
      s[b * T + t] = true;
    }
  }
  return starts;
}

}  // namespace viaduct::bench
