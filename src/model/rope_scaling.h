// llama-3.1/3.2's RoPE frequency scaling (`rope_scaling` of type "llama3" in
// a Hugging Face config.json): rotary frequencies whose wavelength is
// shorter than original_max_seq_len / high_freq_factor are kept, those
// longer than original_max_seq_len / low_freq_factor are divided by factor,
// and those in between are interpolated:
//
//   w = 2 pi / f,  L = original_max_seq_len
//   f' = f                              w < L / high_freq_factor
//   f' = f / factor                     w > L / low_freq_factor
//   f' = (1 - s) f / factor + s f       otherwise,
//        s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)
//
// The cos/sin are not rescaled (the attention factor of this type is 1).
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "ops/rope.h"

namespace viaduct {

struct RopeScaling {
  double factor = 0.0;  // 0: no scaling
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_seq_len = 8192;
  bool enabled() const { return factor > 0.0; }
};

// The rotary frequencies theta^(-2i / head_dim), scaled: fp64 [head_dim / 2].
at::Tensor rope_frequencies(int64_t head_dim, double theta, const RopeScaling& scaling);

// ops::make_rope_tables itself without scaling; with it, the same tables of
// the scaled frequencies.
ops::RopeTables make_scaled_rope_tables(int64_t head_dim, int64_t max_seq_len, double theta,
                                        const RopeScaling& scaling);

}  // namespace viaduct
