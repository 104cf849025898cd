// viaduct's CUDA kernels as autograd-aware ATen-level functions.
//
// Model code does not call these: the ops/ layer does, where usable() and
// its options say the kernels run, and runs its ATen form otherwise (CPU,
// fp64 gradient checks, non-Hopper GPUs, the CPU build, model.cuda_kernels
// = false). Each function computes the same formula as the ATen form it
// replaces, in fp32 arithmetic, with fewer passes over memory and fewer
// tensors kept for the backward; the results agree to rounding, not
// bitwise. Every reduction has a fixed order, so runs and pipeline layouts
// stay bitwise reproducible among themselves.
//
// The CUDA build compiles kernels/<op>_fn.cpp behind these declarations;
// the CPU build compiles kernels/fused_stub.cpp, where usable() is false and
// every entry point throws.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

namespace viaduct::kernels {

class WeightCache;

// True when the kernels can run on `x`: a CUDA build, x on a GPU the
// kernels were compiled for (sm_90a), x float32 or bfloat16.
bool usable(const at::Tensor& x);

// dst.copy_(src) for tensors of one shape and dtype, or src bf16 and dst
// fp32 (each value widened exactly), whose last dim is dense (narrowed
// channels, heads, halves of a product), in 16-byte words where the
// layouts allow (returns true), ATen's copy elsewhere (false). Same bytes
// either way.
bool copy_rows_into(const at::Tensor& dst, const at::Tensor& src);

// x * rsqrt(mean(x^2, -1) + eps) * weight over the last dim, returned in x's
// dtype; weight: fp32 [D]. Saves x and one fp32 per row for the backward.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// (h, rms_norm(h)) for h = x + res, h rounded to x's type as an add rounds:
// one kernel each way, the bits of the two ops (see Note [Residual add inside
// the norm]).
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& res,
                                               const at::Tensor& weight, double eps);

// (x - mean) * rsqrt(var + eps) * weight + bias over the last dim in fp32
// (the biased variance), returned in x's dtype; weight, bias: fp32 [D].
// One kernel each way; saves x and two fp32 per row for the backward.
// layer_norm_usable: the kernels take these (false in the CPU build).
bool layer_norm_usable(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);
// (h, layer_norm(h)) for h = x + res, h rounded to x's type as an add
// rounds: one kernel each way, the bits of the add and the norm kernel
// (see Note [Residual add inside the norm]).
std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& res,
                                                 const at::Tensor& weight,
                                                 const at::Tensor& bias, double eps);
at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      double eps);

// Rotary embedding on interleaved pairs of x: [B, T, H, hd]; cos, sin: fp32
// [>= T, hd / 2] on x's device. Saves nothing but the tables. repeat > 1
// returns [B, T, H * repeat, hd] with each rotated head repeated (as
// repeat_interleave on dim 2 would: grouped KV heads for attention), and
// the backward sums each head's copies in fp32 before rotating back.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                int64_t repeat = 1);

// q, k and v rotated and repeated for attention from one qkv product
// [B, T, (H + 2 KV) hd] (q's H heads, then k's and v's KV heads; the last
// dimension dense): {rope(q), rope(k, H / KV), repeat_heads(v, H / KV)},
// each contiguous [B, T, H, hd], bit for bit those three ops (v copied
// where KV == H); the backward writes the product's gradient as one tensor
// (see Note [The qkv gradient written whole], kernels/rope_fn.cpp).
std::vector<at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                 const at::Tensor& sin, int64_t H, int64_t KV);

// MLA's attention inputs from q [B, T, H, nope + pe], k_pe [B, T, 1, pe]
// and kv [B, T, H, nope + vd] (dense last dimensions, other strides free):
// {q with its pe channels rotated, k = kv's nope channels beside k_pe
// rotated and repeated for every head, v = kv's vd channels, zero-padded
// to v_width (0: vd)}, each contiguous; cos, sin: fp32 [>= T, pe / 2], or
// undefined for no rotation.
// The bits of rope, cat and narrow; the backward writes q's and kv's
// gradients whole (see Note [MLA's rotary channels written in place],
// kernels/rope_fn.cpp).
std::vector<at::Tensor> mla_qkv(const at::Tensor& q, const at::Tensor& k_pe,
                                const at::Tensor& kv, const at::Tensor& cos,
                                const at::Tensor& sin, int64_t nope, int64_t v_width = 0);

// x [B, T, KV, hd] (the last dim contiguous, other strides free) ->
// contiguous [B, T, KV * repeat, hd], each head written `repeat` times (as
// repeat_interleave on dim 2); the backward sums each head's copies in
// fp32 in head order. See Note [Repeated heads without a gather].
at::Tensor repeat_heads(const at::Tensor& x, int64_t repeat);

// silu(ab[..., :F]) * ab[..., F:] for ab the [..., 2F] output of one GEMM
// over w1 and w3 (the grouped experts', see Note [One gate-up GEMM for the
// experts], ops/moe.cpp); the gradient is one [..., 2F] tensor.
at::Tensor swiglu_packed(const at::Tensor& ab);

// How swiglu_linear treats its weight: the cast through `cache` (see Note
// [Low-precision weight cache], kernels/weight_cache.h; null: a fresh
// cast), the weight gradient written in fp32 by its GEMM where
// `fp32_out_gemm` (see Note [GEMM support decided at start-up],
// core/torch_compat.h), and the product recomputed in the backward where
// `recompute` (model.swiglu_recompute: one [tokens x F] activation less
// per layer).
struct SwiGLULinearOptions {
  WeightCache* cache = nullptr;
  bool fp32_out_gemm = true;
  bool recompute = false;
};
// linear(silu(a) * b, w) with w (fp32 master weight [D, F]) cast to a's
// dtype. Keeps a, b and the cast weight for the backward, and the product
// unless o.recompute.
at::Tensor swiglu_linear(const at::Tensor& a, const at::Tensor& b, const at::Tensor& w,
                         const SwiGLULinearOptions& o);
// swiglu_linear(ab[..., :F], ab[..., F:], w) for ab the [..., 2F] output of
// one GEMM over w1 and w3 (see Note [One w1/w3 projection], ops/swiglu.cpp):
// the halves are read in place and their gradient is one [..., 2F] tensor.
at::Tensor swiglu_linear_packed(const at::Tensor& ab, const at::Tensor& w,
                                const SwiGLULinearOptions& o);

// scale * x * rsqrt(sum(x^2) + eps) over the last dimension of x (fp32 or
// bf16), in fp32 (a warp per row); the backward gives x's gradient in x's
// dtype.
at::Tensor l2_normalize(const at::Tensor& x, double eps, double scale);

// KDA's short convolution: silu(causal depthwise conv of x [B, T, C] with
// weight [C, K] (fp32; tap K - 1 on the current token)), in x's dtype with
// fp32 arithmetic; the backward gives x's gradient and the weight's (fp32,
// summed in a fixed order). offsets: undefined, or int32 [B, T] on x's
// device, each token's offset in its document: a tap that would read
// before the document's first token reads zero instead, as before a
// document alone (see Note [KDA chunks over documents], ops/documents.h).
// short_conv_silu_usable: the kernels take these (usable(x), K <= 8; false
// in the CPU build).
bool short_conv_silu_usable(const at::Tensor& x, const at::Tensor& weight);
at::Tensor short_conv_silu(const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& offsets = {});
// The convolution, then each head's L2 norm (KDA's q and k): scale * u /
// sqrt(sum over the head's head_dim channels of u^2 + eps), fp32 [B, T, C],
// u the convolution's output in x's dtype; the bits of short_conv_silu then
// l2_normalize, without u kept (the backward recomputes it).
// short_conv_silu_l2_usable: as short_conv_silu_usable, with head_dim 32, 64
// or 128 dividing C and fewer than 2^31 (token, head) rows.
bool short_conv_silu_l2_usable(const at::Tensor& x, const at::Tensor& weight, int64_t head_dim);
at::Tensor short_conv_silu_l2(const at::Tensor& x, const at::Tensor& weight, int64_t head_dim,
                              double eps, double scale, const at::Tensor& offsets = {});

// The gradient of an embedding table [vocab, D] whose rows `tokens` (any
// shape, int64) were read, from the fp32 gradient of those rows ([..., D]):
// each token's rows summed in increasing row order (fp32 [vocab, D], zero
// rows for tokens that do not occur), with no host sync. No autograd.
at::Tensor embedding_weight_grad(const at::Tensor& grad, const at::Tensor& tokens, int64_t vocab);

// Per-row cross-entropy of logits [n, V] (contiguous) against targets [n]
// (-100: ignored). Returns the row losses (fp32 [n], 0 where ignored) and
// overwrites logits with d(row loss)/d(logits) = softmax - onehot, times
// grad_scale where it is defined (an fp32 scalar on logits' device, read
// there: no host sync). No autograd.
at::Tensor cross_entropy_rows_(at::Tensor& logits, const at::Tensor& targets,
                               const at::Tensor& grad_scale = {});

// t *= num / den in place (t fp32 or bf16, contiguous; num and den fp32
// scalars on t's device, den undefined: 1), the ratio formed and tested on
// the device: where it is exactly 1 the call reads two scalars and leaves t
// untouched. No autograd.
void scale_by_ratio_(at::Tensor& t, const at::Tensor& num, const at::Tensor& den);

// The Block AttnRes read softmax_i(rstd(v_i) (v_i . (norm_weight * query)))
// -weighted sum of the sources (each [B, T, D], one dtype and device, at
// most 64 of them): one kernel forward, one backward, keeping three fp32
// statistics per source and token. attn_res_read_usable: the kernels can
// take these sources (usable(), the limits above; false in the CPU build).
bool attn_res_read_usable(const std::vector<at::Tensor>& sources);
// slots: as AttnResReadImpl::forward's (see Note [AttnRes block gradients in
// place], model/attn_res.h); the backward adds into a slot in the pass that
// computes the gradient.
at::Tensor attn_res_read(const std::vector<at::Tensor>& sources, const at::Tensor& query,
                         const at::Tensor& norm_weight, double eps,
                         const std::vector<at::Tensor>* slots = nullptr);
// RMSNorm(attn_res_read(...)) with weight out_weight (fp32 [D]) and out_eps
// in one kernel forward and one backward (see Note [AttnRes read with its
// norm], kernels/attn_res_read.cu): h itself is neither written nor kept.
// attn_res_read_norm_usable: attn_res_read_usable, contiguous sources of
// rows of at most 2048 bf16 / 1024 fp32 in 16-byte words.
bool attn_res_read_norm_usable(const std::vector<at::Tensor>& sources,
                               const at::Tensor& out_weight);
at::Tensor attn_res_read_norm(const std::vector<at::Tensor>& sources, const at::Tensor& query,
                              const at::Tensor& norm_weight, double eps,
                              const std::vector<at::Tensor>* slots, const at::Tensor& out_weight,
                              double out_eps);
// Adds one source's read gradient into its slot: the first gradient becomes
// the slot (Tensor::set_, no copy); a later one's sum with the slot becomes
// it (autograd's sum, same bits; never in place, since the slot's storage
// may be shared). Both builds.
void attn_res_slot_add(const at::Tensor& slot, const at::Tensor& grad);
// The slot's sum (undefined where the slot is empty), the slot emptied so
// that a rerun of the backward starts afresh. Both builds.
at::Tensor take_slot(const at::Tensor& slot);
// A read's slots kept in its autograd context (the same TensorImpls the
// sink holds), and source i's slot back (undefined: none). Both read forms.
void save_read_slots(torch::autograd::AutogradContext* ctx,
                     const std::vector<at::Tensor>* slots);
at::Tensor saved_read_slot(torch::autograd::AutogradContext* ctx, size_t i);

// Note [Packed projection gradients in place]
// linear_split's parts on the fused path (see Note [One GEMM for the
// projections of one input], ops/linear.cpp) are the outputs of one
// autograd function, split_packed, whose backward hands on the gradient of
// the whole product. A part's consumer that can write its input gradient
// with a row stride (the short convolutions) takes packed_grad_columns of
// its input at its forward and, in its backward, writes into those columns
// of a buffer shaped like the product (packed_grad_view: the first writer
// allocates it); split_packed's backward then copies in only the other
// parts' gradients (zeros for a part without one) and hands the buffer
// on. autograd's own split backward concatenated every part's gradient
// into a new tensor. The values are the same, so are the bits. The parts
// are views made inside a custom function, so they must not be modified in
// place (autograd refuses it). Both builds.
std::vector<at::Tensor> split_packed(const at::Tensor& packed, const std::vector<int64_t>& widths);
// For x a part split_packed returned (its grad_fn is split_packed's node,
// and x has the product's dtype and leading dims and the part's width):
// the slot that will hold the product's gradient, the parts already taken,
// the product's sizes, the part and its first column; else an undefined
// slot.
struct PackedGradColumns {
  at::Tensor slot, claimed;
  std::vector<int64_t> sizes;
  int64_t part = 0, column = 0;
};
PackedGradColumns packed_grad_columns(const at::Tensor& x);
// The part's `width` columns of the slot's buffer (allocated in the slot's
// dtype and device on first use), [..., width] with the product's row
// stride; for a second consumer of the same part in one backward, a
// tensor of its own (the two are summed by autograd, then copied in).
at::Tensor packed_grad_view(const PackedGradColumns& c, int64_t width);
// A consumer's columns kept in its autograd context (nothing where c's
// slot is undefined), and back (an undefined slot: none kept).
void save_packed_grad_columns(torch::autograd::AutogradContext* ctx, const PackedGradColumns& c);
PackedGradColumns saved_packed_grad_columns(torch::autograd::AutogradContext* ctx);

// The KDA layer's gates (kernels/kda_gates.h), one kernel each way.
// kda_decay: g = -exp(A_log) softplus(f + dt_bias) as fp32 [..., H, D] from
// f [..., H D] (fp32 or bf16), dt_bias [H D] and A_log [H] fp32; the
// backward gives f's gradient in f's dtype and dt_bias's and A_log's
// (fp32, summed in a fixed order). gated_rms_norm: rms_norm(x) * weight *
// sigmoid(gate_logits) in the logits' dtype, x fp32 [..., D] (D a multiple
// of 32 up to 256, a warp per row), gate_logits of x's shape. *_usable:
// the kernels take these (false in the CPU build).
bool kda_decay_usable(const at::Tensor& f, const at::Tensor& dt_bias, const at::Tensor& A_log);
at::Tensor kda_decay(const at::Tensor& f, const at::Tensor& dt_bias, const at::Tensor& A_log);
bool gated_rms_norm_usable(const at::Tensor& x, const at::Tensor& gate_logits,
                           const at::Tensor& weight);
at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& gate_logits,
                          const at::Tensor& weight, double eps);

// The chunked gated delta rule of ops/kda.h on viaduct's kernels
// (kernels/kda.h): chunk kKdaKernelChunk, q, k, v, g: [B, T, H, D], beta
// [B, T, H], D of 64 or 128 (dk = dv); initial_state [B, H, D, D] or
// undefined. All run in fp32: q, k, g, beta and the state are cast to it; a
// bf16 v is read as it is and gets its gradient in bf16 (the bits of the
// fp32 copy's gradient cast). Returns o [B, T, H, D] (fp32) and the final
// state [B, H, D, D], both
// differentiable (the initial state too). With `documents` the chunks lie
// over the micro-batch's documents in place and the state starts from zero
// at each (see Note [KDA chunks over documents], ops/documents.h); there is
// no initial state then. kda_usable: the kernels take q and v (false in the
// CPU build).
constexpr int64_t kKdaKernelChunk = 64;
// The chunks over a micro-batch's documents, made by
// ops::Documents::kda_chunks, every tensor on q's device; N chunks a row, Z
// = B H N chunk matrices of C rows (the chunk layout, rows z C + c).
struct KdaDocumentChunks {
  at::Tensor spans;     // [B, N, 2] int32: each chunk's first token in its row, its token count
  at::Tensor restarts;  // [B, N] uint8: 1 where a chunk is a document's first
  at::Tensor places;    // [B T H] int64: each (token, head)'s chunk-layout row
  at::Tensor read;      // [Z C] int64: the (token, head) b T H + t H + h a chunk row holds, or -1
};
// Note [KDA's output gradient in the chunk layout]
// KDA's chunk backward reads do in the chunk layout ([B H, N C, D], the
// rows past T zero), which it gathered from the token layout [B, T, H, D]
// with a copy. The layer's one consumer of o, the gated RMSNorm, asks
// kda_output_grad_rows at its forward whether o is kda_chunk's output and,
// if so, writes its input gradient in the chunk layout in its backward and
// hands it on as the [B, T, H, D] view of it; the chunk backward takes a
// gradient in exactly that view as it is. The values are the same, so are
// the bits. Plain chunks only: document chunks place a head's tokens by a
// table, which no view of [B, T, H, D] can express, so there the gather
// stays. (Reading do from the token layout inside the chunk products
// instead was slower than the gather: rows 4 KB apart.)
// Returns the rows a head has in the chunk layout (N C) where o is
// kda_chunk's output over plain chunks, else 0 (the CPU build: 0).
int64_t kda_output_grad_rows(const at::Tensor& o);
bool kda_usable(const at::Tensor& q, const at::Tensor& v);
std::pair<at::Tensor, at::Tensor> kda_chunk(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& g,
                                            const at::Tensor& beta,
                                            const at::Tensor& initial_state,
                                            const KdaDocumentChunks* documents = nullptr);

// MoE routing on viaduct's kernels (kernels/moe_route.h). moe_topk: the k
// experts of the largest scores + bias per row of scores [N, E] (fp32, on
// a GPU; bias [E] fp32), largest first, ties to the lower expert id, as
// int64 [N, k]; what a stable descending sort of the sums selects.
// moe_topk_usable: the kernel takes these (E up to 256; false in the CPU
// build). moe_dispatch: for expert ids [S] (int64) in [0, n_experts), each
// slot's row in groups padded to `align` (see Note [MoE dispatch into padded
// groups], ops/moe.h): {pos [S] int64, offs [E] int32, counts [E] int64,
// row_slot [S + align E] int64: each row's slot, -1 where none};
// moe_dispatch_usable: the kernels take these ids (up to 1024 experts).
bool moe_topk_usable(const at::Tensor& scores, int64_t k);
bool moe_dispatch_usable(const at::Tensor& expert, int64_t n_experts);
at::Tensor moe_topk(const at::Tensor& scores, const at::Tensor& bias, int64_t k);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_dispatch(
    const at::Tensor& expert, int64_t n_experts, int64_t align);

// The MoE router's logits [N, E] fp32 from bf16 tokens x [N, D] and fp32
// weights w [E, D] in fp32 arithmetic (see Note [Router logits from bf16
// tokens]); gradients to x (bf16) and w (fp32). Returns the logits, then
// `uses` (0 to 2) handles of x for x's other consumers, whose gradients the
// router's backward adds into x's (see Note [The router's backward sums
// x's gradient], kernels/moe_router_fn.cpp). moe_router_usable: the
// kernels take these (D a multiple of 8, E <= 64; false in the CPU build).
bool moe_router_usable(const at::Tensor& x, const at::Tensor& w);
std::vector<at::Tensor> moe_router(const at::Tensor& x, const at::Tensor& w, int64_t uses);

// The grouped experts' rows moved in one pass each way (kernels/moe_permute.h,
// see Note [MoE rows moved in one pass]); bf16 rows on a GPU, D a multiple
// of 8 (moe_permute_usable; false in the CPU build). pos [N K] int64: each
// slot's buffer row (moe_dispatch); row_slot [rows] int64: each buffer row's
// slot, -1 for padding. moe_permute: x [N, D] -> [rows, D], row pos[n K + j]
// a copy of x[n], padding zero; its gradient sums a token's K rows.
// moe_combine: ys [rows, D], gates [N, K] fp32 -> [N, D]: sum over j of
// bf16(gates[n, j]) * ys[pos[n K + j]], the ATen form
// (ys.index_select(0, pos).view(N, K, D) * gates.to(bf16).unsqueeze(-1)).sum(1)
// in one pass; gradients to ys and gates. base (undefined: none) [N, D]:
// added to that sum in the same pass, the bits of the sum and then the
// add (the shared experts' output); its gradient is the output's.
bool moe_permute_usable(const at::Tensor& x);
at::Tensor moe_permute(const at::Tensor& x, const at::Tensor& pos, const at::Tensor& row_slot,
                       int64_t k);
at::Tensor moe_combine(const at::Tensor& ys, const at::Tensor& gates, const at::Tensor& pos,
                       const at::Tensor& row_slot, const at::Tensor& base = {});

// One AdamW step in place on contiguous fp32 CUDA tensors (the formulas of
// AdamW::step's loop; bias_corr_i = 1 - beta_i^step). `low`, when defined (a
// contiguous bf16 tensor of p's size), receives the new p cast to bf16 in
// the same pass (see Note [Low-precision weight cache]). The update reads
// g * grad_scale (the clip coefficient, see Note [Clip folded into AdamW]); g
// itself is not written. Raw writes: the caller bumps p's version.
// With scale_dev (a [1] fp32 tensor on p's device), grad_scale is read from
// there instead, and NaN there updates nothing (see Note [Clip coefficient on
// the device], kernels/clip.cu).
void adamw_(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, double lr,
            double beta1, double beta2, double eps, double weight_decay, double bias_corr1,
            double bias_corr2, const at::Tensor& low = at::Tensor(), double grad_scale = 1.0,
            const at::Tensor& scale_dev = at::Tensor());

// adamw_ for many tensors in one launch (see Note [AdamW over many tensors
// in one launch], kernels/adamw.cu), the same bits. adamw_many_takes says
// which: contiguous fp32 CUDA tensors of one size, a multiple of 4 values,
// 16-byte aligned (low as adamw_'s). All on one device.
struct AdamWTensors {
  at::Tensor p, g, m, v, low;
  double weight_decay = 0.0;
};
bool adamw_many_takes(const AdamWTensors& t);
void adamw_many_(const std::vector<AdamWTensors>& ts, double lr, double beta1, double beta2,
                 double eps, double bias_corr1, double bias_corr2, double grad_scale = 1.0,
                 const at::Tensor& scale_dev = at::Tensor());

// See Note [Clip coefficient on the device] (kernels/clip.cu): the global norm
// of these gradients (contiguous or not, fp32, on one CUDA device, in
// parameter order) and the clip coefficient for max_norm (<= 0: 1), formed
// on the device with the host's arithmetic (total_norm, clip_coefficient).
// Device work only, so a CUDA graph can hold it. scale: [1] fp32, NaN when
// the norm is not finite, for adamw_'s scale_dev; values: [1 + n] fp64,
// the norm, then the values of `also` (one-element tensors on that device,
// e.g. the step's losses).
struct DeviceClip {
  at::Tensor scale;
  at::Tensor values;
};
bool clip_on_device_takes(const std::vector<at::Tensor>& grads);
DeviceClip clip_on_device(const std::vector<at::Tensor>& grads, double max_norm,
                          const std::vector<at::Tensor>& also = {});
// Starts copying clip.values to the host, ordered after the work queued so
// far; the function returned waits for that copy only (not for work queued
// after this call, e.g. the update) and returns the values as doubles.
std::function<std::vector<double>()> fetch_clip_values(const DeviceClip& clip);

}  // namespace viaduct::kernels
