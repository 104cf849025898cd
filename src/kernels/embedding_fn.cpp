// The embedding table's gradient (CUDA build).
#include "kernels/fused.h"

#include "kernels/embedding.h"
#include "kernels/fn_common.h"

namespace viaduct::kernels {

at::Tensor embedding_weight_grad(const at::Tensor& grad, const at::Tensor& tokens,
                                 int64_t vocab) {
  RECORD_FUNCTION("viaduct::embedding_backward", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(grad.is_cuda() && grad.scalar_type() == at::kFloat && grad.dim() >= 1,
                "fused embedding backward: the gradient must be fp32 on a CUDA device");
  const int64_t d = grad.size(-1);
  auto g = grad.reshape({-1, d}).contiguous();
  auto flat = tokens.reshape({-1}).to(g.device(), at::kLong).contiguous();
  VIADUCT_CHECK(flat.size(0) == g.size(0), "fused embedding backward: ", flat.size(0),
                " tokens for ", g.size(0), " gradient rows");
  // A stable sort keeps each token's rows in increasing order: the kernel
  // adds them in that order.
  auto [sorted, order] = at::sort(flat, /*stable=*/true, 0, /*descending=*/false);
  auto dw = at::zeros({vocab, d}, g.options());
  check_launch(cuda::embedding_backward(sorted.data_ptr<int64_t>(), order.data_ptr<int64_t>(),
                                        g.data_ptr<float>(), dw.data_ptr<float>(), flat.size(0),
                                        d, vocab, stream_of(g)),
               "embedding_backward");
  return dw;
}

}  // namespace viaduct::kernels
