// The MoE's routed experts through grouped GEMMs: one launch per projection
// for every expert, the tokens permuted into expert order on the device
// (no host sync: the group offsets stay on the GPU).
//
// Note [MoE dispatch into padded groups]
// Slot s = n K + j (token n's j-th choice) goes to row pos[s] of a buffer
// where expert e's slots occupy a group of rows padded to a multiple of
// kExpertAlign (at least one group of it), in slot order within the group
// (a stable sort by expert): every group starts 16-byte aligned in either
// layout the backward's GEMMs take. Pad rows are zero, so they add nothing
// to any weight gradient, and nothing reads their outputs. The buffer has
// N K + kExpertAlign E rows (the most the padding can take) so that its
// size needs no host sync; rows past the last group are never read. The
// dispatch is a permutation written with index_copy and read back with
// index_select: each row is written once and read once, so both directions
// are deterministic; the sum over a token's K copies is a reduction in
// fixed order.
#pragma once

#include <torch/torch.h>

#include "ops/options.h"

namespace viaduct::ops {

constexpr int64_t kExpertAlign = 16;

// Where the routed experts run as grouped GEMMs: a CUDA bf16 x under the
// kernel options, a LibTorch that has them, widths that keep rows 16-byte
// aligned.
bool grouped_experts_run(const at::Tensor& x, int64_t hidden, const KernelOptions& k);

struct ExpertDispatch {
  at::Tensor pos;     // [N K] int64: the buffer row of each slot
  at::Tensor offs;    // [E] int32: each group's end row
  at::Tensor counts;  // [E] int64: slots per expert
  int64_t rows = 0;   // the buffer's rows
};
// idx: [N, K] expert ids (int64) of N tokens. Under the kernel options on a
// GPU two kernels (kernels/moe_route.h) place the slots; elsewhere a stable
// sort by expert and its counts do; the same rows.
ExpertDispatch dispatch_experts(const at::Tensor& idx, int64_t n_experts,
                                const KernelOptions& opts);

// The k experts of the largest scores + bias in each row of scores [N, E],
// largest first, equal sums to the lower expert id (what a stable
// descending sort selects; topk leaves ties to the implementation): int64
// [N, k], no gradient. Under the kernel options on a GPU one kernel
// (kernels/moe_route.h), elsewhere the sort.
at::Tensor top_experts(const at::Tensor& scores, const at::Tensor& bias, int64_t k,
                       const KernelOptions& opts);

// src.index_select(0, pos) for a pos that names no row twice; the gradient
// goes back with index_copy into zeros (no additions).
at::Tensor gather_distinct_rows(const at::Tensor& src, const at::Tensor& pos);

// SwiGLU experts w2(silu(w1 x) * w3 x) over a buffer xs [rows, D] (bf16)
// whose groups `offs` end; w1, w3: [E, H, D], w2: [E, D, H] fp32 masters,
// cast through the weight cache; their gradients come back in fp32.
at::Tensor grouped_swiglu_experts(const at::Tensor& xs, const at::Tensor& offs,
                                  const at::Tensor& w1, const at::Tensor& w2,
                                  const at::Tensor& w3);

}  // namespace viaduct::ops
