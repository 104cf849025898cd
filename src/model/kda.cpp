// Kimi Delta Attention: the layer (the recurrence itself is ops/kda.h).
#include "model/kda.h"

#include <cmath>

#include "core/check.h"
#include "core/rng.h"
#include "ops/linear.h"
#include "ops/rms_norm.h"
#include "ops/short_conv.h"

namespace viaduct {
namespace {

// The precision the layer's gates and norms run in: fp64 stays fp64, all
// else is fp32.
at::ScalarType inner_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace

ShortConvImpl::ShortConvImpl(int64_t channels, int64_t kernel) {
  weight = register_parameter("weight", torch::zeros({channels, kernel}));
}

at::Tensor ShortConvImpl::forward(const at::Tensor& x, const ops::Documents* documents) {
  // x: [B, T, C]; y_t = silu(sum_j w[:, j] x_{t - K + 1 + j})
  return ops::short_conv_silu(x, weight, kernel_options_, documents);
}

KdaImpl::KdaImpl(const KdaOptions& o) : opts_(o) {
  VIADUCT_CHECK(o.dim > 0 && o.n_heads > 0 && o.head_dim > 0,
                "KDA needs positive model.dim, model.n_heads and "
                "model.kda_head_dim");
  const int64_t hk = o.n_heads * o.head_dim;
  q_proj = make_linear(*this, "q_proj", o.dim, hk, false);
  k_proj = make_linear(*this, "k_proj", o.dim, hk, false);
  v_proj = make_linear(*this, "v_proj", o.dim, hk, false);
  q_conv = register_module("q_conv", ShortConv(hk, o.conv_size));
  k_conv = register_module("k_conv", ShortConv(hk, o.conv_size));
  v_conv = register_module("v_conv", ShortConv(hk, o.conv_size));
  f_a = make_linear(*this, "f_a", o.dim, o.head_dim, false);
  f_b = make_linear(*this, "f_b", o.head_dim, hk, false);
  A_log = register_parameter("A_log", torch::zeros({o.n_heads}));
  dt_bias = register_parameter("dt_bias", torch::zeros({hk}));
  b_proj = make_linear(*this, "b_proj", o.dim, o.n_heads, false);
  g_a = make_linear(*this, "g_a", o.dim, o.head_dim, false);
  g_b = make_linear(*this, "g_b", o.head_dim, hk, true);
  o_norm = register_module("o_norm", RMSNorm(o.head_dim, o.norm_eps));
  o_proj = make_linear(*this, "o_proj", hk, o.dim, false);
}

int64_t KdaImpl::count_params(const KdaOptions& o) {
  const int64_t hk = o.n_heads * o.head_dim;
  return 3 * o.dim * hk                     // q, k, v
         + 3 * hk * o.conv_size             // short convolutions
         + (o.dim * o.head_dim + o.head_dim * hk)        // f_a, f_b
         + o.n_heads + hk                   // A_log, dt_bias
         + o.dim * o.n_heads                // b_proj
         + (o.dim * o.head_dim + o.head_dim * hk + hk)   // g_a, g_b (+bias)
         + o.head_dim                       // o_norm
         + hk * o.dim;                      // o_proj
}

double KdaImpl::mixing_flops(const KdaOptions& o) {
  // Per token and head, forward, chunk C, dk = dv = d:
  //   Aqk and L rows:       2 * (2 C d)
  //   triangular solve:     C (dk + dv)        (half of 2 C per right side)
  //   Aqk V':               2 C dv
  //   W S, Q S, K^T V':     3 * (2 d d)
  // Training = 3 x forward.
  const double C = static_cast<double>(o.chunk_size);
  const double d = static_cast<double>(o.head_dim);
  const double fwd = 4 * C * d + C * 2 * d + 2 * C * d + 6 * d * d;
  return 3.0 * fwd * static_cast<double>(o.n_heads);
}

void KdaImpl::init_weights(uint64_t seed, const std::string& p, double std_in,
                           double std_out) {
  auto tn = [&](const at::Tensor& w, const std::string& name, double std) {
    init_trunc_normal_(w, std, -2.0, 2.0, seed, p + name);
  };
  tn(q_proj->weight, "q_proj.weight", std_in);
  tn(k_proj->weight, "k_proj.weight", std_in);
  tn(v_proj->weight, "v_proj.weight", std_in);
  const double conv_std = 1.0 / std::sqrt(static_cast<double>(opts_.conv_size));
  tn(q_conv->weight, "q_conv.weight", conv_std);
  tn(k_conv->weight, "k_conv.weight", conv_std);
  tn(v_conv->weight, "v_conv.weight", conv_std);
  tn(f_a->weight, "f_a.weight", std_in);
  tn(f_b->weight, "f_b.weight", std_in);
  tn(b_proj->weight, "b_proj.weight", std_in);
  tn(g_a->weight, "g_a.weight", std_in);
  tn(g_b->weight, "g_b.weight", std_in);
  tn(o_proj->weight, "o_proj.weight", std_out);
  torch::NoGradGuard no_grad;
  g_b->bias.zero_();
  o_norm->reset_parameters();
  // A_log = log U(1, 16); dt_bias = softplus^-1(dt), dt = exp(U(ln 1e-3,
  // ln 1e-1)), as Kimi Linear initialises them.
  auto gen_a = make_generator(seed, p + "A_log");
  auto a = at::empty({opts_.n_heads}, at::kFloat).uniform_(1.0, 16.0, gen_a);
  A_log.copy_(a.log());
  auto gen_dt = make_generator(seed, p + "dt_bias");
  auto dt = at::empty({dt_bias.size(0)}, at::kFloat)
                .uniform_(std::log(1e-3), std::log(1e-1), gen_dt)
                .exp();
  dt_bias.copy_(dt + at::log(-at::expm1(-dt)));  // softplus^-1
}

KdaProjections KdaImpl::project(const at::Tensor& x) {
  // x: [B, T, D]
  const auto w = ops::linear_split(x,
                                   {q_proj->weight, k_proj->weight, v_proj->weight, f_a->weight,
                                    b_proj->weight, g_a->weight},
                                   kernel_options_);
  // Every part stays a view of the one product: the short convolutions
  // keep q's, k's and v's columns of it for their backward anyway, so the
  // f_b and g_b linears keep f and g as views at no cost, read them in place
  // and write their gradients into the product's (see Note [Packed
  // projection gradients in place], kernels/fused.h).
  return {w[0], w[1], w[2], w[3], w[4], w[5]};
}

KdaRuleInputs KdaImpl::rule_inputs(const KdaProjections& p, const ops::Documents* documents) {
  // p.q: [B, T, H dk]
  const auto B = p.q.size(0), T = p.q.size(1);
  const auto H = opts_.n_heads, d = opts_.head_dim;
  const auto st = inner_type(p.q);
  KdaRuleInputs in;
  // q and k: the convolution and the L2 norm per head (q scaled by dk^-1/2).
  in.q = ops::short_conv_silu_l2(p.q, q_conv->weight, d, 1e-6,
                                 1.0 / std::sqrt(static_cast<double>(d)), kernel_options_,
                                 documents);
  in.k = ops::short_conv_silu_l2(p.k, k_conv->weight, d, 1e-6, 1.0, kernel_options_, documents);
  in.v = v_conv->forward(p.v, documents).view({B, T, H, d});
  // Per-channel log decay g = -exp(A_log) * softplus(f + dt_bias) <= 0.
  in.g = ops::kda_decay(linear(p.f, f_b, kernel_options_), dt_bias, A_log, kernel_options_);
  in.beta = at::sigmoid(p.b.to(st));  // [B, T, H]
  return in;
}

at::Tensor KdaImpl::output(const KdaProjections& p, const at::Tensor& o) {
  // o: [B, T, H, dv]
  const auto B = p.q.size(0), T = p.q.size(1);
  const auto H = opts_.n_heads, d = opts_.head_dim;
  // Per-head RMSNorm times a sigmoid gate, then the projection.
  auto gate_logits = linear(p.g, g_b, kernel_options_).view({B, T, H, d});
  auto y = ops::gated_rms_norm(o, o_norm->weight, o_norm->eps_, gate_logits,
                               p.q.scalar_type(), o_norm->kernel_options());  // [B, T, H, dv]
  return linear(y.reshape({B, T, H * d}), o_proj, kernel_options_);
}

at::Tensor KdaImpl::forward(const at::Tensor& x, const ops::Documents* documents) {
  const auto p = project(x);
  const auto in = rule_inputs(p, documents);
  return output(p, ops::kda(in.q, in.k, in.v, in.g, in.beta, opts_.chunk_size, kernel_options_,
                            {}, documents));
}

}  // namespace viaduct
