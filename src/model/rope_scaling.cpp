// llama3 RoPE frequency scaling (see rope_scaling.h for the formula).
#include "model/rope_scaling.h"

#include <cmath>

#include "core/check.h"

namespace viaduct {

at::Tensor rope_frequencies(int64_t head_dim, double theta, const RopeScaling& s) {
  auto idx = torch::arange(0, head_dim, 2, torch::kDouble);
  auto f = 1.0 / torch::pow(theta, idx / static_cast<double>(head_dim));  // [hd/2]
  if (!s.enabled()) return f;
  VIADUCT_CHECK_T(ConfigError, s.high_freq_factor > s.low_freq_factor,
                  "model.rope_scaling_high_freq_factor (", s.high_freq_factor,
                  ") must exceed model.rope_scaling_low_freq_factor (", s.low_freq_factor, ")");
  const double L = static_cast<double>(s.original_max_seq_len);
  auto wavelen = 2.0 * M_PI / f;
  auto slow = f / s.factor;
  auto smooth = (L / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  auto mid = (1.0 - smooth) * slow + smooth * f;
  auto out = torch::where(wavelen > L / s.low_freq_factor, slow, mid);
  return torch::where(wavelen < L / s.high_freq_factor, f, out);
}

ops::RopeTables make_scaled_rope_tables(int64_t head_dim, int64_t max_seq_len, double theta,
                                        const RopeScaling& s) {
  if (!s.enabled()) return ops::make_rope_tables(head_dim, max_seq_len, theta);
  VIADUCT_CHECK(head_dim % 2 == 0, "rotary embeddings need an even head_dim, got ", head_dim);
  auto t = torch::arange(max_seq_len, torch::kDouble);
  auto freqs = torch::outer(t, rope_frequencies(head_dim, theta, s));  // [T, hd/2]
  return {freqs.cos(), freqs.sin()};
}

}  // namespace viaduct
