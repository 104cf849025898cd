#include "ops/rope.h"

#include "core/check.h"
#include "core/torch_compat.h"
#include "kernels/fused.h"
#include "ops/recompute.h"

namespace viaduct::ops {

namespace {

void check_rope_length(const RopeTables& rope, int64_t T) {
  VIADUCT_CHECK(T <= rope.cos.size(0), "sequence length ", T,
                " exceeds model.max_seq_len ", rope.cos.size(0));
}

// The fused kernel's fp32 tables for positions [0, T) on `device`.
std::pair<at::Tensor, at::Tensor> rope_tables_fp32(const RopeTables& rope, int64_t T,
                                                   const at::Device& device) {
  return {rope.cos.slice(0, 0, T).to(device, at::kFloat).contiguous(),
          rope.sin.slice(0, 0, T).to(device, at::kFloat).contiguous()};
}

// Causal attention through one of LibTorch's fused kernels
// (compat::fused_attention_for: the one scaled_dot_product_attention would
// pick) as an autograd function of ours, calling the kernel's forward and
// backward ATen ops, so that see Note [Per-op activation checkpointing] can
// keep the attention core's outputs (out, logsumexp and the rest its
// backward reads) and skip the forward in a replay while the backward stays
// the same call.
class CausalFusedAttentionFn : public torch::autograd::Function<CausalFusedAttentionFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, int64_t kernel) {
    const auto f = static_cast<compat::FusedAttention>(kernel);
    auto fwd = run_saved_op_outputs([&] { return compat::causal_fused_forward(f, q, k, v); });
    std::vector<at::Tensor> saved{q, k, v};
    saved.insert(saved.end(), fwd.begin(), fwd.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["kernel"] = kernel;
    return fwd[0];
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const std::vector<at::Tensor> fwd(saved.begin() + 3, saved.end());
    const auto f = static_cast<compat::FusedAttention>(ctx->saved_data["kernel"].toInt());
    // For cuDNN's backward the incoming gradient goes contiguous even where
    // it arrives in the output's own layout with a dense last dimension:
    // LibTorch's cuDNN backward keeps its built graphs by q's, k's and v's
    // shapes and strides, not the gradient's, so a gradient of other
    // strides than the graph was built for is read wrongly (test
    // FusedKernels.AttentionCoreRunsSdpasKernel hands it both layouts).
    // Flash's backward (kFlash, kCudnnFlash) reads the gradient as [B, T,
    // H, hd] and makes it contiguous in that layout itself; the projection
    // after the attention hands it back in that layout already, so a copy
    // here to [B, H, T, hd] would make flash copy it back.
    const auto& g_in = grads[0];
    auto g = compat::causal_fused_backward(
        f, f == compat::FusedAttention::kCudnn ? g_in.contiguous() : g_in, saved[0], saved[1],
        saved[2], fwd);
    return {g[0], g[1], g[2], at::Tensor()};
  }
};

// Flash's variable-length causal attention (compat::varlen_flash_forward)
// as an autograd function of ours, for the same reason as
// CausalFusedAttentionFn: per-op activation checkpointing keeps its
// forward's outputs. cu_seqlens and max_len are not differentiable.
class VarlenFlashAttentionFn : public torch::autograd::Function<VarlenFlashAttentionFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens, int64_t max_len) {
    auto fwd = run_saved_op_outputs(
        [&] { return compat::varlen_flash_forward(q, k, v, cu_seqlens, max_len); });
    std::vector<at::Tensor> saved{q, k, v, cu_seqlens};
    saved.insert(saved.end(), fwd.begin(), fwd.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["max_len"] = max_len;
    return fwd[0];
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const std::vector<at::Tensor> fwd(saved.begin() + 4, saved.end());
    auto g = compat::varlen_flash_backward(grads[0].contiguous(), saved[0], saved[1], saved[2],
                                           saved[3], ctx->saved_data["max_len"].toInt(), fwd);
    return {g[0], g[1], g[2], at::Tensor(), at::Tensor()};
  }
};

// Note [The unrotated qkv gradient written whole]
// Without RoPE (gpt2's learned positions), q, k and v are the qkv GEMM's
// product's slices, only transposed to [B, heads, T, hd]. Through narrow's
// backward their three gradients each came back as a zero-filled tensor of
// the whole product's size with one slice copied in, and the three were
// added: three fills, three copies and two full-size adds a layer. As one
// function of the product the backward copies the three gradients into
// their slices of one uninitialised tensor. Copies of the same values: the
// bits are the same (up to the sign of a zero, which an add of zeros
// turned positive).
class SplitQkvHeadsFn : public torch::autograd::Function<SplitQkvHeadsFn> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& qkv, int64_t H, int64_t KV) {
    const auto B = qkv.size(0), T = qkv.size(1), hd = qkv.size(2) / (H + 2 * KV);
    ctx->saved_data["H"] = H;
    ctx->saved_data["KV"] = KV;
    auto part = [&](int64_t first, int64_t heads) {
      return qkv.narrow(2, first * hd, heads * hd).view({B, T, heads, hd}).transpose(1, 2);
    };
    return {part(0, H), part(H, KV), part(H + KV, KV)};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto H = ctx->saved_data["H"].toInt(), KV = ctx->saved_data["KV"].toInt();
    const auto B = grads[0].size(0), T = grads[0].size(2), hd = grads[0].size(3);
    auto d = at::empty({B, T, (H + 2 * KV) * hd},
                       grads[0].options().memory_format(at::MemoryFormat::Contiguous));
    const int64_t first[3] = {0, H, H + KV}, heads[3] = {H, KV, KV};
    for (int i = 0; i < 3; ++i) {
      // An unused output's gradient arrives as zeros (the functions
      // materialise undefined gradients).
      d.narrow(2, first[i] * hd, heads[i] * hd)
          .view({B, T, heads[i], hd})
          .copy_(grads[i].transpose(1, 2));
    }
    return {d, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor varlen_causal_attention(const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& cu_seqlens,
                                   int64_t max_len) {
  VIADUCT_CHECK(q.is_cuda() && VIADUCT_FUSED_ATTENTION,
                "variable-length attention runs on CUDA with LibTorch 2.8 or later");
  const auto qd = q.size(-1), vd = v.size(-1);
  if (vd < qd) {
    // See Note [Narrow value heads on flash's kernel].
    const auto vp = at::constant_pad_nd(v, {0, qd - vd});
    return VarlenFlashAttentionFn::apply(q, k, vp, cu_seqlens, max_len).narrow(-1, 0, vd);
  }
  return VarlenFlashAttentionFn::apply(q, k, v, cu_seqlens, max_len);
}

bool varlen_runs(const at::Tensor& q) {
  return VIADUCT_FUSED_ATTENTION && q.is_cuda() &&
         (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf);
}

at::Tensor document_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const Documents& documents) {
  const auto B = q.size(0), T = q.size(1);
  int64_t longest = 0;
  for (const auto& s : documents.spans()) longest = std::max(longest, s.length);
  const auto cu = documents.cu_seqlens(q.device());
  auto flat = [&](const at::Tensor& x) { return x.reshape({B * T, x.size(2), x.size(3)}); };
  return varlen_causal_attention(flat(q), flat(k), flat(v), cu, longest)
      .view({B, T, q.size(2), v.size(3)});
}

at::Tensor causal_attention_core(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  // The kernel is chosen here, where q, k and v still require their
  // gradients as the training step's do (the choice weighs whether a
  // backward follows).
  auto f = compat::fused_attention_for(q, k, v);
  if (f != compat::FusedAttention::kNone) {
    return CausalFusedAttentionFn::apply(q, k, v, static_cast<int64_t>(f));
  }
  // Note [Narrow value heads on flash's kernel]
  // Flash's kernel wants one head width for q, k and v, so value heads
  // narrower than the query's (MLA: 192 against 128) leave SDPA only
  // cuDNN's kernel or the memory-efficient one, and under deterministic
  // algorithms, where LibTorch refuses cuDNN's, the memory-efficient
  // kernel's deterministic backward is several times slower than flash's.
  // Zero columns widen v to q's width for flash's kernel (and cuDNN's
  // forward before it, kCudnnFlash), and the output's extra columns
  // (attention weights times zeros) are cut off; the gradient of v is the
  // padded one's first columns.
  const auto qd = q.size(-1), vd = v.size(-1);
  if (q.is_cuda() && vd < qd) {
    const auto vp = at::constant_pad_nd(v, {0, qd - vd});
    f = compat::fused_attention_for(q, k, vp);
    if (f == compat::FusedAttention::kFlash || f == compat::FusedAttention::kCudnnFlash) {
      return CausalFusedAttentionFn::apply(q, k, vp, static_cast<int64_t>(f)).narrow(-1, 0, vd);
    }
  }
  return compat::causal_sdpa(q, k, v);
}

RopeTables make_rope_tables(int64_t head_dim, int64_t max_seq_len, double theta) {
  VIADUCT_CHECK(head_dim % 2 == 0, "rotary embeddings need an even head_dim, got ",
                head_dim);
  auto idx = torch::arange(0, head_dim, 2, torch::kDouble);
  auto inv_freq = 1.0 / torch::pow(theta, idx / static_cast<double>(head_dim));
  auto t = torch::arange(max_seq_len, torch::kDouble);
  auto freqs = torch::outer(t, inv_freq);  // [T, hd/2]
  return {freqs.cos(), freqs.sin()};  // fp64; cast at use
}

at::Tensor rope(const at::Tensor& x, const RopeTables& tables, const KernelOptions& k) {
  // x: [B, T, H, hd]
  const auto T = x.size(1);
  check_rope_length(tables, T);
  if (fused_runs(x, k) && x.dim() == 4) {
    // fp32 tables (the ATen path below rotates in fp64 by promotion).
    auto [c, s] = rope_tables_fp32(tables, T, x.device());
    return kernels::rope(x, c, s);
  }
  // fp32 rotation (fp64 for fp64 input, the gradient checks): the tables are
  // cast down, as the fused kernel does, so no fp64 arithmetic runs on
  // GPUs whose fp64 rate is a fraction of their fp32 one.
  const auto st = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto cos = tables.cos.slice(0, 0, T).to(x.device(), st).view({1, T, 1, -1});
  auto sin = tables.sin.slice(0, 0, T).to(x.device(), st).view({1, T, 1, -1});
  auto xf = x.to(st).unflatten(-1, {-1, 2});  // [B, T, H, hd/2, 2]
  auto x0 = xf.select(-1, 0), x1 = xf.select(-1, 1);
  auto out = at::stack({x0 * cos - x1 * sin, x0 * sin + x1 * cos}, -1);
  return out.flatten(-2).to(x.scalar_type());
}

MlaAttentionInputs mla_attention_inputs(const at::Tensor& q, const at::Tensor& k_pe,
                                        const at::Tensor& kv, int64_t nope,
                                        const RopeTables& tables, const KernelOptions& k,
                                        int64_t v_width) {
  const auto B = q.size(0), T = q.size(1), H = q.size(2), pe = q.size(3) - nope;
  const auto vd = kv.size(3) - nope;
  if (fused_runs(q, k)) {
    // See Note [MLA's rotary channels written in place] (kernels/rope_fn.cpp).
    at::Tensor c, s;
    if (tables.cos.defined()) {
      check_rope_length(tables, T);
      std::tie(c, s) = rope_tables_fp32(tables, T, q.device());
    }
    auto r = kernels::mla_qkv(q, k_pe, kv, c, s, nope, v_width > vd ? v_width : 0);
    return {r[0], r[1], r[2]};
  }
  auto q_nope = q.narrow(-1, 0, nope);
  auto q_pe = q.narrow(-1, nope, pe);
  auto kp = k_pe;
  if (tables.cos.defined()) {
    q_pe = rope(q_pe, tables, k);
    kp = rope(kp, tables, k);
  }
  auto v = kv.narrow(-1, nope, vd);
  if (v_width > vd) v = at::constant_pad_nd(v, {0, v_width - vd});
  return {at::cat({q_nope, q_pe}, -1), at::cat({kv.narrow(-1, 0, nope), kp.expand({B, T, H, pe})}, -1),
          v};
}

// q [B, T, H, hd], k, v [B, T, KV, hd] -> q, k, v [B, H, T, hd]: q and k
// rotated (when `tables` is given), k and v repeated to H heads.
// qkv: undefined, or the product q, k and v are slices of (see
// causal_attention).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotate_and_repeat(at::Tensor q, at::Tensor k,
                                                                 at::Tensor v,
                                                                 const RopeTables* tables,
                                                                 const KernelOptions& opts,
                                                                 const at::Tensor& qkv);

at::Tensor causal_attention(at::Tensor q, at::Tensor k, at::Tensor v, const RopeTables* tables,
                            const KernelOptions& opts, const Documents* documents,
                            const at::Tensor& qkv) {
  if (qkv.defined()) {
    VIADUCT_ASSERT(qkv.dim() == 3 && q.data_ptr() == qkv.data_ptr() &&
                       qkv.size(2) == (q.size(2) + 2 * k.size(2)) * q.size(3),
                   "causal_attention: q, k and v are not the slices of the qkv product given");
  }
  if (documents != nullptr && varlen_runs(q)) {
    // Every document of every row in one call of flash's variable-length
    // kernel: the rows as one sequence [1, B T, ...] whose positions are
    // the tokens' own (RoPE's tables gathered per token), rotated and
    // repeated as below, then attention within each document.
    const auto B = q.size(0), T = q.size(1);
    RopeTables per_token;
    if (tables != nullptr) {
      per_token = tables->at_positions(documents->positions(q.device()).flatten());
    }
    auto one_row = [&](const at::Tensor& x) { return x.reshape({1, B * T, x.size(2), x.size(3)}); };
    auto [qr, kr, vr] = rotate_and_repeat(
        one_row(q), one_row(k), one_row(v), tables != nullptr ? &per_token : nullptr, opts,
        qkv.defined() ? qkv.reshape({1, B * T, qkv.size(2)}) : at::Tensor());
    auto back = [&](const at::Tensor& x) {  // [1, H, B T, hd] -> [B, T, H, hd]
      return x.transpose(1, 2).reshape({B, T, x.size(1), x.size(3)});
    };
    return document_attention(back(qr), back(kr), back(vr), *documents).transpose(1, 2);
  }
  if (documents != nullptr) {
    // q, k, v: [B, T, *, hd]; each document as a sequence of its own.
    auto y = documents->per_document({q, k, v}, [&](const std::vector<at::Tensor>& x,
                                                    const DocumentSpan& s) {
      RopeTables shifted;
      if (tables != nullptr) shifted = tables->from(documents->first_position(s));
      return causal_attention(x[0], x[1], x[2], tables != nullptr ? &shifted : nullptr, opts)
          .transpose(1, 2);  // [1, L, H, hd]
    });
    return y.transpose(1, 2);  // [B, H, T, hd]
  }
  auto [qr, kr, vr] = rotate_and_repeat(q, k, v, tables, opts, qkv);
  return causal_attention_core(qr, kr, vr);  // [B, H, T, hd]
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rotate_and_repeat(at::Tensor q, at::Tensor k,
                                                                 at::Tensor v,
                                                                 const RopeTables* tables,
                                                                 const KernelOptions& opts,
                                                                 const at::Tensor& qkv) {
  const auto T = q.size(1), H = q.size(2), KV = k.size(2);
  if (tables != nullptr && fused_runs(q, opts)) {
    // Note [RoPE writes the repeated keys]
    // One table cast for q and k, and
    // k's KV heads come out of the RoPE kernel already repeated to H (its
    // backward sums the copies), instead of a repeat_interleave copy and
    // its reduction. v's heads are repeated by the same kernel without the
    // rotation (see Note [Repeated heads without a gather]).
    // From one qkv product, the same launches as one function whose
    // backward writes the product's gradient whole (see Note [The qkv
    // gradient written whole], kernels/rope_fn.cpp).
    check_rope_length(*tables, T);
    auto [c, s] = rope_tables_fp32(*tables, T, q.device());
    if (qkv.defined() && qkv.stride(2) == 1) {
      auto r = kernels::rope_qkv(qkv, c, s, H, KV);
      return {r[0].transpose(1, 2), r[1].transpose(1, 2), r[2].transpose(1, 2)};
    }
    q = kernels::rope(q, c, s).transpose(1, 2);            // [B, H, T, hd]
    k = kernels::rope(k, c, s, H / KV).transpose(1, 2);    // [B, H, T, hd]
    v = kernels::repeat_heads(v, H / KV).transpose(1, 2);  // [B, H, T, hd]
    return {q, k, v};
  }
  if (tables == nullptr && qkv.defined() && KV == H) {
    // See Note [The unrotated qkv gradient written whole].
    auto r = SplitQkvHeadsFn::apply(qkv, H, KV);
    return {r[0], r[1], r[2]};
  }
  if (tables != nullptr) {
    q = rope(q, *tables, opts);
    k = rope(k, *tables, opts);
  }
  q = q.transpose(1, 2);  // [B, H, T, hd]
  k = k.transpose(1, 2);  // [B, KV, T, hd]
  v = v.transpose(1, 2);
  if (KV != H) {
    k = k.repeat_interleave(H / KV, 1);  // as compat::causal_sdpa_gqa
    v = v.repeat_interleave(H / KV, 1);
  }
  return {q, k, v};
}

}  // namespace viaduct::ops
