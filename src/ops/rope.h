// Rotary embeddings, and the inputs of causal attention with grouped KV
// heads (rotated and repeated in one kernel where the kernels run).
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "ops/documents.h"
#include "ops/options.h"

namespace viaduct::ops {

// Rotary tables: cos/sin [max_seq_len, head_dim / 2] in fp64, cast at use to
// fp32 (fp64 for fp64 input): the rotation itself runs in fp32.
struct RopeTables {
  at::Tensor cos, sin;
  // The tables from `position` on: row 0 rotates as `position` does.
  // Row i rotates as positions[i] does (positions: int64, on the tables'
  // device or copied there).
  RopeTables at_positions(const at::Tensor& positions) const {
    const auto p = positions.to(cos.device());
    return {cos.index_select(0, p), sin.index_select(0, p)};
  }
  RopeTables from(int64_t position) const {
    if (position == 0) return *this;
    return {cos.narrow(0, position, cos.size(0) - position),
            sin.narrow(0, position, sin.size(0) - position)};
  }
};
RopeTables make_rope_tables(int64_t head_dim, int64_t max_seq_len, double theta);

// x: [B, T, H, hd], rotating interleaved pairs (x[2i], x[2i+1]) as Meta's
// llama does. Returns x's dtype.
at::Tensor rope(const at::Tensor& x, const RopeTables& tables, const KernelOptions& k);

// MLA's attention inputs, each [B, T, H, *]: q [B, T, H, nope + pe] with
// its last pe channels rotated; k, kv's first nope channels [B, T, H,
// nope + vd] beside k_pe [B, T, 1, pe] rotated and repeated for every
// head; v, kv's last vd channels, zero-padded to v_width channels where
// v_width > vd (flash's kernel wants v as wide as q). `tables` (undefined:
// no rotation) rotate
// row t as position t (per-token tables: B = 1). Where the kernels run, one
// function writing the rotated channels in place and the gradients of q,
// k_pe and kv whole (kernels::mla_qkv); elsewhere rope, cat and narrow.
struct MlaAttentionInputs {
  at::Tensor q, k, v;
};
MlaAttentionInputs mla_attention_inputs(const at::Tensor& q, const at::Tensor& k_pe,
                                        const at::Tensor& kv, int64_t nope,
                                        const RopeTables& tables, const KernelOptions& k,
                                        int64_t v_width = 0);

// Causal scaled-dot-product attention of q [B, T, H, hd] over k, v
// [B, T, KV, hd] (H a multiple of KV), q and k rotated first when `tables`
// is given. Returns [B, H, T, hd]. With `documents` (see Note [Document
// boundaries], ops/documents.h) each document attends within itself alone,
// rotated from its first position. `qkv`: undefined, or the one product
// [B, T, (H + 2 KV) hd] whose slices q, k and v are (ops::qkv_projection's
// `packed`): the backward then writes that product's gradient whole, where
// the rotation runs on the kernels (kernels::rope_qkv) and where nothing
// rotates and KV = H (the three slices' gradients copied into one tensor).
at::Tensor causal_attention(at::Tensor q, at::Tensor k, at::Tensor v, const RopeTables* tables,
                            const KernelOptions& opts, const Documents* documents = nullptr,
                            const at::Tensor& qkv = {});

// Causal attention of q, k [B, H, T, d] and v [B, H, T, dv], dv <= d, all
// with H heads: on CUDA through the fused kernel SDPA would pick (its
// forward's outputs kept under per-op activation checkpointing), and for
// dv < d flash's on zero-padded values where SDPA would pick neither flash's
// nor cuDNN's; elsewhere SDPA itself. Returns [B, H, T, dv].
at::Tensor causal_attention_core(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// Causal attention within each of several sequences packed end to end: q,
// k [N, H, d] and v [N, H, dv], dv <= d (H heads each), sequence i the rows
// [cu_seqlens[i], cu_seqlens[i + 1]) (int32 on q's device, first 0, last
// N), `max_len` the longest. Flash's variable-length kernel, so CUDA and
// LibTorch 2.8+ only (an error elsewhere). Returns [N, H, dv].
at::Tensor varlen_causal_attention(const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& cu_seqlens,
                                   int64_t max_len);
// Whether varlen_causal_attention takes q (CUDA, bf16 or fp16, LibTorch
// 2.8+): block_causal attention then runs every document of a micro-batch
// in one call instead of one call per document.
bool varlen_runs(const at::Tensor& q);
// varlen_causal_attention over a micro-batch's documents: q, k [B, T, H, d]
// and v [B, T, H, dv] (rotated already) -> [B, T, H, dv].
at::Tensor document_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const Documents& documents);

}  // namespace viaduct::ops
