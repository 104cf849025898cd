// Per-row cross-entropy that overwrites the logits (CUDA build).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/cross_entropy.h"

namespace viaduct::kernels {

namespace {

// A device fp32 scalar's pointer, checked; null for an undefined tensor.
const float* scalar_ptr(const at::Tensor& s, const at::Tensor& on, const char* what) {
  if (!s.defined()) return nullptr;
  VIADUCT_CHECK(s.numel() == 1 && s.scalar_type() == at::kFloat && s.device() == on.device(),
                what, ": must be one fp32 value on ", on.device(), ", got ", s.sizes(), " ",
                s.scalar_type(), " on ", s.device());
  return s.data_ptr<float>();
}

}  // namespace

at::Tensor cross_entropy_rows_(at::Tensor& logits, const at::Tensor& targets,
                               const at::Tensor& grad_scale) {
  RECORD_FUNCTION("viaduct::cross_entropy_rows", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(logits.dim() == 2 && logits.is_contiguous() && targets.dim() == 1 &&
                    targets.size(0) == logits.size(0),
                "fused cross_entropy: logits must be contiguous [n, V] and targets [n]");
  auto t = targets.to(logits.device(), at::kLong).contiguous();
  auto row_loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  check_launch(cuda::cross_entropy_forward_backward(
                   dtype_of(logits), logits.data_ptr(), t.data_ptr<int64_t>(),
                   row_loss.data_ptr<float>(), logits.size(0), logits.size(1), -100,
                   scalar_ptr(grad_scale, logits, "cross_entropy_rows_'s grad_scale"),
                   stream_of(logits)),
               "cross_entropy_forward_backward");
  return row_loss;
}

void scale_by_ratio_(at::Tensor& t, const at::Tensor& num, const at::Tensor& den) {
  RECORD_FUNCTION("viaduct::scale_by_ratio", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(t.is_contiguous() && (t.scalar_type() == at::kFloat ||
                                      t.scalar_type() == at::kBFloat16),
                "scale_by_ratio_: t must be contiguous fp32 or bf16, got ", t.scalar_type());
  VIADUCT_CHECK(num.defined(), "scale_by_ratio_: num must be given");
  check_launch(cuda::scale_by_ratio(dtype_of(t), t.data_ptr(), t.numel(),
                                    scalar_ptr(num, t, "scale_by_ratio_'s num"),
                                    scalar_ptr(den, t, "scale_by_ratio_'s den"), stream_of(t)),
               "scale_by_ratio");
}

}  // namespace viaduct::kernels
