// Layout-independent randomness. A parameter's initial value depends only on
// (seed, FQN), never on which stage or rank builds it, so every pipeline
// layout starts from the bits of the single process.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace viaduct {

uint64_t fnv1a64(const std::string& s);

// A CPU generator seeded from (seed, name).
at::Generator make_generator(uint64_t seed, const std::string& name);

// In-place initialisers drawn on CPU in fp32 and copied into `t` (any device,
// any dtype), so the bits do not depend on the device.
void init_normal_(at::Tensor t, double std, uint64_t seed,
                  const std::string& fqn);
// Truncated normal with absolute bounds [a, b] (as torch.nn.init does).
void init_trunc_normal_(at::Tensor t, double std, double a, double b,
                        uint64_t seed, const std::string& fqn);

}  // namespace viaduct
