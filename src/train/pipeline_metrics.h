// The per-step values that only one pp rank knows each (the loss on the last
// stage, each rank's pipeline span and compute time, memory peak, AttnRes hop
// bytes and block store peak), packed into vectors that one sum over the pp
// group gathers, and unpacked into StepMetrics. Every rank writes only its
// own slots and zeros elsewhere, so each sum has one non-zero term: exact.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/energy.h"
#include "pipeline/runtime/executor.h"
#include "pipeline/schedule/plan.h"
#include "train/metrics.h"

namespace viaduct {

namespace distributed {
class Mesh;
}  // namespace distributed
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

// The gathers at the end of a step, with what each needs of the rank: the
// loss and the pipeline figures (StepGatherLayout), the AttnRes byte counts,
// and the throughput of this step. `executor` and `store` may be null (one
// stage; no AttnRes pipeline); `mesh` null for one process.
class StepGather {
 public:
  StepGather(const pipeline::PipelinePlan& plan, int pp_rank, distributed::Mesh* mesh,
             pipeline::PipelineExecutor* executor, const pipeline::RankBlockStore* store,
             at::Device device, at::ScalarType compute_dtype, double flops_per_token)
      : plan_(plan), pp_rank_(pp_rank), mesh_(mesh), executor_(executor),
        attn_res_store_(store), device_(device), compute_dtype_(compute_dtype),
        flops_per_token_(flops_per_token), energy_(device) {}

  // The device's energy counter read for this step (see Note [Energy per
  // step], core/energy.h): the joules since the previous reading, nullopt
  // without a counter. Taken while the device still has the step's work
  // queued (see Note [Energy read while the device works]).
  std::optional<double> read_energy();
  // The step's loss sum over the mesh (every rank gets it), with each pp
  // rank's pipeline times and memory peak and the step's energy (`joules`,
  // this rank's read_energy) into `m`; `stop_signal`: this rank was asked
  // to stop (see Note [Save and exit on a signal]), after which
  // stop_requested() says whether any rank was.
  double gather_loss(double loss_sum, std::optional<double> joules, bool stop_signal,
                     StepMetrics& m, const std::string& context);
  bool stop_requested() const { return stop_requested_; }
  void gather_attn_res_bytes(StepMetrics& m, const std::string& context);
  // Tokens per second, MFU over every rank's device, the memory peak and the
  // pipeline's bytes, from m.tokens and m.flops (flops_per_token x m.tokens
  // unless the step's documents set it) and the step's host time.
  void fill_throughput(StepMetrics& m, double seconds) const;

 private:
  const pipeline::PipelinePlan& plan_;
  int pp_rank_;
  distributed::Mesh* mesh_;
  pipeline::PipelineExecutor* executor_;
  const pipeline::RankBlockStore* attn_res_store_;
  at::Device device_;
  at::ScalarType compute_dtype_;
  double flops_per_token_;
  EnergyMeter energy_;
  bool stop_requested_ = false;
};

}  // namespace viaduct
