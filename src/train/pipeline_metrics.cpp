// Packing of the pipeline's per-rank step values (see pipeline_metrics.h).
#include "train/pipeline_metrics.h"

#include "core/device.h"
#include "distributed/distributed.h"
#include "pipeline/attn_res/block_store.h"
#include "train/reduce.h"

namespace viaduct {

std::vector<double> StepGatherLayout::pack(double loss_sum,
                                           const pipeline::PipelineTimes& times,
                                           double peak_memory_bytes) const {
  std::vector<double> v{loss_sum};
  if (timed) {
    v.resize(1 + 2 * pp, 0.0);
    v[1 + pp_rank] = times.seconds;
    v[1 + pp + pp_rank] = times.compute_seconds;
  }
  if (per_rank_memory) {
    const size_t mem_at = v.size();
    v.resize(mem_at + pp, 0.0);
    v[mem_at + pp_rank] = peak_memory_bytes;
  }
  return v;
}

void StepGatherLayout::unpack(const std::vector<double>& v,
                              const pipeline::PipelineTimes& times,
                              StepMetrics& m) const {
  const size_t mem_at = timed ? 1 + 2 * pp : 1;
  if (per_rank_memory) {
    m.peak_memory_bytes_per_rank.assign(v.begin() + static_cast<std::ptrdiff_t>(mem_at),
                                        v.begin() + static_cast<std::ptrdiff_t>(mem_at + pp));
  }
  if (timed) {
    m.pipeline_seconds = times.seconds;
    m.pipeline_compute_seconds = times.compute_seconds;
    m.pipeline_p2p_wait_seconds = times.p2p_wait_seconds;
    for (size_t r = 0; r < pp; ++r) {
      m.bubble_measured_per_rank.push_back(
          pipeline::PipelineTimes{v[1 + r], v[1 + pp + r], 0.0}.bubble());
    }
  }
}

std::vector<double> pack_attn_res_bytes(const pipeline::PipelineExecutor& executor,
                                        const pipeline::RankBlockStore& store,
                                        int64_t num_stages, int64_t pp, int pp_rank) {
  const auto hops = static_cast<size_t>(num_stages - 1);
  std::vector<double> v(2 * hops + static_cast<size_t>(pp), 0.0);
  for (const auto& [hop, bytes] : executor.last_step_hop_bytes()) {
    v[static_cast<size_t>(hop)] = static_cast<double>(bytes);
  }
  for (const auto& [hop, bytes] : executor.last_step_hop_grad_bytes()) {
    v[hops + static_cast<size_t>(hop)] = static_cast<double>(bytes);
  }
  v[2 * hops + static_cast<size_t>(pp_rank)] = static_cast<double>(store.peak_bytes());
  return v;
}

void unpack_attn_res_bytes(const std::vector<double>& v, int64_t num_stages,
                           StepMetrics& m) {
  const auto hops = static_cast<size_t>(num_stages - 1);
  for (size_t i = 0; i < v.size(); ++i) {
    (i < hops ? m.hop_bytes : i < 2 * hops ? m.hop_grad_bytes : m.attn_res_store_peak_bytes)
        .push_back(static_cast<int64_t>(v[i]));
  }
}

double StepGather::gather_loss(double loss_sum, std::optional<double> joules,
                               bool stop_signal, StepMetrics& m, const std::string& context) {
  // The loss lives on the last stage's rank; one sum over pp gathers it with
  // each pp rank's pipeline times (when timed) and memory peak (pp > 1). The
  // device has finished the pipeline's work here (the norm was read).
  StepGatherLayout layout;
  layout.pp = static_cast<size_t>(plan_.split.pp);
  layout.pp_rank = static_cast<size_t>(pp_rank_);
  layout.timed = executor_ && executor_->timing();
  layout.per_rank_memory = mesh_ && layout.pp > 1;
  pipeline::PipelineTimes times;
  if (layout.timed) times = executor_->take_times();
  auto gathered = layout.pack(loss_sum, times,
                              layout.per_rank_memory ? peak_memory_bytes(device_) : 0.0);
  // See Note [Save and exit on a signal]: the ranks' stop requests ride along
  // (a separate element: the loss's sum is unchanged); pp then dp covers
  // the mesh.
  gathered.push_back(stop_signal ? 1.0 : 0.0);
  // The step's energy and how many ranks could read theirs
  // (see Note [Energy per step]): a sum that counted fewer ranks than the mesh has is not
  // the step's, and is dropped.
  gathered.push_back(joules.value_or(0.0));
  gathered.push_back(joules ? 1.0 : 0.0);
  sum_over(mesh_ ? &mesh_->pp_group() : nullptr, gathered, context,
           layout.timed ? "the loss and pipeline times" : "the loss");
  const size_t n = gathered.size();
  std::vector<double> loss{gathered[0], gathered[n - 3], gathered[n - 2], gathered[n - 1]};
  sum_over(mesh_ ? &mesh_->dp_group() : nullptr, loss, context, "the loss");
  gathered.resize(n - 3);
  layout.unpack(gathered, times, m);
  stop_requested_ = loss[1] > 0;
  const int world = mesh_ ? mesh_->world_size() : 1;
  m.energy_joules = loss[3] == static_cast<double>(world) ? loss[2] : -1.0;
  return loss[0];
}

std::optional<double> StepGather::read_energy() { return energy_.joules_since_last(); }

void StepGather::gather_attn_res_bytes(StepMetrics& m, const std::string& context) {
  // Each rank knows its own sends and store: one sum over pp gathers them.
  const int64_t stages = plan_.split.num_stages;
  auto v = pack_attn_res_bytes(*executor_, *attn_res_store_, stages, plan_.split.pp, pp_rank_);
  sum_over(mesh_ ? &mesh_->pp_group() : nullptr, v, context, "pipeline byte counts");
  unpack_attn_res_bytes(v, stages, m);
}

void StepGather::fill_throughput(StepMetrics& m, double seconds) const {
  m.seconds = seconds;
  m.tokens_per_sec = static_cast<double>(m.tokens) / seconds;
  // Under block_causal the step's documents gave its FLOPs; else every
  // target token costs flops_per_token.
  if (m.flops < 0) m.flops = flops_per_token_ * static_cast<double>(m.tokens);
  if (auto peak = peak_flops(device_, compute_dtype_)) {
    // Every rank's device counts toward the peak.
    const int world = mesh_ ? mesh_->world_size() : 1;
    m.mfu = m.flops / seconds / (*peak * world);
  }
  m.peak_memory_bytes = peak_memory_bytes(device_);
  m.p2p_bytes = executor_ ? executor_->last_step_p2p_bytes() : 0;
}

}  // namespace viaduct
