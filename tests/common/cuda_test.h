// What the CUDA tests of src/kernels share: whether a GPU the kernels were
// built for is here, a fresh seed per run (printed by the tests on
// failure), and the relative Frobenius error they bound.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>

#include "kernels/fused.h"

namespace viaduct::testing_cuda {

inline bool have_gpu() {
  return torch::cuda::is_available() &&
         kernels::usable(at::empty({1}, at::TensorOptions(at::kCUDA).dtype(at::kFloat)));
}

// Seeds LibTorch's generator from the random device and returns the seed.
inline uint64_t fresh_seed() {
  static std::random_device rd;
  const uint64_t s = (static_cast<uint64_t>(rd()) << 32) | rd();
  torch::manual_seed(s);
  return s;
}

// ||out - reference|| / ||reference|| in fp64 on the CPU; infinite when out has a
// non-finite value.
inline double rel_err(const at::Tensor& out, const at::Tensor& reference) {
  auto o = out.to(at::kCPU, at::kDouble), r = reference.to(at::kCPU, at::kDouble);
  if (!at::isfinite(o).all().item<bool>()) return INFINITY;
  return (o - r).norm().item<double>() / std::max(r.norm().item<double>(), 1e-30);
}

}  // namespace viaduct::testing_cuda

#define REQUIRE_GPU()                           \
  if (!::viaduct::testing_cuda::have_gpu()) \
  GTEST_SKIP() << "no GPU the fused kernels were built for"
