// One pipeline stage: a model part (the split's modules, FQNs unchanged)
// that runs forward and backward for one micro-batch at a time and keeps the
// per-micro-batch autograd state in between.
//
// Note [Stage backward forms]
// B runs the whole backward of a micro-batch: input gradients for the
// previous stage and weight gradients accumulated into .grad. The zero-bubble
// schedules split it: I computes only the input gradients
// (autograd::grad with retain_graph) and W later accumulates the weight
// gradients (autograd::backward restricted to the parameters). Gradients
// meet .grad in the order the schedule runs each stage's B or W, which every
// supported schedule keeps in micro-batch order -- the order of the single
// process -- so the bits agree.
#pragma once

#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/model.h"

namespace viaduct::pipeline {

// A tensor that crosses a stage boundary (see Note [Boundary metadata] in
// executor.h).
struct TensorMeta {
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
};

class PipelineStage {
 public:
  PipelineStage(int64_t stage_id, int64_t num_stages,
                std::shared_ptr<ModelPart> part);
  // Subclasses (pipeline/attn_res) change what crosses a hop; the executor
  // calls the forms below through this base.
  virtual ~PipelineStage() = default;

  int64_t stage_id() const { return stage_id_; }
  bool is_first() const { return stage_id_ == 0; }
  bool is_last() const { return stage_id_ == num_stages_ - 1; }
  ModelPart& part() { return *part_; }
  const std::shared_ptr<ModelPart>& part_ptr() const { return part_; }

  // Forward of micro-batch `mb`. `inputs`: {tokens} on the first stage, the
  // previous stage's outputs otherwise (made leaves that require grad here).
  // The last stage needs `targets` and `loss_scale` (1 / the step's global
  // token count) and returns no outputs; its summed loss is kept.
  virtual Activations forward(int64_t mb, const Activations& inputs,
                              const at::Tensor& targets = {},
                              double loss_scale = 1.0);
  // Backward (B) of `mb`: `grad_outputs` match forward's outputs (empty on
  // the last stage). Returns the gradients of the inputs (empty on the first
  // stage). Releases the micro-batch's state.
  virtual Activations backward(int64_t mb, const Activations& grad_outputs);
  // Input-gradient half (I): returns input gradients, keeps the graph.
  virtual Activations backward_input(int64_t mb,
                                     const Activations& grad_outputs);
  // Weight-gradient half (W) of an earlier I; releases the state.
  virtual void backward_weight(int64_t mb);

  // The tensors the backward sends back over the hop s -> s + 1 (this stage
  // is s or s + 1), given `forward`, those the forward sends over it: one
  // gradient per forward tensor unless a subclass routes more (see Note [AttnRes
  // cache backward] in pipeline/attn_res/block_layout.h). Both sides of the
  // hop must answer alike.
  virtual std::vector<TensorMeta> hop_grad_metas(int64_t s,
                                                 const std::vector<TensorMeta>& forward) const {
    return forward;
  }

  // The summed (unscaled) token cross-entropy of `mb` on the last stage: a
  // detached scalar on the device, not read here (reading it would wait for
  // the device between the forward and the backward).
  at::Tensor loss_sum(int64_t mb) const;
  // Forward without autograd state (eval, metadata inference); the last
  // stage returns {summed loss} when targets are given, else its logits.
  virtual Activations forward_no_grad(const Activations& inputs,
                                      const at::Tensor& targets = {});

  // Note [Deferred gradient accumulation]
  // A schedule that runs a stage's weight gradients out of micro-batch order
  // (LoopedBFS runs them in reverse) would add them to .grad in another order
  // than the single process and change the last bits. In deferred mode each
  // micro-batch's weight gradients are kept apart and flush_deferred_grads()
  // adds them to .grad in micro-batch order -- the single process's sums.
  void set_deferred_grads(bool on) { deferred_ = on; }
  bool deferred_grads() const { return deferred_; }
  void flush_deferred_grads();

  // Micro-batches whose state is still held (a leak check at step end).
  size_t live_microbatches() const { return state_.size(); }
  // Step start: drops every micro-batch's state.
  virtual void clear();
  // Step end (and after eval / metadata inference): throws when the stage
  // still holds something it should have released; `what` names the phase.
  virtual void check_step_end(const std::string& what) {}

 private:
  struct MicrobatchState {
    Activations inputs;   // leaves (non-first stages)
    Activations outputs;  // what backward starts from
    at::Tensor loss;      // last stage: scaled loss
    Activations grad_outputs;  // kept between I and W
    bool input_done = false;
  };
  MicrobatchState& state(int64_t mb, const char* action);
  std::vector<at::Tensor> differentiable(const Activations& ts) const;
  // Runs `fn` (a backward) so that the weight gradients it produces land in
  // deferred_[mb] instead of .grad (deferred mode only).
  template <typename Fn>
  void accumulate(int64_t mb, Fn&& fn);

  int64_t stage_id_;
  int64_t num_stages_;
  std::shared_ptr<ModelPart> part_;
  std::vector<at::Tensor> params_;
  std::map<int64_t, MicrobatchState> state_;
  std::map<int64_t, at::Tensor> loss_sums_;
  bool deferred_ = false;
  std::map<int64_t, std::vector<at::Tensor>> deferred_grads_;
};

}  // namespace viaduct::pipeline
