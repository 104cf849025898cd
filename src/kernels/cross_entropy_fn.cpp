// Per-row cross-entropy that overwrites the logits (CUDA build).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/cross_entropy.h"

namespace viaduct::kernels {

at::Tensor cross_entropy_rows_(at::Tensor& logits, const at::Tensor& targets) {
  RECORD_FUNCTION("viaduct::cross_entropy_rows", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(logits.dim() == 2 && logits.is_contiguous() && targets.dim() == 1 &&
                    targets.size(0) == logits.size(0),
                "fused cross_entropy: logits must be contiguous [n, V] and targets [n]");
  auto t = targets.to(logits.device(), at::kLong).contiguous();
  auto row_loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  check_launch(cuda::cross_entropy_forward_backward(
                   dtype_of(logits), logits.data_ptr(), t.data_ptr<int64_t>(),
                   row_loss.data_ptr<float>(), logits.size(0), logits.size(1), -100,
                   stream_of(logits)),
               "cross_entropy_forward_backward");
  return row_loss;
}

}  // namespace viaduct::kernels
