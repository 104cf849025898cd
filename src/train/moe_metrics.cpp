#include "train/moe_metrics.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <numeric>
#include <thread>

#include "distributed/distributed.h"
#include "model/model.h"
#include "model/moe.h"
#include "train/reduce.h"

namespace viaduct {

MoeStepMetrics::MoeStepMetrics(const std::vector<std::shared_ptr<ModelPart>>& parts,
                               int64_t n_layers, int64_t experts,
                               std::shared_ptr<ExpertExchangeStats> stats, bool capacity,
                               distributed::Mesh* mesh, at::Device device)
    : n_layers_(n_layers),
      experts_(experts),
      stats_(std::move(stats)),
      capacity_(capacity),
      mesh_(mesh),
      device_(device) {
  for (const auto& part : parts) {
    for (const auto& ref : moe_layer_refs(*part)) layers_.push_back(ref);
  }
}

at::Tensor MoeStepMetrics::snapshot() {
  // Per layer: the experts' counts, then the dropped copies (see Note [Expert
  // capacity], model/moe.h); reset for the next step.
  std::vector<at::Tensor> counts;
  for (const auto& ref : layers_) {
    auto& dropped = ref.moe->tokens_dropped;
    const auto& c = ref.moe->tokens_per_expert;
    counts.push_back(at::cat({c, dropped.defined() ? dropped.to(c.device()).clone()
                                                   : at::zeros({1}, c.options())}));
    if (dropped.defined()) dropped.zero_();
  }
  if (counts.empty()) return {};
  auto all = at::stack(counts);
  if (!all.is_cuda()) return all.clone();
  auto host = at::empty(all.sizes(), all.options().device(at::kCPU).pinned_memory(true));
  host.copy_(all, /*non_blocking=*/true);
  // Waited for alone: the optimizer queued after it runs on.
  ready_ = std::make_unique<c10::Event>(device_.type());
  ready_->record(c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_));
  return host;
}

void MoeStepMetrics::gather(const at::Tensor& counts, StepMetrics& m,
                            const std::string& context) {
  if (ready_) {
    // (LibTorch 1.13's c10::Event has no synchronize; the copy is short.)
    while (!ready_->query()) std::this_thread::yield();
    ready_.reset();
  }
  const int64_t E = experts_;
  // Every layer's counts summed over the replicas, then each layer's
  // largest load over the mean, gathered over the pipeline ranks (one
  // contributor per layer); the dropped copies ride in the last slot.
  std::vector<double> loads(static_cast<size_t>(n_layers_ * E + 1), 0.0);
  const auto c =
      counts.defined() ? counts.to(at::kDouble).contiguous() : at::zeros({0}, at::kDouble);
  const auto* v = c.data_ptr<double>();
  for (size_t k = 0; k < layers_.size(); ++k) {
    const auto* row = v + static_cast<int64_t>(k) * (E + 1);
    std::copy(row, row + E, loads.begin() + layers_[k].layer * E);
    loads.back() += row[E];
  }
  sum_over(mesh_ ? &mesh_->dp_group() : nullptr, loads, context, "MoE expert loads");
  std::vector<double> ratio(static_cast<size_t>(n_layers_), 0.0);
  for (const auto& ref : layers_) {
    const auto first = loads.begin() + ref.layer * E;
    const double total = std::accumulate(first, first + E, 0.0);
    if (total > 0) {
      ratio[static_cast<size_t>(ref.layer)] =
          *std::max_element(first, first + E) / (total / static_cast<double>(E));
    }
  }
  ratio.push_back(loads.back());
  sum_over(mesh_ ? &mesh_->pp_group() : nullptr, ratio, context, "MoE load imbalance");
  if (capacity_) m.moe_dropped_tokens = ratio.back();
  ratio.pop_back();
  m.moe_load_max_over_mean = std::move(ratio);
  if (!stats_) return;
  // The copies each rank of the logging rank's ep group received.
  std::vector<double> received(static_cast<size_t>(mesh_->ep()), 0.0);
  for (const auto& ref : layers_) {
    received[static_cast<size_t>(mesh_->ep_rank())] +=
        static_cast<double>(ref.moe->tokens_received);
    ref.moe->tokens_received = 0;
  }
  sum_over(mesh_->ep_group(), received, context, "expert tokens received");
  m.ep_tokens_received_per_rank = std::move(received);
  m.ep_alltoall_bytes = stats_->bytes_sent;
  m.ep_alltoall_seconds = stats_->seconds;
  *stats_ = ExpertExchangeStats{};
}

}  // namespace viaduct
