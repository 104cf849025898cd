#include "train/step_graph.h"

#include "core/check.h"
#include "core/log.h"

namespace viaduct {

StepGraph::StepGraph(const at::Device& device) : device_(device), graph_(device) {}

void StepGraph::load(const std::vector<data::TokenBatch>& microbatches, double loss_scale) {
  for (const auto& mb : microbatches) {
    VIADUCT_CHECK_T(ConfigError, !mb.images.defined(),
                    "training.cuda_graphs = true: this data has images, whose tower's "
                    "work is not captured; set training.cuda_graphs = false");
  }
  if (microbatches_.empty()) {
    for (const auto& mb : microbatches) {
      data::TokenBatch s;
      s.inputs = at::empty(mb.inputs.sizes(), mb.inputs.options().device(device_));
      s.targets = at::empty(mb.targets.sizes(), mb.targets.options().device(device_));
      microbatches_.push_back(std::move(s));
    }
    loss_scale_ = at::empty({}, at::TensorOptions().dtype(at::kFloat).device(device_));
  }
  VIADUCT_CHECK(microbatches.size() == microbatches_.size(), "training.cuda_graphs: this step has ",
                microbatches.size(), " micro-batches, the captured step ", microbatches_.size());
  for (size_t i = 0; i < microbatches.size(); ++i) {
    const auto& in = microbatches[i];
    auto& s = microbatches_[i];
    VIADUCT_CHECK(in.inputs.sizes() == s.inputs.sizes() && in.targets.sizes() == s.targets.sizes(),
                  "training.cuda_graphs: micro-batch ", i, " of this step has inputs ",
                  in.inputs.sizes(), " and targets ", in.targets.sizes(),
                  ", the captured step had ", s.inputs.sizes(), " and ", s.targets.sizes(),
                  "; the graph replays fixed shapes");
    // Ordered on the graph's stream before the replay that reads them.
    s.inputs.copy_(in.inputs.pin_memory(), /*non_blocking=*/true);
    s.targets.copy_(in.targets.pin_memory(), /*non_blocking=*/true);
  }
  // The same float the eager step's loss * scale rounds the double to.
  loss_scale_.copy_(at::scalar_tensor(static_cast<float>(loss_scale), at::kFloat).pin_memory(),
                    /*non_blocking=*/true);
}

const ops::DeviceClip& StepGraph::run(const std::function<ops::DeviceClip()>& record) {
  if (!graph_.captured()) {
    graph_.capture([&] { clip_ = record(); });
    log::info("training.cuda_graphs: the step is captured as one CUDA graph; later steps "
              "replay it");
  }
  graph_.replay();
  ++replays_;
  return clip_;
}

}  // namespace viaduct
