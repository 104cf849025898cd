#include "model/layers.h"

#include "core/check.h"
#include "core/rng.h"
#include "core/torch_compat.h"
#include "kernels/fused.h"
#include "kernels/weight_cache.h"

namespace viaduct {

// Norms and rotations run in fp32, or fp64 when the input is fp64.
static at::ScalarType upcast(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

namespace {

// Note [Linear with an fp32 weight gradient]: on the fused-kernel path a
// linear whose fp32 master weight is used in the bf16 input's dtype computes
// its weight gradient with one GEMM writing fp32 (compat::matmul_into_fp32_)
// instead of a bf16 product cast up by autograd's ToCopyBackward: one pass
// less over every weight gradient, and no bf16 rounding of it. The weight
// may come in parts (q, k and v: one GEMM, Note [One qkv projection]); the
// bf16 weight is their concatenation from the weight cache (Note
// [Low-precision weight cache]), kept for the backward as at::linear keeps
// its cast weight, and the fp32 gradient is split back into the parts.
struct MixedLinear {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            at::TensorList w, const at::Tensor& b) {
    auto wc = kernels::weight_cache::get(w, x.scalar_type());
    ctx->save_for_backward({x, wc});
    std::vector<int64_t> rows;
    for (const auto& p : w) rows.push_back(p.size(0));
    ctx->saved_data["rows"] = rows;
    if (!b.defined()) return at::linear(x, wc);
    ctx->saved_data["b_dtype"] = static_cast<int64_t>(b.scalar_type());
    return at::linear(x, wc, b.to(x.scalar_type()));
  }
  // {dx, dw per part..., db}; db only when `bias_slot`.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 const torch::autograd::variable_list& grads,
                                                 bool bias_slot) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &wc = saved[1];
    const auto rows = ctx->saved_data["rows"].toIntVector();
    const auto n = rows.size();
    const auto out_f = wc.size(0), in_f = wc.size(1);
    auto dy = grads[0].to(x.scalar_type()).reshape({-1, out_f});
    torch::autograd::variable_list out(1 + n + (bias_slot ? 1 : 0));
    if (ctx->needs_input_grad(0)) out[0] = at::mm(dy, wc).view(x.sizes());
    bool any_w = false;
    for (size_t i = 0; i < n; ++i) any_w = any_w || ctx->needs_input_grad(1 + i);
    if (any_w) {
      auto dw = at::empty({out_f, in_f}, dy.options().dtype(at::kFloat));
      compat::matmul_into_fp32_(dw, dy.t(), x.reshape({-1, in_f}), /*accumulate=*/false);
      int64_t row = 0;
      for (size_t i = 0; i < n; ++i) {
        // Rows of a contiguous tensor: contiguous views, no copies.
        if (ctx->needs_input_grad(1 + i)) out[1 + i] = n == 1 ? dw : dw.narrow(0, row, rows[i]);
        row += rows[i];
      }
    }
    if (bias_slot && ctx->needs_input_grad(1 + n)) {
      out[1 + n] = dy.sum(0, false, at::kFloat)
                       .to(static_cast<at::ScalarType>(ctx->saved_data["b_dtype"].toInt()));
    }
    return out;
  }
};

// Custom functions cannot take an undefined tensor as an input on LibTorch
// 2.x (their input metadata reads its device), so a linear without a bias is
// its own function rather than MixedLinearFn with an empty bias.
class MixedLinearFn : public torch::autograd::Function<MixedLinearFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            at::TensorList w, const at::Tensor& b) {
    return MixedLinear::forward(ctx, x, w, b);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return MixedLinear::backward(ctx, grads, /*bias_slot=*/true);
  }
};

class MixedLinearNoBiasFn : public torch::autograd::Function<MixedLinearNoBiasFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            at::TensorList w) {
    return MixedLinear::forward(ctx, x, w, at::Tensor());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return MixedLinear::backward(ctx, grads, /*bias_slot=*/false);
  }
};

bool mixed_linear_applies(const at::Tensor& x, at::TensorList w) {
  if (x.scalar_type() != at::kBFloat16 || !kernels::usable(x) ||
      kernels::disabled("mixed_linear")) {
    return false;
  }
  for (const auto& p : w) {
    if (p.scalar_type() != at::kFloat || !p.requires_grad() || p.dim() != 2) return false;
  }
  return true;
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& w,
                  const at::Tensor& b) {
  return linear_parts(x, {w}, b);
}

at::Tensor linear_parts(const at::Tensor& x, at::TensorList w, const at::Tensor& b) {
  if (mixed_linear_applies(x, w)) {
    return b.defined() ? MixedLinearFn::apply(x, w, b) : MixedLinearNoBiasFn::apply(x, w);
  }
  const auto whole = w.size() == 1 ? w[0] : at::cat(w);
  const auto wc = whole.scalar_type() == x.scalar_type() ? whole : whole.to(x.scalar_type());
  if (b.defined()) {
    const auto bc = b.scalar_type() == x.scalar_type() ? b : b.to(x.scalar_type());
    return at::linear(x, wc, bc);
  }
  return at::linear(x, wc);
}

at::Tensor linear(const at::Tensor& x, const torch::nn::Linear& l) {
  return linear(x, l->weight, l->options.bias() ? l->bias : at::Tensor());
}

torch::nn::Linear make_linear(torch::nn::Module& parent, const std::string& name,
                              int64_t in, int64_t out, bool bias) {
  return parent.register_module(
      name, torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias)));
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}
void RMSNormImpl::reset_parameters() {
  torch::NoGradGuard g;
  weight.fill_(1.0);
}
at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  if (kernels::usable(x)) return kernels::rms_norm(x, weight, eps_);
  // fp32, or fp64 when the input is fp64 (gradient checks).
  auto xf = x.scalar_type() == at::kDouble ? x : x.to(at::kFloat);
  auto y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return (y * weight).to(x.scalar_type());
}

std::pair<at::Tensor, at::Tensor> RMSNormImpl::forward_with_residual(const at::Tensor& x,
                                                                     const at::Tensor& res) {
  if (kernels::usable(x) && !kernels::disabled("add_rms_norm") &&
      x.scalar_type() == res.scalar_type() && x.sizes() == res.sizes()) {
    return kernels::add_rms_norm(x, res, weight, eps_);
  }
  auto h = x + res;
  return {h, forward(h)};
}

LayerNormImpl::LayerNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
  bias = register_parameter("bias", torch::zeros({dim}));
}
void LayerNormImpl::reset_parameters() {
  torch::NoGradGuard g;
  weight.fill_(1.0);
  bias.zero_();
}
at::Tensor LayerNormImpl::forward(const at::Tensor& x) {
  auto y = at::layer_norm(x.to(upcast(x.scalar_type())), {weight.size(0)},
                          weight, bias, eps_);
  return y.to(x.scalar_type());
}

RopeTables make_rope_tables(int64_t head_dim, int64_t max_seq_len,
                            double theta) {
  VIADUCT_CHECK(head_dim % 2 == 0, "rotary embeddings need an even head_dim, got ",
                head_dim);
  auto idx = torch::arange(0, head_dim, 2, torch::kDouble);
  auto inv_freq = 1.0 / torch::pow(theta, idx / static_cast<double>(head_dim));
  auto t = torch::arange(max_seq_len, torch::kDouble);
  auto freqs = torch::outer(t, inv_freq);  // [T, hd/2]
  return {freqs.cos(), freqs.sin()};  // fp64; cast at use
}

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
}  // namespace

at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope) {
  // x: [B, T, H, hd]
  const auto T = x.size(1);
  check_rope_length(rope, T);
  if (kernels::usable(x) && x.dim() == 4) {
    // fp32 tables (the ATen path below rotates in fp64 by promotion).
    auto [c, s] = rope_tables_fp32(rope, T, x.device());
    return kernels::rope(x, c, s);
  }
  // fp32 rotation (fp64 for fp64 input, the gradient checks): the tables are
  // cast down, as the fused kernel does, so no fp64 arithmetic runs on
  // GPUs whose fp64 rate is a fraction of their fp32 one.
  const auto st = upcast(x.scalar_type());
  auto cos = rope.cos.slice(0, 0, T).to(x.device(), st).view({1, T, 1, -1});
  auto sin = rope.sin.slice(0, 0, T).to(x.device(), st).view({1, T, 1, -1});
  auto xf = x.to(st).unflatten(-1, {-1, 2});  // [B, T, H, hd/2, 2]
  auto x0 = xf.select(-1, 0), x1 = xf.select(-1, 1);
  auto out = at::stack({x0 * cos - x1 * sin, x0 * sin + x1 * cos}, -1);
  return out.flatten(-2).to(x.scalar_type());
}

AttentionImpl::AttentionImpl(const AttentionOptions& o) : opts_(o) {
  VIADUCT_CHECK(o.dim % o.n_heads == 0, "model.dim ", o.dim,
                " must be divisible by model.n_heads ", o.n_heads);
  VIADUCT_CHECK(o.n_heads % o.n_kv_heads == 0, "model.n_heads ", o.n_heads,
                " must be divisible by model.n_kv_heads ", o.n_kv_heads);
  head_dim_ = o.dim / o.n_heads;
  const int64_t kv = o.n_kv_heads * head_dim_;
  wq = make_linear(*this, "wq", o.dim, o.dim, o.bias);
  wk = make_linear(*this, "wk", o.dim, kv, o.bias);
  wv = make_linear(*this, "wv", o.dim, kv, o.bias);
  wo = make_linear(*this, "wo", o.dim, o.dim, o.bias);
  if (o.rope) {
    // Buffers, so Module::to(device) moves them once; not persistent state
    // (checkpoints hold parameters only).
    auto tables = make_rope_tables(head_dim_, o.max_seq_len, o.rope_theta);
    rope_.cos = register_buffer("rope_cos", tables.cos);
    rope_.sin = register_buffer("rope_sin", tables.sin);
  }
}

void AttentionImpl::init_weights(uint64_t seed, const std::string& p,
                                 double std_in, double std_out,
                                 bool truncated) {
  auto init = [&](torch::nn::Linear& l, const std::string& name, double std) {
    if (truncated) {
      init_trunc_normal_(l->weight, std, -2.0, 2.0, seed, p + name + ".weight");
    } else {
      init_normal_(l->weight, std, seed, p + name + ".weight");
    }
    if (l->options.bias()) {
      torch::NoGradGuard g;
      l->bias.zero_();
    }
  };
  init(wq, "wq", std_in);
  init(wk, "wk", std_in);
  init(wv, "wv", std_in);
  init(wo, "wo", std_out);
}

at::Tensor AttentionImpl::forward(const at::Tensor& x) {
  // x: [B, T, D]
  const auto B = x.size(0), T = x.size(1);
  const auto H = opts_.n_heads, KV = opts_.n_kv_heads, hd = head_dim_;
  at::Tensor q, k, v;
  if (kernels::usable(x)) {
    // Note [One qkv projection]: on the fused-kernel path q, k and v come
    // from one GEMM over the concatenated weights: a wider product instead
    // of three (two of them only kv wide), and in the backward one GEMM for
    // dx instead of three plus two additions. The slices are strided views;
    // the RoPE kernel and SDPA read them in place.
    // The three weights as parts of one linear (Note [Linear with an fp32
    // weight gradient]): their bf16 concatenation from the weight cache,
    // the fp32 gradient split back into the three.
    auto qkv = linear_parts(x, {wq->weight, wk->weight, wv->weight},
                            opts_.bias ? at::cat({wq->bias, wk->bias, wv->bias}) : at::Tensor());
    auto parts = qkv.split_with_sizes({H * hd, KV * hd, KV * hd}, -1);
    q = parts[0].view({B, T, H, hd});
    k = parts[1].view({B, T, KV, hd});
    v = parts[2].view({B, T, KV, hd});
  } else {
    q = linear(x, wq).view({B, T, H, hd});
    k = linear(x, wk).view({B, T, KV, hd});
    v = linear(x, wv).view({B, T, KV, hd});
  }
  at::Tensor y;
  if (opts_.rope && kernels::usable(x) && !kernels::disabled("rope_repeat")) {
    // Note [RoPE writes the repeated keys]: one table cast for q and k, and
    // k's KV heads come out of the RoPE kernel already repeated to H (its
    // backward sums the copies), instead of a repeat_interleave copy and
    // its reduction. v's heads are repeated by the same kernel without the
    // rotation (Note [Repeated heads without a gather]).
    check_rope_length(rope_, T);
    auto [c, s] = rope_tables_fp32(rope_, T, x.device());
    q = kernels::rope(q, c, s).transpose(1, 2);          // [B, H, T, hd]
    k = kernels::rope(k, c, s, H / KV).transpose(1, 2);  // [B, H, T, hd]
    v = kernels::repeat_heads(v, H / KV).transpose(1, 2);  // [B, H, T, hd]
    y = compat::causal_sdpa(q, k, v);  // [B, H, T, hd]
  } else {
    if (opts_.rope) {
      // Module::to() moves buffers with set_data, so rope_ stays valid.
      q = apply_rope(q, rope_);
      k = apply_rope(k, rope_);
    }
    q = q.transpose(1, 2);  // [B, H, T, hd]
    k = k.transpose(1, 2);  // [B, KV, T, hd]
    v = v.transpose(1, 2);
    y = compat::causal_sdpa_gqa(q, k, v);  // [B, H, T, hd]
  }
  y = y.transpose(1, 2).reshape({B, T, H * hd});
  return linear(y, wo);
}

SwiGLUImpl::SwiGLUImpl(int64_t dim, int64_t hidden) {
  w1 = make_linear(*this, "w1", dim, hidden, false);
  w2 = make_linear(*this, "w2", hidden, dim, false);
  w3 = make_linear(*this, "w3", dim, hidden, false);
}
void SwiGLUImpl::init_weights(uint64_t seed, const std::string& p,
                              double std_in, double std_out) {
  init_trunc_normal_(w1->weight, std_in, -2.0, 2.0, seed, p + "w1.weight");
  init_trunc_normal_(w2->weight, std_out, -2.0, 2.0, seed, p + "w2.weight");
  init_trunc_normal_(w3->weight, std_out, -2.0, 2.0, seed, p + "w3.weight");
}
at::Tensor SwiGLUImpl::forward(const at::Tensor& x) {
  if (kernels::usable(x)) {
    // Note [One w1/w3 projection]: as the qkv projection (Note [One qkv
    // projection]), w1 and w3 are the parts of one GEMM, [tokens, 2F]; the
    // SwiGLU kernels read its halves in place and write their gradient as
    // one [tokens, 2F] tensor, so the backward's dx is one GEMM and x's two
    // gradients need no addition (one [tokens, D] add a layer less). With
    // model.swiglu_one_gemm (on by default); bf16 with fp32
    // weights only (elsewhere the concatenation would be a copy).
    if (kernels::swiglu_one_gemm() && mixed_linear_applies(x, {w1->weight, w3->weight})) {
      return kernels::swiglu_linear_packed(linear_parts(x, {w1->weight, w3->weight}, {}),
                                           w2->weight);
    }
    return kernels::swiglu_linear(linear(x, w1), linear(x, w3), w2->weight);
  }
  return linear(at::silu(linear(x, w1)) * linear(x, w3), w2);
}

GeluMLPImpl::GeluMLPImpl(int64_t dim, int64_t hidden) {
  w1 = make_linear(*this, "w1", dim, hidden, true);
  w2 = make_linear(*this, "w2", hidden, dim, true);
}
void GeluMLPImpl::init_weights(uint64_t seed, const std::string& p,
                               double std_in, double std_out) {
  init_normal_(w1->weight, std_in, seed, p + "w1.weight");
  init_normal_(w2->weight, std_out, seed, p + "w2.weight");
  torch::NoGradGuard g;
  w1->bias.zero_();
  w2->bias.zero_();
}
at::Tensor GeluMLPImpl::forward(const at::Tensor& x) {
  return linear(at::gelu(linear(x, w1), "tanh"), w2);
}

int64_t llama_ffn_hidden(int64_t dim, int64_t multiple_of,
                         double ffn_dim_multiplier) {
  int64_t hidden = 4 * dim;
  hidden = 2 * hidden / 3;
  hidden = static_cast<int64_t>(ffn_dim_multiplier * hidden);
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

}  // namespace viaduct
