// The MoE figures of a training step: each layer's largest expert load over
// the mean (summed over the data-parallel replicas, gathered over the
// pipeline ranks), the copies dropped at capacity, and under expert
// parallelism the tokens each rank of the ep group received and what the
// exchanges moved. The counts are snapshotted before the optimizer is
// queued and read after the gradient norm, so the host never stalls on the
// update for them.
#pragma once

#include <c10/core/Event.h>
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "train/expert_parallel.h"
#include "train/metrics.h"

namespace viaduct {

class ModelPart;
namespace distributed {
class Mesh;
}  // namespace distributed

class MoeStepMetrics {
 public:
  // `parts`: this rank's parts; `n_layers`, `experts`: the model's layer
  // count and routed experts per MoE layer; `stats`: the exchanges' figures
  // under expert parallelism (null otherwise); `capacity`: whether
  // model.moe_capacity_factor drops copies.
  MoeStepMetrics(const std::vector<std::shared_ptr<ModelPart>>& parts, int64_t n_layers,
                 int64_t experts, std::shared_ptr<ExpertExchangeStats> stats, bool capacity,
                 distributed::Mesh* mesh, at::Device device);

  // This rank's layers' expert counts of the step, [layers, E + 1] int64 (the
  // last column: copies dropped at capacity), copied to the host without a
  // wait; undefined without MoE layers on this rank. Resets the counters.
  at::Tensor snapshot();
  // Every rank of the mesh joins (a pp rank without MoE layers adds zeros):
  // the sums are collectives. `context` names the rank and step in a
  // timeout.
  void gather(const at::Tensor& counts, StepMetrics& m, const std::string& context);

 private:
  std::vector<MoeLayerRef> layers_;
  int64_t n_layers_, experts_;
  std::shared_ptr<ExpertExchangeStats> stats_;
  bool capacity_;
  distributed::Mesh* mesh_;
  at::Device device_;
  std::unique_ptr<c10::Event> ready_;  // snapshot()'s copy (CUDA)
};

}  // namespace viaduct
