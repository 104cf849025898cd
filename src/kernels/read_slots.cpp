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

namespace {

// See Note [Packed projection gradients in place] (kernels/fused.h).
class SplitPackedFn : public torch::autograd::Function<SplitPackedFn> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& packed,
                                                const std::vector<int64_t>& widths) {
    ctx->saved_data["widths"] = widths;
    ctx->saved_data["sizes"] = packed.sizes().vec();
    // Empty until the backward's first in-place writer (or the backward)
    // fills it.
    ctx->saved_data["grad"] = at::empty({0}, packed.options());
    // Which parts' columns a consumer has taken (a second consumer of the
    // same part gets a tensor of its own: autograd sums the two).
    ctx->saved_data["claimed"] = at::zeros({static_cast<int64_t>(widths.size())}, at::kByte);
    auto parts = packed.split_with_sizes(widths, -1);
    return {parts.begin(), parts.end()};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto widths = ctx->saved_data["widths"].toIntVector();
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    const auto slot = ctx->saved_data["grad"].toTensor();
    at::Tensor g = take_slot(slot);
    if (!g.defined()) g = at::empty(sizes, slot.options());
    ctx->saved_data["claimed"].toTensor().zero_();  // afresh for a rerun of the backward
    int64_t column = 0;
    for (size_t i = 0; i < widths.size(); ++i) {
      auto part = g.narrow(-1, column, widths[i]);
      column += widths[i];
      const auto& gi = grads[i];
      if (!gi.defined()) {
        part.zero_();
      } else if (gi.data_ptr() != part.data_ptr() || gi.sizes() != part.sizes() ||
                 gi.strides() != part.strides()) {
        part.copy_(gi);  // not written in place: copied in
      }
    }
    return {g, at::Tensor()};
  }
};

}  // namespace

std::vector<at::Tensor> split_packed(const at::Tensor& packed, const std::vector<int64_t>& widths) {
  return SplitPackedFn::apply(packed, widths);
}

PackedGradColumns packed_grad_columns(const at::Tensor& x) {
  using Node = torch::autograd::CppNode<SplitPackedFn>;
  const auto node = std::dynamic_pointer_cast<Node>(x.grad_fn());
  if (!node) return {};
  auto& data = node->ctx_.saved_data;
  const auto widths = data["widths"].toIntVector();
  PackedGradColumns c;
  c.slot = data["grad"].toTensor();
  c.claimed = data["claimed"].toTensor();
  c.sizes = data["sizes"].toIntVector();
  c.part = x.output_nr();
  for (int64_t i = 0; i < c.part; ++i) c.column += widths[static_cast<size_t>(i)];
  // The columns must be x's: the product's dtype and leading dims, the
  // part's width (else no columns: the consumer writes a tensor of its own).
  if (c.slot.scalar_type() != x.scalar_type() || c.sizes.size() != static_cast<size_t>(x.dim()) ||
      x.size(-1) != widths[static_cast<size_t>(c.part)]) {
    return {};
  }
  for (int64_t d = 0; d + 1 < x.dim(); ++d) {
    if (c.sizes[static_cast<size_t>(d)] != x.size(d)) return {};
  }
  return c;
}

at::Tensor packed_grad_view(const PackedGradColumns& c, int64_t width) {
  at::Tensor s = c.slot;  // the same TensorImpl as split_packed's
  uint8_t& claimed = c.claimed.data_ptr<uint8_t>()[c.part];
  if (claimed != 0) {
    auto own = c.sizes;
    own.back() = width;
    return at::empty(own, s.options());
  }
  claimed = 1;
  if (s.numel() == 0) s.set_(at::empty(c.sizes, s.options()));
  return s.narrow(-1, c.column, width);
}

void save_packed_grad_columns(torch::autograd::AutogradContext* ctx, const PackedGradColumns& c) {
  if (!c.slot.defined()) return;
  ctx->saved_data["packed_slot"] = c.slot;
  ctx->saved_data["packed_claimed"] = c.claimed;
  ctx->saved_data["packed_sizes"] = c.sizes;
  ctx->saved_data["packed_part"] = c.part;
  ctx->saved_data["packed_column"] = c.column;
}

PackedGradColumns saved_packed_grad_columns(torch::autograd::AutogradContext* ctx) {
  auto& data = ctx->saved_data;
  const auto slot = data.find("packed_slot");
  if (slot == data.end()) return {};
  return {slot->second.toTensor(), data["packed_claimed"].toTensor(),
          data["packed_sizes"].toIntVector(), data["packed_part"].toInt(),
          data["packed_column"].toInt()};
}

}  // namespace viaduct::kernels
