// Every difference between LibTorch 1.13 (Debian, CPU) and 2.x (the PyTorch
// wheel, CUDA) lives here. No other file tests TORCH_VERSION.
#pragma once

#include <torch/torch.h>
#include <torch/version.h>

#include <atomic>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace viaduct::compat {

constexpr bool kTorch2 = TORCH_VERSION_MAJOR >= 2;

// The CUDA caching allocator's settings when the user gave none: expandable
// segments, so that memory freed by one phase of a step (the forward's
// activations) can serve another phase's differently sized blocks instead
// of staying reserved in segments that fit neither; without them a batch
// whose live tensors fit can still fail with gigabytes "reserved but
// unallocated". Set in the environment before the allocator reads it (the
// first CUDA allocation), only where the option exists (LibTorch >= 2.1),
// as PYTORCH_CUDA_ALLOC_CONF: every 2.x reads that name for CUDA, while the
// newer PYTORCH_ALLOC_CONF is not read for CUDA by every release. A user's
// own PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF wins.
inline void default_cuda_allocator_settings() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  if (std::getenv("PYTORCH_ALLOC_CONF") != nullptr ||
      std::getenv("PYTORCH_CUDA_ALLOC_CONF") != nullptr) {
    return;
  }
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", /*overwrite=*/0);
#endif
}

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

// Causal flash attention as its two ATen ops (LibTorch 2.x, CUDA): what
// causal_sdpa runs for the half-precision inputs flash takes, exposed so
// that an autograd function of ours can keep its outputs and call its
// backward (see Note [Per-op activation checkpointing], ops/recompute.h).
// flash_attention_applies: q, k, v [B, H, T, hd] on CUDA in bf16 or fp16,
// one head dim (a multiple of 8, at most 256), H and T alike, last dim
// dense. 1.13: never.
inline bool flash_attention_applies(const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  const auto hd = q.size(-1);
  return q.is_cuda() && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf) &&
         k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
         q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes() && hd % 8 == 0 &&
         hd <= 256 && q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1 &&
         at::globalContext().userEnabledFlashSDP();
#else
  (void)q, (void)k, (void)v;
  return false;
#endif
}

// {out [B, H, T, hd], logsumexp, cum_seq_q, cum_seq_k, philox_seed,
// philox_offset}: the forward's outputs its backward reads.
inline std::vector<at::Tensor> causal_flash_forward(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  auto r = at::_scaled_dot_product_flash_attention(q, k, v, 0.0, /*is_causal=*/true);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r),
          std::get<3>(r), std::get<6>(r), std::get<7>(r)};
#else
  (void)q, (void)k, (void)v;
  throw std::runtime_error("flash attention ops need LibTorch 2.x");
#endif
}

// {dq, dk, dv} from causal_flash_forward's outputs `fwd`.
inline std::vector<at::Tensor> causal_flash_backward(const at::Tensor& grad, const at::Tensor& q,
                                                     const at::Tensor& k, const at::Tensor& v,
                                                     const std::vector<at::Tensor>& fwd) {
#if TORCH_VERSION_MAJOR >= 2
  auto r = at::_scaled_dot_product_flash_attention_backward(
      grad, q, k, v, fwd[0], fwd[1], fwd[2], fwd[3], /*max_q=*/q.size(2), /*max_k=*/k.size(2),
      0.0, /*is_causal=*/true, fwd[4], fwd[5]);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
#else
  (void)grad, (void)q, (void)k, (void)v, (void)fwd;
  throw std::runtime_error("flash attention ops need LibTorch 2.x");
#endif
}

// One multi-tensor AdamW update (decoupled decay, bias-corrected moments) of
// CUDA fp32 tensors through ATen's fused kernel; `step` holds the 1-based
// step count as a one-element fp32 tensor on the same device. Returns false
// where LibTorch has no such kernel (1.13): the caller runs its own loop.
inline bool fused_adamw(at::TensorList params, at::TensorList grads, at::TensorList exp_avg,
                        at::TensorList exp_avg_sq, const at::Tensor& step, double lr,
                        double beta1, double beta2, double weight_decay, double eps) {
#if TORCH_VERSION_MAJOR >= 2
  const std::vector<at::Tensor> steps(params.size(), step);  // read-only in the kernel
  at::_fused_adamw_(params, grads, exp_avg, exp_avg_sq, /*max_exp_avg_sqs=*/{}, steps, lr,
                    beta1, beta2, weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false);
  return true;
#else
  (void)params, (void)grads, (void)exp_avg, (void)exp_avg_sq, (void)step, (void)lr,
      (void)beta1, (void)beta2, (void)weight_decay, (void)eps;
  return false;
#endif
}

// c = a @ b (accumulate: c += a @ b) with c fp32 and a, b bf16/fp16: on
// CUDA with LibTorch >= 2.8 one GEMM writing (or accumulating into) c in
// fp32 (cuBLAS's fp32 output); else the product rounded to a's dtype, cast
// and copied or added (two more passes over c). A build that refuses the
// fp32-out GEMM (its checks run before any write) takes the fallback from
// then on.
inline void matmul_into_fp32_(at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
                              bool accumulate) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  static std::atomic<bool> works{true};
  if (works && c.is_cuda() && c.scalar_type() == at::kFloat && c.is_contiguous() &&
      a.scalar_type() == b.scalar_type() &&
      (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf)) {
    try {
      // beta = 0 ignores c's contents (NaN included).
      at::addmm_out(c, c, a, b, at::kFloat, /*beta=*/accumulate ? 1 : 0);
      return;
    } catch (const c10::Error&) {
      works = false;
    }
  }
#endif
  if (accumulate) {
    c.add_(at::matmul(a, b).to(c.scalar_type()));
  } else {
    c.copy_(at::matmul(a, b));
  }
}

// Grouped GEMMs (at::_grouped_mm, LibTorch >= 2.8, CUDA, bf16): the MoE's
// experts over tokens sorted by expert, one launch for every expert.
// LibTorch 1.13 has none: callers keep their per-expert loop there.
constexpr bool kGroupedMm =
    TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8);

// out[rows of group e] = a[rows of group e] @ b[e]: a [M, K], b [E, K, N],
// offs int32 [E] the groups' end rows (rows past offs[E - 1] are left
// unwritten).
inline at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  return at::_grouped_mm(a, b, offs);
#else
  (void)a, (void)b, (void)offs;
  throw std::runtime_error("grouped GEMM needs LibTorch >= 2.8");
#endif
}

// out[e] = a[:, cols of group e] @ b[rows of group e] in fp32: a [N, M],
// b [M, K], offs int32 [E] the groups' end columns of a (rows of b);
// returns [E, N, K] (the experts' weight gradients). A build that refuses
// an fp32 output (its checks run before any write) has its bf16 product
// cast from then on.
inline at::Tensor grouped_mm_fp32(const at::Tensor& a, const at::Tensor& b,
                                  const at::Tensor& offs) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  static std::atomic<bool> works{true};
  if (works) {
    try {
      return at::_grouped_mm(a, b, offs, std::nullopt, at::kFloat);
    } catch (const c10::Error&) {
      works = false;
    }
  }
  return at::_grouped_mm(a, b, offs).to(at::kFloat);
#else
  (void)a, (void)b, (void)offs;
  throw std::runtime_error("grouped GEMM needs LibTorch >= 2.8");
#endif
}

// causal_sdpa with k, v of fewer (grouped) heads: [B, KV, T, hd], H % KV == 0;
// the KV heads are repeated to H. (SDPA's own enable_gqa, LibTorch >= 2.5,
// is not used: it ran slower than repeating the heads.)
inline at::Tensor causal_sdpa_gqa(const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& v) {
  const auto H = q.size(1), KV = k.size(1);
  if (KV == H) return causal_sdpa(q, k, v);
  return causal_sdpa(q, k.repeat_interleave(H / KV, 1), v.repeat_interleave(H / KV, 1));
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
