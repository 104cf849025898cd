// ops::recompute: activation checkpointing of a region (a transformer layer): the forward
// keeps only the region's inputs, the backward recomputes it with autograd
// on and differentiates the recomputed graph.
//
// Note [Activation checkpointing]
// ops::recompute(body, inputs, params) runs body(inputs) under no-grad and
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
// off give the same losses, gradients and parameters bit for bit
// (tests/ops/test_recompute.cpp). State a forward mutates is
// touched once: the first (no-grad) forward counts as a training forward
// and the recompute does not (counts_training_statistics(), MoE loads).
// AttnRes slots (see Note [AttnRes block gradients in place]) stay outside the
// body: the reads inside add into the same slots in the same layer order.
//
// Note [Per-op activation checkpointing]
// Selective_ac_option = "op" (torchtitan's per-op policy) checkpoints every
// layer, but its recompute skips the expensive ops: the first forward keeps
// their outputs, the recompute takes them back instead of running them and
// reruns only the cheap ops around them (norms, activations, rope, residual
// adds). The mechanism is a per-body list of saved outputs (SavedOps) that
// the expensive ops consult through run_saved_op():
//  - record (the first, no-grad forward of a checkpointed body): each op
//    runs and its outputs are appended, in call order;
//  - replay (the recompute): each op takes the next outputs instead of
//    running, in the same order (the body runs the same ops on the same
//    values, so the sequence is the same; the count of ops, and that no
//    saved output was written in place after its op, are checked);
//  - elsewhere the op runs as usual.
// The forward so keeps the body's inputs plus the saved outputs; the
// norms' and activations' values are recomputed.
// The expensive ops are autograd functions whose forward calls
// run_saved_op() and whose backward is the op's one backward, with or
// without checkpointing: in replay the function still records its node,
// saving its inputs (recomputed, same bits) and the weights, so the
// gradients come out of the same ATen calls as without checkpointing, bit
// for bit. Cached: the linear projections (ops::linear / linear_parts:
// the ATen form is an autograd function of its own for this, the
// mixed-precision form was one already; ops/linear.cpp), the grouped MoE
// expert GEMMs (ops/moe.cpp; the per-expert loop of the ATen form goes
// through ops::linear), KDA's chunk scan with the states its backward
// reads (ops/kda.cpp), and causal attention's core where one of
// LibTorch's fused attention kernels runs (LibTorch 2.8+, CUDA, bf16 /
// fp16: CausalFusedAttentionFn in ops/rope.cpp calls the forward and
// backward ops of the kernel SDPA would pick, flash's or cuDNN's, so it
// keeps the output and log-sum-exp). Recomputed although expensive:
//  - attention elsewhere (1.13's composite math on the CPU, fp32, MLA's
//    core with its wider q/k heads): its backward is ATen's own autograd
//    formula over statistics the forward does not return, so a cached
//    output could only feed a second formula of ours, without ATen's bits;
//  - the fused functions of kernels/ (SwiGLU with w2, the KDA kernel):
//    kernels/ sits below ops/ and does not consult the list.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace viaduct::ops {

// activation_checkpoint.mode and .selective_ac_option (torchtitan's keys).
struct ActivationCheckpoint {
  // kOp: selective_ac_option = "op" (see Note [Per-op activation checkpointing]).
  enum class Mode { kNone, kFull, kSelective, kOp };
  Mode mode = Mode::kNone;
  int64_t every = 1;  // kSelective: every N-th layer

  // Whether the layer with this global id is checkpointed. Selective: layer
  // ids N-1, 2N-1, ... (torchtitan's count: the N-th, 2N-th, ... layer), by
  // global id so that no pipeline layout changes the choice.
  bool checkpoints(int64_t layer_id) const {
    if (mode == Mode::kFull || mode == Mode::kOp) return true;
    if (mode == Mode::kSelective) return (layer_id + 1) % every == 0;
    return false;
  }
  bool any() const { return mode != Mode::kNone; }
};

// The region: inputs -> outputs, floating tensors that are not views of
// the inputs; it must compute the same bits every time it runs.
using CheckpointBody =
    std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

// body(inputs) with see Note [Activation checkpointing]'s backward when grad
// mode is on and an input or a parameter requires grad; plain body(inputs)
// otherwise. `params`: every parameter the body reads. `keep_op_outputs`:
// See Note [Per-op activation checkpointing].
std::vector<at::Tensor> recompute(const CheckpointBody& body,
                                   const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& params,
                                   bool keep_op_outputs = false);
// The checkpoint of a layer under `ac` (whether it checkpoints this layer is
// the caller's question): keep_op_outputs for Mode::kOp.
inline std::vector<at::Tensor> recompute(const ActivationCheckpoint& ac,
                                          const CheckpointBody& body,
                                          const std::vector<at::Tensor>& inputs,
                                          const std::vector<at::Tensor>& params) {
  return recompute(body, inputs, params, ac.mode == ActivationCheckpoint::Mode::kOp);
}

// An expensive op's outputs under see Note [Per-op activation checkpointing]:
// compute() when no checkpointed body records or replays on this thread;
// compute() appended to the body's list while it records; the next saved
// outputs (and no compute) while it replays. Called from an autograd
// function's forward, so the function's node is recorded either way.
at::Tensor run_saved_op(const std::function<at::Tensor()>& compute);
// The same for an op with several outputs.
std::vector<at::Tensor> run_saved_op_outputs(
    const std::function<std::vector<at::Tensor>()>& compute);

// Recomputes of checkpointed bodies so far in this process (tests: one
// per layer and micro-batch, also under the I/W split).
int64_t recomputes();
// Expensive ops (run_saved_op) that computed, in this process, and those a
// replay answered from saved outputs instead (tests: "op" computes each
// once, "full" twice).
int64_t saved_op_computes();
int64_t saved_op_replays();
// True while a checkpointed body is recomputed in a backward (this thread).
bool recomputing();
// True for a forward whose statistics count toward training (MoE tokens
// per expert): grad mode on outside a recompute, or the no-grad first
// forward of a checkpointed body.
bool counts_training_statistics();

}  // namespace viaduct::ops
