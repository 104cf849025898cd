// Packing of the pipeline's per-rank step values (see pipeline_metrics.h).
#include "train/pipeline_metrics.h"

#include "pipeline/attn_res/block_store.h"

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

}  // namespace viaduct
