// Every difference between LibTorch 1.13 (Debian, CPU) and 2.x (the PyTorch
// wheel, CUDA) lives here. No other file tests TORCH_VERSION.
#pragma once

#include <torch/torch.h>
#include <torch/version.h>

#include <optional>

namespace viaduct::compat {

constexpr bool kTorch2 = TORCH_VERSION_MAJOR >= 2;

// Causal scaled-dot-product attention. q: [B, H, T, hd]; k, v: [B, H, T, hd]
// (KV heads already repeated for GQA). 2.x picks flash / mem-efficient /
// cuDNN / math itself; 1.13 has only the private composite form.
inline at::Tensor causal_sdpa(const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
#else
  return std::get<0>(at::_scaled_dot_product_attention(
      q, k, v, {}, 0.0, /*need_attn_weights=*/false, /*is_causal=*/true));
#endif
}

// Pinned host memory exists only with CUDA (1.13's CPU build throws).
inline bool pinned_memory_available() { return torch::cuda::is_available(); }

inline std::string torch_version() { return TORCH_VERSION; }

}  // namespace viaduct::compat

// ------------------------------------------------------------------- c10d
// The c10d backend base: 1.13's Gloo/NCCL groups derive from ProcessGroup,
// 2.x's from Backend (the 2.x ProcessGroup is a dispatcher front end we do not
// use). The collective signatures on the concrete classes are the same in
// both; see dist/dist.h. Options' optionals are assigned by value there.
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

namespace viaduct::compat {
#if TORCH_VERSION_MAJOR >= 2
using PgBase = c10d::Backend;
#else
using PgBase = c10d::ProcessGroup;
#endif
}  // namespace viaduct::compat

#ifdef VIADUCT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>

namespace viaduct::compat {
// Peak bytes allocated by the caching allocator on `device`. The stat enum
// moved from c10::cuda::CUDACachingAllocator to c10::CachingAllocator in 2.x.
inline double cuda_peak_allocated_bytes(c10::DeviceIndex device) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
#if TORCH_VERSION_MAJOR >= 2
  constexpr auto kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
#else
  constexpr auto kAggregate =
      static_cast<size_t>(c10::cuda::CUDACachingAllocator::StatType::AGGREGATE);
#endif
  return static_cast<double>(stats.allocated_bytes[kAggregate].peak);
}
}  // namespace viaduct::compat
#endif  // VIADUCT_WITH_CUDA
