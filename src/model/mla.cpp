// Multi-head Latent Attention (see mla.h).
#include "model/mla.h"

#include "core/check.h"
#include "core/rng.h"
#include "ops/linear.h"
#include "ops/rope.h"

namespace viaduct {

MlaImpl::MlaImpl(const MlaOptions& o) : opts_(o) {
  VIADUCT_CHECK(o.n_heads > 0 && o.kv_lora_rank > 0 && o.v_head_dim > 0 &&
                    o.qk_nope_head_dim + o.qk_rope_head_dim > 0,
                "MLA needs positive model.n_heads, model.mla_kv_lora_rank, "
                "model.mla_v_head_dim and a positive query/key head width");
  VIADUCT_CHECK(o.qk_rope_head_dim % 2 == 0,
                "model.mla_qk_rope_head_dim must be even, got ",
                o.qk_rope_head_dim);
  const int64_t qk = o.qk_nope_head_dim + o.qk_rope_head_dim;
  if (o.q_lora_rank > 0) {
    wq_a = make_linear(*this, "wq_a", o.dim, o.q_lora_rank, false);
    q_norm = register_module("q_norm", RMSNorm(o.q_lora_rank, o.norm_eps));
    wq_b = make_linear(*this, "wq_b", o.q_lora_rank, o.n_heads * qk, false);
  } else {
    wq = make_linear(*this, "wq", o.dim, o.n_heads * qk, false);
  }
  wkv_a = make_linear(*this, "wkv_a", o.dim,
                      o.kv_lora_rank + o.qk_rope_head_dim, false);
  kv_norm = register_module("kv_norm", RMSNorm(o.kv_lora_rank, o.norm_eps));
  wkv_b = make_linear(*this, "wkv_b", o.kv_lora_rank,
                      o.n_heads * (o.qk_nope_head_dim + o.v_head_dim), false);
  wo = make_linear(*this, "wo", o.n_heads * o.v_head_dim, o.dim, false);
  if (o.rope && o.qk_rope_head_dim > 0) {
    // Buffers, as Attention's: on the host every rope call on a GPU would
    // copy its slice over with a synchronising host-to-device copy.
    rope_ = register_rope_buffers(
        *this, make_rope_tables(o.qk_rope_head_dim, o.max_seq_len, o.rope_theta));
  }
}

int64_t MlaImpl::count_params(const MlaOptions& o) {
  const int64_t qk = o.qk_nope_head_dim + o.qk_rope_head_dim;
  int64_t n = 0;
  if (o.q_lora_rank > 0) {
    n += o.dim * o.q_lora_rank + o.q_lora_rank + o.q_lora_rank * o.n_heads * qk;
  } else {
    n += o.dim * o.n_heads * qk;
  }
  n += o.dim * (o.kv_lora_rank + o.qk_rope_head_dim) + o.kv_lora_rank;
  n += o.kv_lora_rank * o.n_heads * (o.qk_nope_head_dim + o.v_head_dim);
  n += o.n_heads * o.v_head_dim * o.dim;
  return n;
}

double MlaImpl::attention_flops_per_pair(const MlaOptions& o) {
  const double qk = static_cast<double>(o.qk_nope_head_dim + o.qk_rope_head_dim);
  return 6.0 * static_cast<double>(o.n_heads) * (qk + static_cast<double>(o.v_head_dim));
}

void MlaImpl::init_weights(uint64_t seed, const std::string& p, double std_in,
                           double std_out) {
  auto tn = [&](const torch::nn::Linear& l, const std::string& name,
                double std) {
    init_trunc_normal_(l->weight, std, -2.0, 2.0, seed, p + name + ".weight");
  };
  if (opts_.q_lora_rank > 0) {
    tn(wq_a, "wq_a", std_in);
    tn(wq_b, "wq_b", std_in);
    q_norm->reset_parameters();
  } else {
    tn(wq, "wq", std_in);
  }
  tn(wkv_a, "wkv_a", std_in);
  tn(wkv_b, "wkv_b", std_in);
  tn(wo, "wo", std_out);
  kv_norm->reset_parameters();
}

at::Tensor MlaImpl::forward(const at::Tensor& x, const ops::Documents* documents) {
  // x: [B, T, D]
  const auto B = x.size(0), T = x.size(1), H = opts_.n_heads;
  const auto nope = opts_.qk_nope_head_dim, pe = opts_.qk_rope_head_dim;
  const auto vd = opts_.v_head_dim;
  // The two projections of x, q's (its latent, or q itself) and the kv
  // latent with k's rotary part, as one GEMM where the kernels run:
  // see Note [One GEMM for the projections of one input] (ops/linear.cpp).
  // Three parts: q's, the kv latent and k's rotary part, so that the
  // latter two hand their gradients to the product's directly rather than
  // through two narrows' zero-filled gradients and their sum.
  const auto& wq_x = opts_.q_lora_rank > 0 ? wq_a->weight : wq->weight;
  const auto xw = ops::linear_split(x, {wq_x, wkv_a->weight}, kernel_options_,
                                    {}, {wq_x.size(0), opts_.kv_lora_rank, pe});
  auto q = opts_.q_lora_rank > 0 ? linear(q_norm(xw[0]), wq_b, kernel_options_)
                                 : xw[0];
  q = q.reshape({B, T, H, nope + pe});
  auto c_kv = kv_norm(xw[1]);  // [B, T, kv_lora]
  auto k_pe = xw[2].view({B, T, 1, pe});
  auto kv = linear(c_kv, wkv_b, kernel_options_).view({B, T, H, nope + vd});
  at::Tensor y;  // [B, T, H, vd]
  if (documents != nullptr && ops::varlen_runs(q)) {
    // Every document in one call of flash's variable-length kernel, the
    // rotary tables gathered per token (see causal_attention, ops/rope.cpp).
    const auto tables = rope_.cos.defined()
                            ? rope_.at_positions(documents->positions(q.device()).flatten())
                            : RopeTables{};
    y = attend(q, k_pe, kv, tables, documents);
  } else if (documents != nullptr) {
    y = documents->per_document({q, k_pe, kv}, [&](const std::vector<at::Tensor>& d,
                                                   const ops::DocumentSpan& s) {
      return attend(d[0], d[1], d[2],
                    rope_.cos.defined() ? rope_.from(documents->first_position(s))
                                        : RopeTables{});
    });
  } else {
    y = attend(q, k_pe, kv, rope_);
  }
  return linear(y.reshape({B, T, H * vd}), wo, kernel_options_);
}

at::Tensor MlaImpl::attend(const at::Tensor& q, at::Tensor k_pe, const at::Tensor& kv,
                           const RopeTables& tables, const ops::Documents* documents) {
  const auto B = q.size(0), T = q.size(1);
  const auto nope = opts_.qk_nope_head_dim;
  // q, k: [B, T, H, nope + pe], q's rotary channels rotated and k's rotary
  // key broadcast over heads; v [B, T, H, vd], except under documents:
  // flash's variable-length kernel (every document at once) wants v as wide
  // as q, so the values come zero-padded (see Note [Narrow value heads on
  // flash's kernel], ops/rope.cpp) and the output is cut back.
  const auto D = q.size(3), vd = opts_.v_head_dim;
  const auto v_width = documents != nullptr ? D : 0;
  ops::MlaAttentionInputs in;
  if (documents != nullptr && tables.cos.defined()) {
    // Per-token tables: the rows as one sequence, each token its row.
    const auto rows = [&](const at::Tensor& x) {
      return x.reshape({1, B * T, x.size(2), x.size(3)});
    };
    in = ops::mla_attention_inputs(rows(q), rows(k_pe), rows(kv), nope, tables, kernel_options_,
                                   v_width);
    const auto back = [&](const at::Tensor& x) { return x.view({B, T, x.size(2), x.size(3)}); };
    in = {back(in.q), back(in.k), back(in.v)};
  } else {
    in = ops::mla_attention_inputs(q, k_pe, kv, nope, tables, kernel_options_, v_width);
  }
  if (documents != nullptr) {
    return ops::document_attention(in.q, in.k, in.v, *documents).narrow(-1, 0, vd);
  }
  return ops::causal_attention_core(in.q.transpose(1, 2), in.k.transpose(1, 2),
                                    in.v.transpose(1, 2))
      .transpose(1, 2);  // [B, T, H, vd]
}

}  // namespace viaduct
