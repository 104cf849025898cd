// The MoE's routed experts (model/moe.h keeps the routing, the capacity
// rule and expert parallelism's exchange): through grouped GEMMs -- one
// launch per projection for every expert, the tokens permuted into expert
// order on the device (no host sync: the group offsets stay on the GPU) --
// or, where those do not run, one GEMM chain per expert.
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

#include <cstdint>
#include <functional>
#include <vector>

#include "ops/options.h"

namespace viaduct::ops {

constexpr int64_t kExpertAlign = 16;

// The router's logits [N, E] in fp32 (fp64 for fp64 x) from tokens x [N, D]
// and the router's weight w [E, D] (fp32 master): where the kernels run, read
// from bf16 x without an fp32 copy of it (see Note [Router logits from bf16
// tokens], kernels/moe_router.cu); else x cast up times w. `x` holds one
// handle of x for each of its `uses` other consumers (0 to 2), which they
// read instead of x: where the kernels run, the router's backward adds
// their gradients into x's (see Note [The router's backward sums x's
// gradient], kernels/moe_router_fn.cpp); elsewhere each is x itself.
struct RouterLogits {
  at::Tensor logits;
  std::vector<at::Tensor> x;
};
RouterLogits router_logits(const at::Tensor& x, const at::Tensor& w, const KernelOptions& k,
                           int64_t uses);

// The routed experts' stacked SwiGLU weights (fp32 masters): w1, w3
// [E, H, D], w2 [E, D, H].
struct ExpertWeights {
  at::Tensor w1, w2, w3;
};

// The routed experts of one MoE layer on this rank's tokens, combined:
// token n's output is sum_j gates[n, j] expert_{idx[n, j]}(x_n). x [N, D]:
// the tokens (slot n K + j: token n's j-th choice); idx
// [N, K] int64 expert ids; gates [N, K] the gating weights; keep: bool
// [N K] the copies the experts take (see Note [Expert capacity], model/moe.h),
// undefined when dropless. Where grouped GEMMs run (grouped_experts_run):
// the copies dispatched into padded groups on the device (see Note [MoE
// dispatch into padded groups]), three grouped GEMMs, no host sync; the
// dropped copies run and their gates are zeroed. Elsewhere the kept copies
// sorted by expert and split, one GEMM chain per expert (see Note [MoE dispatch
// without per-expert gradient fills]), the dropped copies' outputs zero.
struct MoeExperts {
  at::Tensor out;     // [N, D]
  at::Tensor routed;  // [E] int64: every routed copy per expert (before drops)
};
// `add` (empty: none) makes a [N, D] tensor added to the combined output
// (the shared experts' output): where the kernels run, made before the
// combine and added in its pass; elsewhere made after it and added (the
// order of the separate ops, so autograd sums x's gradients in the same
// order). The bits of the add either way.
MoeExperts moe_experts(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& gates,
                       const at::Tensor& keep, const ExpertWeights& w, const KernelOptions& k,
                       const std::function<at::Tensor()>& add = {});

// See Note [Expert parallelism] (model/moe.h): the local experts (of width
// `hidden`) of an expert-parallel rank on the rows it received, rows [R, D]
// grouped by source rank, then local expert, pieces[s El + e] rows each
// (El = pieces.size() / n_sources). weights(s) gives the weights the rows
// of source s use (the layer's gradient sinks), asked for in source order
// where the rows run. per_source: one GEMM chain per (source, expert), each
// source's rows on their own weights(s) -- every GEMM the shape it has
// without expert parallelism. Otherwise the sinks keep one gradient of
// every source, and where grouped GEMMs run the local experts take every
// source's rows at once, on weights(0); else one chain per (source,
// expert) on weights(s). Returns [R, D] in the rows' order.
at::Tensor moe_local_experts(const at::Tensor& rows, const std::vector<int64_t>& pieces,
                             int64_t n_sources, int64_t hidden, bool per_source,
                             const std::function<ExpertWeights(int64_t source)>& weights,
                             const KernelOptions& k);

// out [N, D] = sum_j gates[n, j] y[n, j] for the experts' outputs y
// [N, K, D] in slot order, in y's dtype.
at::Tensor combine_experts(const at::Tensor& y, const at::Tensor& gates);

// The slots' order by expert (a stable sort: slot order within an expert)
// and, per expert, the copies that run: all, or under capacity the `keep`
// ones. flat: [N K] expert ids.
struct ExpertOrder {
  at::Tensor order;   // [kept] slot indices, by expert then slot
  at::Tensor counts;  // [E] int64 on the CPU: the kept copies per expert
  at::Tensor routed;  // [E] int64 on the CPU: every routed copy per expert
};
ExpertOrder expert_order(const at::Tensor& flat, const at::Tensor& keep, int64_t n_experts);

// Rows in expert order (`order`: their slots) back in slot order, [slots,
// ...]: a permutation's inverse, or under capacity (`dropped`) into zeros,
// each kept slot written once (a deterministic index_copy).
at::Tensor to_slot_order(const at::Tensor& rows, const at::Tensor& order, int64_t slots,
                         bool dropped);

// Where the routed experts run as grouped GEMMs: a CUDA bf16 x under the
// kernel options, a LibTorch that has them, widths that keep rows 16-byte
// aligned (x [.., D], `hidden` each expert's H).
bool grouped_experts_run(const at::Tensor& x, int64_t hidden, const KernelOptions& k);

struct ExpertDispatch {
  at::Tensor pos;     // [N K] int64: the buffer row of each slot
  at::Tensor offs;    // [E] int32: each group's end row
  at::Tensor counts;  // [E] int64: slots per expert
  // [rows] int64: each buffer row's slot, -1 for padding; from the kernels
  // only (undefined on the ATen path).
  at::Tensor row_slot;
  int64_t rows = 0;  // the buffer's rows
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

// scores.gather(-1, idx) for scores [N, E] and idx [N, K] naming K distinct
// columns of each row (the chosen experts); see Note [The chosen scores'
// gradient without an index op].
at::Tensor gather_chosen(const at::Tensor& scores, const at::Tensor& idx);

// SwiGLU experts w2(silu(w1 x) * w3 x) over a buffer xs [rows, D] (bf16)
// whose groups `offs` end; w1, w3: [E, H, D], w2: [E, D, H] fp32 masters,
// cast through the weight cache (w1 and w3 as one copy, see Note [One
// gate-up GEMM for the experts], ops/moe.cpp); their gradients come back in
// fp32.
at::Tensor grouped_swiglu_experts(const at::Tensor& xs, const at::Tensor& offs,
                                  const ExpertWeights& w, const KernelOptions& k);

}  // namespace viaduct::ops
