// Block AttnRes read (see Note [AttnRes stack] in attn_res.h).
#include "model/attn_res.h"

#include "core/check.h"
#include "ops/attn_res_read.h"

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

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A sink's gradient: its slot's sum plus what reached it through autograd
// (either may be missing), the slot emptied for a rerun of the backward.
at::Tensor take_slot_sum(const at::Tensor& slot, const at::Tensor& grad) {
  at::Tensor g = ops::take_slot(slot);
  if (grad.defined()) g = g.defined() ? g + grad : grad;
  return g;
}

class BlockSinkFn : public torch::autograd::Function<BlockSinkFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& block,
                            const at::Tensor* slot) {
    // Undefined stays undefined (no zeros to add) where every reader of the
    // block has a slot.
    ctx->set_materialize_grads(false);
    ctx->saved_data["slot"] = *slot;
    return block;  // returned as a view with this node as its gradient edge
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {take_slot_sum(ctx->saved_data["slot"].toTensor(), grads[0]), at::Tensor()};
  }
};

// See Note [AttnRes partial sums in place].
class PartialAddFn : public torch::autograd::Function<PartialAddFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& partial,
                            const at::Tensor& x, const at::Tensor* partial_slot,
                            const at::Tensor* out_slot) {
    ctx->set_materialize_grads(false);  // p' may reach the backward only through its slot
    ctx->saved_data["partial_slot"] = *partial_slot;
    ctx->saved_data["out_slot"] = *out_slot;
    return partial + x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto g = take_slot_sum(ctx->saved_data["out_slot"].toTensor(), grads[0]);
    if (!g.defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    // partial's gradient starts its slot's sum (its read adds into it later,
    // out of place: x's gradient is the same storage).
    ops::attn_res_slot_add(ctx->saved_data["partial_slot"].toTensor(), g);
    return {at::Tensor(), g, at::Tensor(), at::Tensor()};
  }
};

class SeedFn : public torch::autograd::Function<SeedFn> {
 public:
  static variable_list forward(AutogradContext* ctx, at::TensorList outputs,
                               const std::vector<at::Tensor>* slots) {
    ops::save_read_slots(ctx, slots);
    return variable_list(outputs.begin(), outputs.end());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out;
    for (size_t i = 0; i < grads.size(); ++i) {
      auto slot = ops::saved_read_slot(ctx, i);
      if (!slot.defined()) {
        out.push_back(grads[i]);
        continue;
      }
      if (grads[i].defined()) {
        VIADUCT_ASSERT(slot.numel() == 0, "AttnRes seed: output ", i,
                       "'s slot already holds a gradient");
        // A copy: the slot is added into in place, and the executor keeps
        // the received gradient (zero-bubble's W pass seeds again from it).
        slot.set_(grads[i].clone(at::MemoryFormat::Contiguous));
      }
      out.emplace_back();
    }
    out.emplace_back();  // slots
    return out;
  }
};

}  // namespace

at::Tensor attn_res_new_slot(const at::Tensor& like) { return at::empty({0}, like.options()); }

at::Tensor attn_res_block_sink(const at::Tensor& block, const at::Tensor& slot) {
  return BlockSinkFn::apply(block, &slot);
}

at::Tensor attn_res_partial_add(const at::Tensor& partial, const at::Tensor& partial_slot,
                                const at::Tensor& x, const at::Tensor& out_slot) {
  VIADUCT_ASSERT(partial_slot.defined() && out_slot.defined(),
                 "attn_res_partial_add: both slots must be defined");
  return PartialAddFn::apply(partial, x, &partial_slot, &out_slot);
}

std::vector<at::Tensor> attn_res_seed(const std::vector<at::Tensor>& outputs,
                                      const std::vector<at::Tensor>& slots) {
  VIADUCT_ASSERT(outputs.size() == slots.size(), "attn_res_seed: ", outputs.size(),
                 " outputs, ", slots.size(), " slots");
  return SeedFn::apply(at::TensorList(outputs), &slots);
}

at::Tensor AttnResReadImpl::weights(const std::vector<at::Tensor>& sources) {
  VIADUCT_ASSERT(!sources.empty(), "an AttnRes read needs at least one source");
  return ops::attn_res_read_weights(sources, query, norm->weight, norm->eps_);  // [N, B, T]
}

at::Tensor AttnResReadImpl::forward(const std::vector<at::Tensor>& sources,
                                    const std::vector<at::Tensor>* slots) {
  VIADUCT_ASSERT(!sources.empty(), "an AttnRes read needs at least one source");
  VIADUCT_ASSERT(slots == nullptr || slots->size() == sources.size(), "an AttnRes read got ",
                 sources.size(), " sources and ", slots ? slots->size() : 0, " slots");
  return ops::attn_res_read(sources, query, norm->weight, norm->eps_, slots, kernel_options_);
}

at::Tensor AttnResReadImpl::forward_normed(const std::vector<at::Tensor>& sources,
                                           const std::vector<at::Tensor>* slots,
                                           RMSNormImpl& next) {
  VIADUCT_ASSERT(!sources.empty(), "an AttnRes read needs at least one source");
  VIADUCT_ASSERT(slots == nullptr || slots->size() == sources.size(), "an AttnRes read got ",
                 sources.size(), " sources and ", slots ? slots->size() : 0, " slots");
  return ops::attn_res_read_norm(sources, query, norm->weight, norm->eps_, slots, next.weight,
                                 next.eps_, kernel_options_);
}

}  // namespace viaduct
