#include "ops/embedding.h"

#include "kernels/fused.h"

namespace viaduct::ops {

namespace {

class EmbeddingFn : public torch::autograd::Function<EmbeddingFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& weight,
                            const at::Tensor& tokens) {
    ctx->save_for_backward({tokens});
    ctx->saved_data["vocab"] = weight.size(0);
    return at::embedding(weight, tokens);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto tokens = ctx->get_saved_variables()[0];
    at::Tensor dw;
    if (ctx->needs_input_grad(0)) {
      dw = kernels::embedding_weight_grad(grads[0].to(at::kFloat), tokens,
                                          ctx->saved_data["vocab"].toInt());
    }
    return {dw, at::Tensor()};
  }
};

}  // namespace

at::Tensor embedding(const at::Tensor& weight, const at::Tensor& tokens, const KernelOptions& k) {
  if (fused_runs(weight, k) && weight.scalar_type() == at::kFloat) {
    return EmbeddingFn::apply(weight, tokens);
  }
  return at::embedding(weight, tokens);
}

}  // namespace viaduct::ops
