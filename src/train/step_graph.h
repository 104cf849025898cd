// The training step replayed as one CUDA graph (training.cuda_graphs).
//
// Note [The step as one CUDA graph]
// A step queues thousands of kernels (the K3 cell ~7,000); the host's cost
// of launching them shows as device idle wherever the host falls behind.
// With the step graph (training.cuda_graphs unset where the run allows it,
// or true) a one-process run on one GPU records the step's device work
// once and then queues it as one graph launch:
//  - The first kWarmupSteps steps run eagerly, on the graph's own stream:
//    they make what a first step makes lazily (cuBLAS workspaces, the
//    weight cache's copies, the MoE counters on the device), so the
//    capture records steady-state work only.
//  - The next step is captured: every micro-batch's forward and backward
//    and the device half of the gradient clip (its norm, its coefficient
//    and the losses beside it: OptimizerStep::device_clip). The inputs are
//    static device tensors, one pair per micro-batch, which the host
//    refills before each replay (an asynchronous copy from pinned memory,
//    outside the graph), and the loss scale (1 / the step's target
//    tokens) is a device scalar refilled the same way: loss * scale on a
//    fp32 device scalar rounds as loss * the double does, since ATen
//    computes both in fp32.
//  - What the capture allocated keeps its address in the graph's memory
//    pool and each replay rewrites it: the clip's outputs, and every
//    parameter's gradient. So the gradients are never released between
//    graph steps (zero_grad would drop the only handle on them): the first
//    micro-batch's backward writes them, later ones add, as in an eager
//    step that starts from none.
//  - After each replay, eagerly: the optimizer update (AdamW's one launch
//    over every tensor, queued long before the device reaches it, and the
//    weight cache's host bookkeeping as in any step), the MoE
//    load-balancing update and the readback of the norm and the losses.
//  - Replays run the kernels an eager step runs, on the same values, so a
//    run has the same bits with the key on or off
//    (test StepGraph.SameBitsAsEagerSteps on a GPU).
//  - The graph holds the addresses the capture saw: the static inputs, the
//    gradients, and the weight cache's bf16 copies, which AdamW rewrites in
//    place after each replay. A one-process run never regroups the cache's
//    copies (a pipeline's or a changed layout's would), so they stay put.
//  - Memory: the graph's pool keeps one step's activations reserved between
//    replays; an eval's forward or a checkpoint's copies allocate beside
//    it, so the peak is the step's plus the eval's, where an eager run
//    reuses the step's blocks for the eval.
//  - Where the graph cannot run, an unset key gives eager steps (decided at
//    setup, or from what the warm-up steps saw: images in the data,
//    gradients the device clip cannot take), and true is refused (a
//    ConfigError at load or at setup; those two, at the capture): a CPU
//    device, pipeline
//    stages (the executor's sends and receives wait on the host), data
//    parallelism, block_causal documents (each step's sizes follow its
//    documents), images, and an update that cannot run on the device
//    (SGD, or AdamW off viaduct's kernel). A batch whose shapes differ
//    from the captured ones is an error naming both.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

#include "core/cuda_graph.h"
#include "data/sampler.h"
#include "ops/clip.h"

namespace viaduct {

class StepGraph {
 public:
  static constexpr int64_t kWarmupSteps = 2;

  explicit StepGraph(const at::Device& device);

  // The step's work on the graph's stream (see DeviceGraph::stream_scope).
  [[nodiscard]] DeviceGraph::StreamScope stream_scope() { return graph_.stream_scope(); }

  // Whether this step runs eagerly (a warm-up step); an eager step counts
  // itself with eager_step_done().
  bool eager_now() const { return eager_steps_ < kWarmupSteps; }
  void eager_step_done() { ++eager_steps_; }

  // Copies the step's micro-batches (CPU, in the order the step runs
  // them) and its loss scale into the static device tensors, made on the
  // first call; a later step with other shapes is an error.
  void load(const std::vector<data::TokenBatch>& microbatches, double loss_scale);
  // The static micro-batches on the device and the loss scale ([] fp32).
  const std::vector<data::TokenBatch>& microbatches() const { return microbatches_; }
  const at::Tensor& loss_scale() const { return loss_scale_; }

  // Captures `record` (run once, under stream_scope(), on the static
  // micro-batches) unless captured already, then queues one replay;
  // returns the clip the capture produced, rewritten by the replay.
  const ops::DeviceClip& run(const std::function<ops::DeviceClip()>& record);
  // Replays so far, the capturing step's included.
  int64_t replays() const { return replays_; }

 private:
  at::Device device_;
  DeviceGraph graph_;
  int64_t eager_steps_ = 0;
  int64_t replays_ = 0;
  std::vector<data::TokenBatch> microbatches_;
  at::Tensor loss_scale_;
  ops::DeviceClip clip_;
};

}  // namespace viaduct
