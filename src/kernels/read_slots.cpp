// The slots of the AttnRes read's gradients in place (see Note [AttnRes block
// gradients in place], model/attn_res.h): shared by the ATen read
// (ops/attn_res_read.cpp) and the kernel's (kernels/attn_res_read_fn.cpp),
// so both builds compile it.
#include "kernels/fused.h"

#include <string>

namespace viaduct::kernels {

void attn_res_slot_add(const at::Tensor& slot, const at::Tensor& grad) {
  at::Tensor s = slot;  // the same TensorImpl as every holder of the slot
  // Out of place: the slot's storage may be a gradient autograd also handed
  // to another input (see attn_res_partial_add), which an in-place add
  // would change under its other holders.
  s.set_(s.numel() == 0 ? grad : s + grad);
}

at::Tensor take_slot(const at::Tensor& slot) {
  at::Tensor s = slot;  // the same TensorImpl as every holder of the slot
  if (s.numel() == 0) return {};
  auto sum = s.detach();  // a new TensorImpl on the sum's storage
  s.set_();               // empty again, for a rerun of the backward
  return sum;
}

void save_read_slots(torch::autograd::AutogradContext* ctx,
                     const std::vector<at::Tensor>* slots) {
  if (slots == nullptr) return;
  for (size_t i = 0; i < slots->size(); ++i) {
    if ((*slots)[i].defined()) ctx->saved_data["slot" + std::to_string(i)] = (*slots)[i];
  }
}

at::Tensor saved_read_slot(torch::autograd::AutogradContext* ctx, size_t i) {
  auto it = ctx->saved_data.find("slot" + std::to_string(i));
  return it == ctx->saved_data.end() ? at::Tensor() : it->second.toTensor();
}

}  // namespace viaduct::kernels
