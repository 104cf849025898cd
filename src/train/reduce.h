// The trainer's sums over process groups: a few doubles (token counts, the
// loss, gradient norms, pipeline metrics) and the data-parallel gradient
// all-reduce. Each adds the same terms in the same order on every rank, so
// every layout gets the same bits.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dist/dist.h"
#include "train/optimizer.h"

namespace viaduct {

// Sums `values` over `group` in float64; a no-op without a group or with one
// rank. Where only one rank holds non-zeros ("the value from the last
// stage"), the sum is exact. A timeout names "<context> all-reduce of <what>
// over <group>".
void sum_over(dist::ProcessGroup* group, std::vector<double>& values,
              const std::string& context, const std::string& what);

// The buckets of the data-parallel gradient sum: runs of consecutive
// parameters (indices into `params`) of about `bucket_bytes`, one dtype and
// one pipeline stage per bucket (`stage_of[i]`: parameter i's stage; empty:
// all one stage); a bucket closes once it holds bucket_bytes, or the dtype
// or the stage changes. Also the units ZeRO-1 shards (sharded_optimizer.h).
std::vector<std::vector<size_t>> grad_buckets(const std::vector<NamedParam>& params,
                                              int64_t bucket_bytes,
                                              const std::vector<int64_t>& stage_of = {});

// Note [Overlapped data-parallel reduction]
// The data-parallel gradient sum of one step, bucket by bucket (grad_buckets),
// each all-reduce started as soon as the stage holding the bucket has run
// its last backward of the step (PipelineExecutor::set_grads_ready), while
// the schedule goes on: Gloo sums on its own threads, NCCL on its own
// stream. With gradient accumulation only the last accumulated batch's
// schedule starts buckets. finish() starts what is left, waits for every
// sum in the order they were started and copies them back; the optimizer
// runs after it.
// Every replica runs the same schedule, so every replica starts the same
// buckets in the same order, and each bucket is summed by the same call on
// the same flattened buffer as a sum after the step would be: the same bits.
class GradReduction {
 public:
  // `buckets`: grad_buckets(params, ..., stage_of).
  GradReduction(dist::ProcessGroup& group, const std::vector<NamedParam>& params,
                std::vector<std::vector<size_t>> buckets, std::vector<int64_t> stage_of);
  // Starts every bucket of `stage`.
  void stage_ready(int64_t stage);
  // Starts the buckets not started yet, waits for all, copies the sums into
  // the gradients and resets for the next step. Returns how many buckets
  // started before the step's last stage_ready call: those summed while
  // this rank still ran another stage's backward.
  int64_t finish(const std::string& context);
  size_t num_buckets() const { return buckets_.size(); }

 private:
  void start(size_t bucket);

  dist::ProcessGroup& group_;
  const std::vector<NamedParam>& params_;
  std::vector<int64_t> stage_of_;
  std::vector<std::vector<size_t>> buckets_;
  struct InFlight {
    size_t bucket;
    at::Tensor flat;
    dist::Work work;
  };
  std::vector<InFlight> in_flight_;  // in the order started
  std::vector<bool> started_;
  int64_t overlapped_ = 0;
};

}  // namespace viaduct
