// Block AttnRes read (see Note [AttnRes stack] in attn_res.h).
#include "model/attn_res.h"

#include "core/check.h"

namespace viaduct {

AttnResReadImpl::AttnResReadImpl(int64_t dim, double eps) {
  query = register_parameter("query", torch::zeros({dim}));
  norm = register_module("norm", RMSNorm(dim, eps));
}

void AttnResReadImpl::init_weights() {
  torch::NoGradGuard g;
  query.zero_();
  norm->reset_parameters();
}

namespace {
// The sources as one fp32 (or fp64) tensor [N, B, T, D].
at::Tensor stack_sources(const std::vector<at::Tensor>& sources) {
  VIADUCT_ASSERT(!sources.empty(), "an AttnRes read needs at least one source");
  auto v = at::stack(sources, 0);
  return v.scalar_type() == at::kDouble ? v : v.to(at::kFloat);
}
}  // namespace

at::Tensor AttnResReadImpl::weights(const std::vector<at::Tensor>& sources) {
  auto v = stack_sources(sources);  // [N, B, T, D]
  // Keys: RMSNorm(v) computed in v's (fp32/fp64) precision.
  auto keys = norm->forward(v);
  auto q = query.to(v.scalar_type());
  auto logits = at::matmul(keys, q);  // [N, B, T]
  return at::softmax(logits, 0);
}

at::Tensor AttnResReadImpl::forward(const std::vector<at::Tensor>& sources) {
  const auto dtype = sources[0].scalar_type();
  auto v = stack_sources(sources);                  // [N, B, T, D]
  auto q = query.to(v.scalar_type());
  auto logits = at::matmul(norm->forward(v), q);   // [N, B, T]
  auto alpha = at::softmax(logits, 0);              // [N, B, T]
  auto out = (alpha.unsqueeze(-1) * v).sum(0);      // [B, T, D]
  return out.to(dtype);
}

}  // namespace viaduct
