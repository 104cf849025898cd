#include "pipeline/runtime/stage.h"

#include "core/check.h"

namespace viaduct::pipeline {

PipelineStage::PipelineStage(int64_t stage_id, int64_t num_stages,
                             std::shared_ptr<ModelPart> part)
    : stage_id_(stage_id), num_stages_(num_stages), part_(std::move(part)) {
  for (const auto& p : part_->parameters()) params_.push_back(p);
}

PipelineStage::MicrobatchState& PipelineStage::state(int64_t mb,
                                                     const char* action) {
  auto it = state_.find(mb);
  VIADUCT_CHECK(it != state_.end(), "stage ", stage_id_, " micro-batch ", mb,
                " ", action, ": no forward state (the schedule runs ", action,
                " before F or twice)");
  return it->second;
}

Activations PipelineStage::forward(int64_t mb, const Activations& inputs,
                                   const at::Tensor& targets,
                                   double loss_scale) {
  VIADUCT_CHECK(!state_.count(mb), "stage ", stage_id_, " micro-batch ", mb,
                " F: forward ran twice");
  MicrobatchState st;
  if (is_first()) {
    st.inputs = inputs;
  } else {
    for (const auto& t : inputs) {
      auto leaf = t.detach();
      if (leaf.is_floating_point()) leaf.requires_grad_(true);
      st.inputs.push_back(leaf);
    }
  }
  Activations outputs;
  if (is_last()) {
    VIADUCT_CHECK(targets.defined(), "stage ", stage_id_, " micro-batch ", mb,
                  " F: the last stage needs targets");
    auto sum = part_->forward_loss(st.inputs, targets);
    loss_sums_[mb] = sum.detach();
    st.loss = sum * loss_scale;
  } else {
    outputs = part_->forward(st.inputs);
    st.outputs = outputs;
  }
  state_.emplace(mb, std::move(st));
  return outputs;
}

std::vector<at::Tensor> PipelineStage::differentiable(const Activations& ts) const {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) {
    if (t.defined() && t.requires_grad()) out.push_back(t);
  }
  return out;
}

template <typename Fn>
void PipelineStage::accumulate(int64_t mb, Fn&& fn) {
  if (!deferred_) {
    fn();
    return;
  }
  std::vector<at::Tensor> saved;
  for (auto& p : params_) {
    saved.push_back(p.grad());
    p.mutable_grad() = at::Tensor();
  }
  fn();
  std::vector<at::Tensor> mine;
  for (size_t i = 0; i < params_.size(); ++i) {
    mine.push_back(params_[i].grad());
    params_[i].mutable_grad() = saved[i];
  }
  deferred_grads_[mb] = std::move(mine);
}

void PipelineStage::flush_deferred_grads() {
  torch::NoGradGuard no_grad;
  for (auto& [mb, grads] : deferred_grads_) {  // ascending micro-batches
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!grads[i].defined()) continue;
      auto& g = params_[i].mutable_grad();
      if (!g.defined()) {
        g = grads[i];  // as AccumulateGrad takes the first gradient
      } else {
        g.add_(grads[i]);
      }
    }
  }
  deferred_grads_.clear();
}

Activations PipelineStage::backward(int64_t mb, const Activations& grad_outputs) {
  auto& st = state(mb, "B");
  if (is_last()) {
    accumulate(mb, [&] { st.loss.backward(); });
  } else {
    VIADUCT_CHECK(grad_outputs.size() == st.outputs.size(), "stage ", stage_id_,
                  " micro-batch ", mb, " B: got ", grad_outputs.size(),
                  " output gradients for ", st.outputs.size(), " outputs");
    std::vector<at::Tensor> outs, grads;
    for (size_t i = 0; i < st.outputs.size(); ++i) {
      if (st.outputs[i].requires_grad() && grad_outputs[i].defined()) {
        outs.push_back(st.outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    accumulate(mb, [&] { torch::autograd::backward(outs, grads); });
  }
  Activations grads_in;
  if (!is_first()) {
    for (const auto& leaf : st.inputs) {
      grads_in.push_back(leaf.requires_grad() ? leaf.grad() : at::Tensor());
    }
  }
  state_.erase(mb);
  return grads_in;
}

Activations PipelineStage::backward_input(int64_t mb,
                                          const Activations& grad_outputs) {
  auto& st = state(mb, "I");
  st.grad_outputs = grad_outputs;
  st.input_done = true;
  if (is_first()) return {};
  std::vector<at::Tensor> outs, grads;
  if (is_last()) {
    outs = {st.loss};
  } else {
    for (size_t i = 0; i < st.outputs.size(); ++i) {
      if (st.outputs[i].requires_grad() && grad_outputs.at(i).defined()) {
        outs.push_back(st.outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
  }
  auto leaves = differentiable(st.inputs);
  auto g = torch::autograd::grad(outs, leaves, grads, /*retain_graph=*/true,
                                 /*create_graph=*/false, /*allow_unused=*/true);
  Activations grads_in;
  size_t k = 0;
  for (const auto& leaf : st.inputs) {
    grads_in.push_back(leaf.requires_grad() ? g[k++] : at::Tensor());
  }
  return grads_in;
}

void PipelineStage::backward_weight(int64_t mb) {
  auto& st = state(mb, "W");
  VIADUCT_CHECK(st.input_done, "stage ", stage_id_, " micro-batch ", mb,
                " W: runs before its I");
  std::vector<at::Tensor> outs, grads;
  if (is_last()) {
    outs = {st.loss};
  } else {
    for (size_t i = 0; i < st.outputs.size(); ++i) {
      if (st.outputs[i].requires_grad() && st.grad_outputs.at(i).defined()) {
        outs.push_back(st.outputs[i]);
        grads.push_back(st.grad_outputs[i]);
      }
    }
  }
  std::vector<at::Tensor> wanted;
  for (const auto& p : params_) {
    if (p.requires_grad()) wanted.push_back(p);
  }
  if (!outs.empty()) {
    accumulate(mb, [&] {
      torch::autograd::backward(outs, grads, /*retain_graph=*/false,
                                /*create_graph=*/false, wanted);
    });
  }
  state_.erase(mb);
}

at::Tensor PipelineStage::loss_sum(int64_t mb) const {
  auto it = loss_sums_.find(mb);
  VIADUCT_CHECK(it != loss_sums_.end(), "stage ", stage_id_,
                " has no loss for micro-batch ", mb);
  return it->second;
}

Activations PipelineStage::forward_no_grad(const Activations& inputs,
                                           const at::Tensor& targets) {
  torch::NoGradGuard no_grad;
  if (is_last() && targets.defined()) return {part_->forward_loss(inputs, targets)};
  return part_->forward(inputs);
}

void PipelineStage::clear() {
  state_.clear();
  loss_sums_.clear();
  deferred_grads_.clear();
}

}  // namespace viaduct::pipeline
