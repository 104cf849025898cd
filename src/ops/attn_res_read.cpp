#include "ops/attn_res_read.h"

#include <ATen/record_function.h>

#include "core/check.h"
#include "kernels/fused.h"
#include "ops/rms_norm.h"

namespace viaduct::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// fp32, or fp64 for fp64 sources (gradient checks).
at::ScalarType read_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Note [AttnRes read without keys]
// The key of source i is RMSNorm(v_i) = v_i r_i w with r_i = rsqrt(mean(v_i^2)
// + eps), so its logit is w . (v_i r_i w)... = r_i (v_i . u) with u = w * q:
// one dot product and one norm per token and source, never the [N, B, T, D]
// keys or an fp32 copy of the stack. The backward keeps only the sources
// (alive anyway as the stack), r, v . u and the softmax weights ([N, B, T]
// each) and recomputes the rest one source at a time:
//   dalpha_i = g . v_i,  dlogit_i = alpha_i (dalpha_i - sum_j alpha_j dalpha_j)
//   dv_i = alpha_i g + dlogit_i r_i u - dlogit_i (v_i . u) r_i^3 / D v_i
//   du = sum_i sum_tokens dlogit_i r_i v_i;  dq = du * w, dw = du * q.
// Same equations as the keys form, different rounding.

struct ReadStats {
  at::Tensor rstd, dot, alpha;  // [N, B, T]
};

ReadStats read_stats(at::TensorList sources, const at::Tensor& u, double eps,
                     at::ScalarType st) {
  std::vector<at::Tensor> rstd, dot;
  for (const auto& v : sources) {
    auto vf = v.to(st);
    rstd.push_back(at::rsqrt(vf.pow(2).mean(-1) + eps));
    dot.push_back(at::matmul(vf, u));
  }
  ReadStats s{at::stack(rstd, 0), at::stack(dot, 0), {}};
  s.alpha = at::softmax(s.rstd * s.dot, 0);
  return s;
}

class AttnResReadFn : public torch::autograd::Function<AttnResReadFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, at::TensorList sources,
                            const at::Tensor& query, const at::Tensor& norm_weight, double eps,
                            const std::vector<at::Tensor>* slots) {
    kernels::save_read_slots(ctx, slots);
    const auto st = read_type(sources[0]);
    auto u = norm_weight.to(st) * query.to(st);
    auto s = read_stats(sources, u, eps, st);
    at::Tensor out;
    for (size_t i = 0; i < sources.size(); ++i) {
      auto term = s.alpha[static_cast<int64_t>(i)].unsqueeze(-1) * sources[i].to(st);
      out = out.defined() ? out.add_(term) : term;
    }
    std::vector<at::Tensor> saved(sources.begin(), sources.end());
    saved.insert(saved.end(), {query, norm_weight, s.rstd, s.dot, s.alpha});
    ctx->save_for_backward(saved);
    ctx->saved_data["eps"] = eps;
    return out.to(sources[0].scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto N = saved.size() - 5;
    const auto& query = saved[N];
    const auto& norm_weight = saved[N + 1];
    const auto &rstd = saved[N + 2], &dot = saved[N + 3], &alpha = saved[N + 4];
    const auto st = read_type(saved[0]);
    const double D = static_cast<double>(saved[0].size(-1));
    auto q = query.to(st), w = norm_weight.to(st);
    auto u = w * q;
    auto g = grads[0].to(st);
    std::vector<at::Tensor> dalpha;
    for (size_t i = 0; i < N; ++i) dalpha.push_back((g * saved[i].to(st)).sum(-1));
    auto da = at::stack(dalpha, 0);                               // [N, B, T]
    auto dlogit = alpha * (da - (alpha * da).sum(0, /*keepdim=*/true));
    auto dd = dlogit * rstd;                                      // d/d(v . u)
    auto dr_coef = dlogit * dot * rstd.pow(3) / D;                // through rstd
    variable_list out;
    at::Tensor du;
    for (size_t i = 0; i < N; ++i) {
      const auto k = static_cast<int64_t>(i);
      auto vf = saved[i].to(st);
      auto dv = alpha[k].unsqueeze(-1) * g + dd[k].unsqueeze(-1) * u -
                dr_coef[k].unsqueeze(-1) * vf;
      auto dui = at::matmul(dd[k].reshape({1, -1}), vf.reshape({-1, vf.size(-1)})).squeeze(0);
      du = du.defined() ? du.add_(dui) : dui;
      auto slot = kernels::saved_read_slot(ctx, i);
      if (slot.defined()) {
        kernels::attn_res_slot_add(slot, dv.to(saved[i].scalar_type()));
        out.emplace_back();
      } else {
        out.push_back(dv.to(saved[i].scalar_type()));
      }
    }
    out.push_back((du * w).to(query.scalar_type()));        // d query
    out.push_back((du * q).to(norm_weight.scalar_type()));  // d norm.weight
    out.emplace_back();                                      // eps
    out.emplace_back();                                      // slots
    return out;
  }
};

}  // namespace

at::Tensor attn_res_read(const std::vector<at::Tensor>& sources, const at::Tensor& query,
                         const at::Tensor& norm_weight, double eps,
                         const std::vector<at::Tensor>* slots, const KernelOptions& k) {
  RECORD_FUNCTION("viaduct::attn_res_read", std::vector<c10::IValue>());  // named in profiles
  if (k.fused && kernels::attn_res_read_usable(sources)) {
    return kernels::attn_res_read(sources, query, norm_weight, eps, slots);
  }
  return AttnResReadFn::apply(at::TensorList(sources), query, norm_weight, eps, slots);
}

at::Tensor attn_res_read_norm(const std::vector<at::Tensor>& sources, const at::Tensor& query,
                              const at::Tensor& norm_weight, double eps,
                              const std::vector<at::Tensor>* slots, const at::Tensor& out_weight,
                              double out_eps, const KernelOptions& k) {
  if (k.fused && kernels::attn_res_read_norm_usable(sources, out_weight)) {
    RECORD_FUNCTION("viaduct::attn_res_read", std::vector<c10::IValue>());  // named in profiles
    return kernels::attn_res_read_norm(sources, query, norm_weight, eps, slots, out_weight,
                                       out_eps);
  }
  return rms_norm(attn_res_read(sources, query, norm_weight, eps, slots, k), out_weight, out_eps,
                  k);
}

at::Tensor attn_res_read_weights(const std::vector<at::Tensor>& sources, const at::Tensor& query,
                                 const at::Tensor& norm_weight, double eps) {
  const auto st = read_type(sources[0]);
  auto u = norm_weight.to(st) * query.to(st);
  return read_stats(sources, u, eps, st).alpha;
}

}  // namespace viaduct::ops
