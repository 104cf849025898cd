// The per-step values that only one pp rank knows each (the loss on the last
// stage, each rank's pipeline span and compute time, memory peak, AttnRes hop
// bytes and block store peak), packed into vectors that one sum over the pp
// group gathers, and unpacked into StepMetrics. Every rank writes only its
// own slots and zeros elsewhere, so each sum has one non-zero term: exact.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "pipeline/runtime/executor.h"
#include "train/metrics.h"

namespace viaduct {

namespace pipeline {
class RankBlockStore;
}  // namespace pipeline

// v = [loss, span per pp rank, compute per pp rank, memory peak per pp rank];
// the span and compute slots only when `timed`, the memory slots only when
// `per_rank_memory`.
struct StepGatherLayout {
  size_t pp = 1;
  size_t pp_rank = 0;
  bool timed = false;
  bool per_rank_memory = false;

  std::vector<double> pack(double loss_sum, const pipeline::PipelineTimes& times,
                           double peak_memory_bytes) const;
  // After the sum: the per-rank memory peaks and, when timed, this rank's
  // times and every rank's measured bubble. The loss is v[0].
  void unpack(const std::vector<double>& v, const pipeline::PipelineTimes& times,
              StepMetrics& m) const;
};

// AttnRes pipelines: v = [forward bytes per hop, backward bytes per hop,
// store peak per pp rank], hops s -> s+1 over `num_stages` stages.
std::vector<double> pack_attn_res_bytes(const pipeline::PipelineExecutor& executor,
                                        const pipeline::RankBlockStore& store,
                                        int64_t num_stages, int64_t pp, int pp_rank);
void unpack_attn_res_bytes(const std::vector<double>& v, int64_t num_stages,
                           StepMetrics& m);

}  // namespace viaduct
