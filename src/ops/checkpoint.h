// Activation checkpointing of a region (a transformer layer): the forward
// keeps only the region's inputs, the backward recomputes it with autograd
// on and differentiates the recomputed graph.
//
// Note [Activation checkpointing]
// ops::checkpoint(body, inputs, params) runs body(inputs) under no-grad and
// gives its outputs one autograd node (CheckpointBackward) whose next edges
// are the inputs' and the parameters' (the parameters the body reads from
// its module). The node saves the inputs alone. Its backward
//  - recomputes body(inputs') with grad on, inputs' = the inputs detached
//    (requires_grad as they had it), the parameters themselves;
//  - asks torch::autograd::grad of the recomputed outputs, with the grads
//    the node received, for exactly the edges the running graph task wants
//    (Node::task_should_compute_output): plain backward (GPipe, 1F1B,
//    interleaved) wants inputs and parameters at once; zero-bubble's I pass
//    (stage.cpp backward_input: grad(outs, stage inputs)) wants the inputs
//    only, and its W pass (backward(outs, inputs = params)) the parameters
//    and whichever inputs lead to this stage's earlier parameters.
//  - keeps the recomputed graph while a parameter gradient has not been
//    asked for yet (after I), so W differentiates the same graph without a
//    second recompute, and frees it once every parameter had its gradient
//    (or when the outer graph is released).
// Bits: the recompute runs the same ops on the same inputs and weights, so
// it produces the forward's bits (the bodies are RNG-free; MoE routing is a
// function of the inputs and the selection bias, which only the optimizer
// step changes). The inner graph has the structure of the graph without
// checkpointing, so every gradient is summed in the same order: AC on and
// off give the same losses, gradients and parameters bit for bit (tests/
// train/test_activation_checkpoint.cpp). State a forward mutates is
// touched once: the first (no-grad) forward counts as a training forward
// and the recompute does not (counts_training_statistics(), MoE loads).
// AttnRes slots (Note [AttnRes block gradients in place]) stay outside the
// body: the reads inside add into the same slots in the same layer order.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace viaduct::ops {

// activation_checkpoint.mode and .selective_ac_option (torchtitan's keys).
struct ActivationCheckpoint {
  enum class Mode { kNone, kFull, kSelective };
  Mode mode = Mode::kNone;
  int64_t every = 1;  // kSelective: every N-th layer

  // Whether the layer with this global id is checkpointed. Selective: layer
  // ids N-1, 2N-1, ... (torchtitan's count: the N-th, 2N-th, ... layer), by
  // global id so that no pipeline layout changes the choice.
  bool checkpoints(int64_t layer_id) const {
    if (mode == Mode::kFull) return true;
    if (mode == Mode::kSelective) return (layer_id + 1) % every == 0;
    return false;
  }
  bool any() const { return mode != Mode::kNone; }
};

// The region: inputs -> outputs, floating tensors that are not views of
// the inputs; it must compute the same bits every time it runs.
using CheckpointBody =
    std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

// body(inputs) with Note [Activation checkpointing]'s backward when grad
// mode is on and an input or a parameter requires grad; plain body(inputs)
// otherwise. `params`: every parameter the body reads.
std::vector<at::Tensor> checkpoint(const CheckpointBody& body,
                                   const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& params);

// Recomputes of checkpointed bodies so far in this process (tests: one
// per layer and micro-batch, also under the I/W split).
int64_t checkpoint_recomputes();
// True while a checkpointed body is recomputed in a backward (this thread).
bool checkpoint_recomputing();
// True for a forward whose statistics count toward training (MoE tokens
// per expert): grad mode on outside a recompute, or the no-grad first
// forward of a checkpointed body.
bool counts_training_statistics();

}  // namespace viaduct::ops
