// AttnResStage (see Note [AttnRes stage] in attn_res_stage.h).
#include "pipeline/attn_res/attn_res_stage.h"

#include "core/check.h"

namespace viaduct::pipeline {

AttnResStage::AttnResStage(int64_t stage_id, int64_t num_stages,
                           std::shared_ptr<ModelPart> part,
                           std::shared_ptr<const BlockLayoutTables> tables,
                           std::shared_ptr<RankBlockStore> store)
    : PipelineStage(stage_id, num_stages, std::move(part)),
      tables_(std::move(tables)),
      store_(std::move(store)) {
  VIADUCT_CHECK(tables_ && store_, "AttnRes stage ", stage_id, " needs tables and a store");
  VIADUCT_CHECK(static_cast<int64_t>(tables_->stages.size()) == num_stages,
                "AttnRes stage ", stage_id, ": the layout tables have ",
                tables_->stages.size(), " stages, the pipeline ", num_stages);
  VIADUCT_CHECK(layout().rank == store_->rank(), "AttnRes stage ", stage_id,
                " runs on rank ", layout().rank, " but got rank ", store_->rank(),
                "'s store");
}

Activations AttnResStage::assemble(int64_t mb, const Activations& payload) {
  const auto& l = layout();
  if (is_first()) return payload;  // {tokens[, images]}
  VIADUCT_CHECK(static_cast<int64_t>(payload.size()) == l.hop_tensors(), "AttnRes stage ",
                stage_id(), " micro-batch ", mb, ": received ", payload.size(),
                " tensors, the ", transport_name(tables_->transport),
                " tables expect hidden + ", l.received.size(), " blocks");
  Activations full(static_cast<size_t>(1 + l.entries_in));
  full[0] = payload[0];
  const auto device = payload[0].device();
  for (int64_t n : l.read) full[static_cast<size_t>(1 + n)] = store_->get(stage_id(), mb, n, device);
  for (size_t i = 0; i < l.received.size(); ++i) {
    full[static_cast<size_t>(1 + l.received[i])] = payload[1 + i];
  }
  return full;
}

Activations AttnResStage::hand_on(int64_t mb, const Activations& payload,
                                  const Activations& full_out) {
  const auto& l = layout();
  size_t k = 0;
  for (int64_t n : l.stored) {
    // Received entries are stored as they arrived, committed ones from the
    // part's output stack.
    while (k < l.received.size() && l.received[k] < n) ++k;
    const bool received = k < l.received.size() && l.received[k] == n;
    store_->put(stage_id(), mb, n,
                received ? payload.at(1 + k) : full_out.at(static_cast<size_t>(1 + n)));
  }
  if (l.releases) store_->release(mb);
  if (is_last()) return full_out;
  const auto& next = tables_->stage(stage_id() + 1);
  VIADUCT_CHECK(static_cast<int64_t>(full_out.size()) == 1 + l.entries_out, "AttnRes stage ",
                stage_id(), " micro-batch ", mb, ": the part returned ", full_out.size(),
                " tensors, the tables expect hidden + ", l.entries_out, " blocks");
  Activations out{full_out[0]};
  for (int64_t n : next.received) out.push_back(full_out[static_cast<size_t>(1 + n)]);
  return out;
}

Activations AttnResStage::forward(int64_t mb, const Activations& inputs,
                                  const at::Tensor& targets, double loss_scale) {
  auto full = PipelineStage::forward(mb, assemble(mb, inputs), targets, loss_scale);
  if (is_last()) {
    hand_on(mb, inputs, {});
    return full;  // empty: the loss stays with the stage
  }
  return hand_on(mb, inputs, full);
}

Activations AttnResStage::forward_no_grad(const Activations& inputs,
                                          const at::Tensor& targets) {
  auto full = PipelineStage::forward_no_grad(assemble(kNoGradMicrobatch, inputs), targets);
  if (is_last()) {
    hand_on(kNoGradMicrobatch, inputs, {});
    return full;
  }
  return hand_on(kNoGradMicrobatch, inputs, full);
}

Activations AttnResStage::expand_grads(int64_t mb, const Activations& grad_payload) {
  const auto& l = layout();
  if (is_last()) return grad_payload;
  const auto& next = tables_->stage(stage_id() + 1);
  VIADUCT_CHECK(static_cast<int64_t>(grad_payload.size()) == next.grad_hop_tensors(),
                "AttnRes stage ", stage_id(), " micro-batch ", mb, ": got ",
                grad_payload.size(), " output gradients, the ", transport_name(tables_->transport),
                " tables (backward: ", cache_backward_name(tables_->backward),
                ") send back ", next.grad_hop_tensors(), " tensors");
  Activations full(static_cast<size_t>(1 + l.entries_out));
  full[0] = grad_payload[0];
  for (size_t i = 0; i < next.returned.size(); ++i) {
    full[static_cast<size_t>(1 + next.returned[i])] = grad_payload[1 + i];
  }
  for (int64_t n : l.collected) {
    auto g = store_->collect(stage_id(), mb, n);
    auto& slot = full[static_cast<size_t>(1 + n)];
    slot = slot.defined() ? slot + g : g;
  }
  return full;
}

Activations AttnResStage::route_input_grads(int64_t mb, const Activations& grads_full) {
  const auto& l = layout();
  if (is_first()) return grads_full;
  for (int64_t n : l.deposited) {
    auto g = grads_full.at(static_cast<size_t>(1 + n));
    if (!g.defined()) {
      // No reader on this stage used the entry: its contribution is zero,
      // and the owner still expects the deposit.
      g = at::zeros_like(grads_full.at(0));
    }
    store_->deposit(stage_id(), mb, n, g);
  }
  Activations out{grads_full.at(0)};
  for (int64_t n : l.returned) out.push_back(grads_full.at(static_cast<size_t>(1 + n)));
  return out;
}

std::vector<TensorMeta> AttnResStage::hop_grad_metas(
    int64_t s, const std::vector<TensorMeta>& forward) const {
  VIADUCT_CHECK(!forward.empty(), "AttnRes stage ", stage_id(), ": no tensors cross the hop ",
                s, " -> ", s + 1);
  const auto n = static_cast<size_t>(tables_->grad_hop_tensors(s));
  if (n == forward.size()) return forward;  // deposit or whole stack: one per tensor
  return std::vector<TensorMeta>(n, forward[0]);
}

Activations AttnResStage::backward(int64_t mb, const Activations& grad_outputs) {
  auto full = expand_grads(mb, grad_outputs);
  return route_input_grads(mb, PipelineStage::backward(mb, full));
}

Activations AttnResStage::backward_input(int64_t mb, const Activations& grad_outputs) {
  auto full = expand_grads(mb, grad_outputs);
  return route_input_grads(mb, PipelineStage::backward_input(mb, full));
}

void AttnResStage::clear() {
  PipelineStage::clear();
  store_->clear();
  store_->reset_peak();
}

void AttnResStage::check_step_end(const std::string& what) {
  store_->sweep(str(what, " (stage ", stage_id(), ")"));
}

std::unique_ptr<PipelineStage> make_stage(int64_t stage_id, int64_t num_stages,
                                          std::shared_ptr<ModelPart> part,
                                          std::shared_ptr<const BlockLayoutTables> tables,
                                          std::shared_ptr<RankBlockStore> store) {
  if (!tables) return std::make_unique<PipelineStage>(stage_id, num_stages, std::move(part));
  return std::make_unique<AttnResStage>(stage_id, num_stages, std::move(part),
                                        std::move(tables), std::move(store));
}

}  // namespace viaduct::pipeline
