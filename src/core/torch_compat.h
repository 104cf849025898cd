// Every difference between LibTorch 1.13 (Debian, CPU) and 2.x (the PyTorch
// wheel, CUDA) lives here. No other file tests TORCH_VERSION.
#pragma once

#include <torch/torch.h>
#include <torch/version.h>

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

// Under deterministic algorithms LibTorch 2.1 and later also fill every
// tensor an op allocates without initialising (at::empty and the outputs
// of most ops, before the op writes them) with NaN, so that a read of
// memory nobody wrote gives the same bits each run. It is a check, not a
// need of deterministic kernels, and it costs one fill launch per
// allocation. Off here: the kernels' tests poison free memory with NaN to
// find such reads, and the bitwise layout tests run without the fill.
inline void set_deterministic_fill(bool on) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  at::globalContext().setDeterministicFillUninitializedMemory(on);
#else
  (void)on;
#endif
}

// The fused attention kernels of LibTorch 2.x on CUDA, as pairs of ATen ops
// (a forward that returns what its backward reads, and that backward), so
// that an autograd function of ours can keep the forward's outputs and call
// the backward itself (see Note [Per-op activation checkpointing],
// ops/recompute.h). Which pair runs is the one scaled_dot_product_attention
// would pick for the same tensors (at::_fused_sdp_choice): cuDNN's where
// LibTorch takes it, flash's otherwise. LibTorch refuses cuDNN's pair under
// deterministic algorithms because its backward does not promise the same
// bits run to run; its forward does (no atomics: each output tile is one
// block's sum in a fixed order). So under deterministic algorithms, where
// cuDNN's pair would be taken without them, kCudnnFlash runs cuDNN's
// forward (about 1.5 times as fast as flash's on Hopper) and flash's
// deterministic backward on cuDNN's output and log-sum-exp: the same
// statistics of the same softmax, so flash's backward gives the gradients
// of cuDNN's forward, to rounding.
enum class FusedAttention { kNone, kFlash, kCudnn, kCudnnFlash };

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
#define VIADUCT_FUSED_ATTENTION 1
#else
#define VIADUCT_FUSED_ATTENTION 0
#endif

// The pair for causal attention of q, k, v [B, H, T, hd] (k, v repeated to
// H heads): kNone off CUDA, in fp32, and before LibTorch 2.8 (the plain
// causal_sdpa runs, with ATen's own autograd).
inline FusedAttention fused_attention_for(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v) {
#if VIADUCT_FUSED_ATTENTION
  if (!q.is_cuda() || q.dim() != 4) return FusedAttention::kNone;
  // SDPBackend's values (ATen/native/transformers/sdp_utils_cpp.h).
  constexpr int64_t kFlashChoice = 1, kCudnnChoice = 3;
  auto choice = [&] { return at::_fused_sdp_choice(q, k, v, {}, 0.0, /*is_causal=*/true); };
  const int64_t picked = choice();
  if (picked == kCudnnChoice) return FusedAttention::kCudnn;
  if (picked != kFlashChoice) return FusedAttention::kNone;
  auto& ctx = at::globalContext();
  const bool deterministic = ctx.deterministicAlgorithms(),
             warn_only = ctx.deterministicAlgorithmsWarnOnly();
  if (!deterministic || warn_only) return FusedAttention::kFlash;
  // Asked again with deterministic algorithms off for the call (the one
  // global switch LibTorch's choice reads; the training step runs on one
  // thread, and the data and checkpoint threads run no CUDA kernels that
  // consult it), restored on the way out whatever the call does.
  struct Restore {
    at::Context& ctx;
    bool deterministic, warn_only;
    ~Restore() { ctx.setDeterministicAlgorithms(deterministic, warn_only); }
  } restore{ctx, deterministic, warn_only};
  ctx.setDeterministicAlgorithms(false, false);
  return choice() == kCudnnChoice ? FusedAttention::kCudnnFlash : FusedAttention::kFlash;
#else
  (void)q, (void)k, (void)v;
  return FusedAttention::kNone;
#endif
}

// The forward of pair `f`: {out [B, H, T, hd], then what the backward reads
// (logsumexp, the cumulative sequence lengths, the philox seed and offset)}.
inline std::vector<at::Tensor> causal_fused_forward(FusedAttention f, const at::Tensor& q,
                                                    const at::Tensor& k, const at::Tensor& v) {
#if VIADUCT_FUSED_ATTENTION
  if (f == FusedAttention::kCudnn) {
    auto r = at::_scaled_dot_product_cudnn_attention(q, k, v, {}, /*compute_log_sumexp=*/true,
                                                     0.0, /*is_causal=*/true);
    return {std::get<0>(r), std::get<1>(r), std::get<2>(r),
            std::get<3>(r), std::get<6>(r), std::get<7>(r)};
  }
  if (f == FusedAttention::kCudnnFlash) {
    // What flash's backward reads, in flash's forms: the log-sum-exp as a
    // dense fp32 [B, H, T] (cuDNN's carries a trailing unit dimension), no
    // sequence offsets (one sequence a row), and the dropout seed and
    // offset flash's forward returns without dropout (unread).
    auto r = at::_scaled_dot_product_cudnn_attention(q, k, v, {}, /*compute_log_sumexp=*/true,
                                                     0.0, /*is_causal=*/true);
    auto lse = std::get<1>(r).reshape({q.size(0), q.size(1), q.size(2)}).contiguous();
    const auto unused = at::empty({}, at::dtype(at::kLong));
    return {std::get<0>(r), lse, at::Tensor(), at::Tensor(), unused, unused};
  }
  auto r = at::_scaled_dot_product_flash_attention(q, k, v, 0.0, /*is_causal=*/true);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r),
          std::get<3>(r), std::get<6>(r), std::get<7>(r)};
#else
  (void)f, (void)q, (void)k, (void)v;
  throw std::runtime_error("fused attention ops need LibTorch 2.8 or later");
#endif
}

// {dq, dk, dv} of pair `f` from causal_fused_forward's outputs `fwd`
// (kCudnnFlash: flash's backward).
inline std::vector<at::Tensor> causal_fused_backward(FusedAttention f, const at::Tensor& grad,
                                                     const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v,
                                                     const std::vector<at::Tensor>& fwd) {
#if VIADUCT_FUSED_ATTENTION
  if (f == FusedAttention::kCudnn) {
    auto r = at::_scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, fwd[0], fwd[1], fwd[4], fwd[5], /*attn_bias=*/{}, fwd[2], fwd[3],
        /*max_q=*/q.size(2), /*max_k=*/k.size(2), 0.0, /*is_causal=*/true);
    return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
  }
  auto r = at::_scaled_dot_product_flash_attention_backward(
      grad, q, k, v, fwd[0], fwd[1], fwd[2], fwd[3], /*max_q=*/q.size(2), /*max_k=*/k.size(2),
      0.0, /*is_causal=*/true, fwd[4], fwd[5]);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
#else
  (void)f, (void)grad, (void)q, (void)k, (void)v, (void)fwd;
  throw std::runtime_error("fused attention ops need LibTorch 2.8 or later");
#endif
}

// Flash's variable-length causal attention: q, k, v [N, H, hd] hold the
// tokens of several sequences end to end, sequence i the rows
// [cu_seqlens[i], cu_seqlens[i + 1]) (int32 on q's device), `max_len` the
// longest; each sequence attends causally within itself. The forward
// returns {out [N, H, hd], then what the backward reads (logsumexp, the
// RNG state and its companion)}. LibTorch 2.8 and later, CUDA.
inline std::vector<at::Tensor> varlen_flash_forward(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v,
                                                    const at::Tensor& cu_seqlens,
                                                    int64_t max_len) {
#if VIADUCT_FUSED_ATTENTION
  auto r = at::_flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0,
                                        /*is_causal=*/true, /*return_debug_mask=*/false);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r)};
#else
  (void)q, (void)k, (void)v, (void)cu_seqlens, (void)max_len;
  throw std::runtime_error("variable-length flash attention needs LibTorch 2.8 or later");
#endif
}

// {dq, dk, dv} of varlen_flash_forward's outputs `fwd`.
inline std::vector<at::Tensor> varlen_flash_backward(const at::Tensor& grad, const at::Tensor& q,
                                                     const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& cu_seqlens,
                                                     int64_t max_len,
                                                     const std::vector<at::Tensor>& fwd) {
#if VIADUCT_FUSED_ATTENTION
  auto r = at::_flash_attention_backward(grad, q, k, v, fwd[0], fwd[1], cu_seqlens, cu_seqlens,
                                         max_len, max_len, 0.0, /*is_causal=*/true, fwd[2],
                                         fwd[3]);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
#else
  (void)grad, (void)q, (void)k, (void)v, (void)cu_seqlens, (void)max_len, (void)fwd;
  throw std::runtime_error("variable-length flash attention needs LibTorch 2.8 or later");
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

// Note [GEMM support decided at start-up]
// Two ATen calls write an fp32 output from bf16 inputs where LibTorch >= 2.8
// has them: addmm_out with an out dtype (a weight gradient written in fp32
// by its GEMM) and _grouped_mm with one (the MoE experts' weight
// gradients). A build may still refuse either: the dtype checks in front
// of them differ between releases, and run before anything is written.
// Whether they refuse depends on the build, the device and the dtypes, not
// on the shapes, so ops::probe_capabilities asks once at start-up with
// one small call of each form in the ops' dtypes and layouts
// (fp32_out_gemm_refusal, grouped_fp32_out_gemm_refusal), the trainer logs
// the answer, and every call of the run takes the path it gave (the ops
// pass it in: ops::Capabilities). A refusal the probe did not see is an
// error, never a switch to the other path in the middle of a run.

// The first line of a c10::Error's message.
inline std::string first_line(const c10::Error& e) {
  const std::string msg = e.what_without_backtrace();
  return msg.substr(0, msg.find('\n'));
}

// Why this build does not take matmul_into_fp32_'s one fp32-output GEMM on
// `device` (a CUDA device), or nullopt where it does.
inline std::optional<std::string> fp32_out_gemm_refusal(const at::Device& device) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  try {
    const auto o = at::TensorOptions(device);
    auto c = at::zeros({8, 8}, o.dtype(at::kFloat));
    const auto dy = at::zeros({16, 8}, o.dtype(at::kBFloat16));
    const auto x = at::zeros({16, 8}, o.dtype(at::kBFloat16));
    // A weight gradient dy^T x, written and accumulated (the chunked head).
    at::addmm_out(c, c, dy.t(), x, at::kFloat, /*beta=*/0);
    at::addmm_out(c, c, dy.t(), x, at::kFloat, /*beta=*/1);
    return std::nullopt;
  } catch (const c10::Error& e) {
    return first_line(e);
  }
#else
  (void)device;
  return std::string("LibTorch " TORCH_VERSION " has none (2.8 and later)");
#endif
}

// c = a @ b (accumulate: c += a @ b) with c fp32 and a, b bf16/fp16: on
// CUDA with LibTorch >= 2.8 and `fp32_out` (ops::Capabilities, see Note [GEMM
// support decided at start-up]) one GEMM writing (or accumulating into) c
// in fp32 (cuBLAS's fp32 output); else the product rounded to a's dtype,
// cast and copied or added (two more passes over c).
inline void matmul_into_fp32_(at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
                              bool accumulate, bool fp32_out) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  if (fp32_out && c.is_cuda() && c.scalar_type() == at::kFloat && c.is_contiguous() &&
      a.scalar_type() == b.scalar_type() &&
      (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf)) {
    // beta = 0 ignores c's contents (NaN included).
    at::addmm_out(c, c, a, b, at::kFloat, /*beta=*/accumulate ? 1 : 0);
    return;
  }
#else
  (void)fp32_out;
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

// Why this build does not take grouped_mm_fp32's grouped GEMM writing fp32
// on `device` (a CUDA device), or nullopt where it does (see Note [GEMM support
// decided at start-up]).
inline std::optional<std::string> grouped_fp32_out_gemm_refusal(const at::Device& device) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  try {
    const auto o = at::TensorOptions(device);
    // The experts' weight gradients dy^T x over two groups of 16 rows.
    const auto dy = at::zeros({32, 16}, o.dtype(at::kBFloat16));
    const auto x = at::zeros({32, 16}, o.dtype(at::kBFloat16));
    const auto offs = at::arange(16, 33, 16, o.dtype(at::kInt));
    at::_grouped_mm(dy.t(), x, offs, std::nullopt, at::kFloat);
    return std::nullopt;
  } catch (const c10::Error& e) {
    return first_line(e);
  }
#else
  (void)device;
  return std::string("LibTorch " TORCH_VERSION " has no grouped GEMM (2.8 and later)");
#endif
}

// out[e] = a[:, cols of group e] @ b[rows of group e] in fp32: a [N, M],
// b [M, K], offs int32 [E] the groups' end columns of a (rows of b);
// returns [E, N, K] (the experts' weight gradients): one grouped GEMM
// writing fp32 where `fp32_out` (ops::Capabilities, see Note [GEMM support
// decided at start-up]), else its bf16 product cast.
inline at::Tensor grouped_mm_fp32(const at::Tensor& a, const at::Tensor& b,
                                  const at::Tensor& offs, bool fp32_out) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  if (fp32_out) return at::_grouped_mm(a, b, offs, std::nullopt, at::kFloat);
  return at::_grouped_mm(a, b, offs).to(at::kFloat);
#else
  (void)a, (void)b, (void)offs, (void)fp32_out;
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
