// Kimi Delta Attention's recurrence: the gated delta rule with a
// per-channel decay.
//
// Per head, with state S [dk, dv] (S_0 the initial state, zero by default):
//   S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
//   o_t = S_t^T q_t
// Three evaluations of the same recurrence live here: the op the layer
// calls (viaduct's CUDA kernels where they take the shape, else the
// chunked ATen form), the chunked ATen form (the WY form per chunk, a
// sequential scan over chunks) and the step-by-step form both are checked
// against.
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "ops/documents.h"
#include "ops/options.h"

namespace viaduct::ops {

// q, k: [B, T, H, dk] (q already scaled), v: [B, T, H, dv], g: [B, T, H, dk]
// log-decays (<= 0), beta: [B, T, H]; initial_state: [B, H, dk, dv] or
// undefined (zero). Returns o: [B, T, H, dv] computed in fp32, or fp64 when
// q is fp64; the result keeps that type.
at::Tensor kda_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& g, const at::Tensor& beta,
                         const at::Tensor& initial_state = {});
// The chunked form. T need not divide by `chunk_size` (the tail is padded
// with steps that change nothing before them). The exponent differences
// G_c - G_j are masked to -inf above the diagonal *before* exp, so no entry
// can overflow (nor poison the gradient). `chunk_starts`: uint8
// [B, ceil(T / chunk_size)], 1 where the row's state restarts from zero as
// the chunk starts (packed documents, see Note [Packed documents]).
at::Tensor kda_chunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& g, const at::Tensor& beta, int64_t chunk_size,
                       const at::Tensor& initial_state = {}, const at::Tensor& chunk_starts = {});
// KDA's per-channel log-decay from its low-rank projection f [..., H dk]
// (the f_b linear's output): g = -exp(A_log) softplus(f + dt_bias) as
// [..., H, dk] in fp32 (fp64 for fp64 f); dt_bias [H dk], A_log [H]. One
// kernel each way where the kernels take it; else the ATen ops in that
// order.
at::Tensor kda_decay(const at::Tensor& f, const at::Tensor& dt_bias, const at::Tensor& A_log,
                     const KernelOptions& opts);
// The op: viaduct's kernels (kernels/kda.h) for fp32 inputs on a GPU they
// were built for, chunk 64 and dk = dv of 64 or 128; kda_chunked otherwise.
// With `documents` (see Note [Document boundaries], ops/documents.h) the
// state starts from zero at each document (no initial_state then): the
// kernels' chunks lie over the documents in place (see Note [KDA chunks
// over documents]); kda_chunked runs each row's documents packed on chunk
// boundaries (see Note [Packed documents]).
at::Tensor kda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
               const at::Tensor& beta, int64_t chunk_size, const KernelOptions& opts,
               const at::Tensor& initial_state = {}, const Documents* documents = nullptr);

}  // namespace viaduct::ops
