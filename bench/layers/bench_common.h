// What the layer benchmarks share: the median time of a forward +
// backward, and document layouts (each row of a [B, T] window cut into
// documents of lengths drawn from an exponential law, seeded, at least one
// token, as packed pre-training data looks).
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "core/device.h"

namespace viaduct::bench {

// The median milliseconds of `fn` over `iters` runs after 3 untimed, the
// device synchronized around each; `after` runs after each, untimed.
inline double median_ms(const std::function<void()>& fn, int iters, const at::Device& dev,
                        const std::function<void()>& after = {}) {
  std::vector<double> times;
  for (int i = 0; i < iters + 3; ++i) {
    synchronize(dev);
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    synchronize(dev);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (i >= 3) times.push_back(ms);
    if (after) after();
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

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
