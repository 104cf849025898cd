#include "core/rng.h"

namespace viaduct {

uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

at::Generator make_generator(uint64_t seed, const std::string& name) {
  // splitmix-style mixing keeps nearby seeds apart.
  uint64_t x = seed * 0x9E3779B97F4A7C15ULL ^ fnv1a64(name);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return at::make_generator<at::CPUGeneratorImpl>(x);
}

void init_normal_(at::Tensor t, double std, uint64_t seed,
                  const std::string& fqn) {
  torch::NoGradGuard no_grad;
  auto gen = make_generator(seed, fqn);
  auto cpu = at::empty(t.sizes(), at::TensorOptions().dtype(at::kFloat));
  cpu.normal_(0.0, std, gen);
  t.copy_(cpu);
}

void init_trunc_normal_(at::Tensor t, double std, double a, double b,
                        uint64_t seed, const std::string& fqn) {
  torch::NoGradGuard no_grad;
  auto gen = make_generator(seed, fqn);
  auto cpu = at::empty(t.sizes(), at::TensorOptions().dtype(at::kFloat));
  cpu.normal_(0.0, std, gen);
  // Resample out-of-range values (a few rounds suffice; clamp the rest).
  for (int round = 0; round < 8; ++round) {
    auto bad = (cpu < a) | (cpu > b);
    if (!bad.any().item<bool>()) break;
    auto fresh = at::empty(t.sizes(), cpu.options());
    fresh.normal_(0.0, std, gen);
    cpu = at::where(bad, fresh, cpu);
  }
  cpu.clamp_(a, b);
  t.copy_(cpu);
}

}  // namespace viaduct
