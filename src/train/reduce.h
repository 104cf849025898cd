// The trainer's sums over process groups: a few doubles (token counts, the
// loss, gradient norms, pipeline metrics) and the data-parallel gradient
// sum. Each adds the same terms in the same order on every rank, so
// every layout gets the same bits.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "distributed/distributed.h"
#include "train/optimizer.h"

namespace viaduct {

// Sums `values` over `group` in float64; a no-op without a group or with one
// rank. Where only one rank holds non-zeros ("the value from the last
// stage"), the sum is exact. A timeout names "<context> all-reduce of <what>
// over <group>".
void sum_over(distributed::ProcessGroup* group, std::vector<double>& values,
              const std::string& context, const std::string& what);

// The buckets of the data-parallel gradient sum: runs of consecutive
// parameters (indices into `params`) of about `bucket_bytes`, one dtype and
// one pipeline stage per bucket (`stage_of[i]`: parameter i's stage; empty:
// all one stage); a bucket closes once it holds bucket_bytes, or the dtype
// or the stage changes. A parameter with `own_bucket[i]` set (empty: none)
// gets a bucket of its own (see Note [Expert ranges and the clip norm],
// train/expert_parallel.h); one with `skip[i]` (empty: none) none at all.
// Also the units ZeRO-1 shards (sharded_optimizer.h).
std::vector<std::vector<size_t>> grad_buckets(const std::vector<NamedParam>& params,
                                              int64_t bucket_bytes,
                                              const std::vector<int64_t>& stage_of = {},
                                              const std::vector<bool>& own_bucket = {},
                                              const std::vector<bool>& skip = {});

inline constexpr int64_t kShardAlign = 64;

// Elements [begin, end) of parameter `param`'s row-major flattening.
struct ShardSegment {
  size_t param = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

// segments[b][r]: replica r's segments of bucket b, in parameter order
// (together one contiguous range of the bucket's flattening).
struct ShardLayout {
  std::vector<std::vector<std::vector<ShardSegment>>> segments;
};

// Splits each bucket (indices into `numels`) over `dp` replicas: replica r
// gets elements [x_r, x_{r+1}) of the bucket's flattening, x_r = floor(n r /
// dp) moved down to the nearest multiple of kShardAlign from the start of
// the parameter it falls in, so every range starts aligned for vector loads.
// `units[i]` (empty or 0: kShardAlign) replaces kShardAlign for parameter
// i: an expert tensor's rows, so its ranges hold whole experts.
ShardLayout shard_layout(const std::vector<int64_t>& numels,
                         const std::vector<std::vector<size_t>>& buckets, int dp,
                         const std::vector<int64_t>& units = {});
// The elements in `segs`.
int64_t segment_elements(const std::vector<ShardSegment>& segs);
// The elements of a segment, as a 1-D view of `t` (a parameter, its
// gradient or a whole state tensor shaped like the parameter).
at::Tensor segment_of(const at::Tensor& t, const ShardSegment& s);

// One bucket's all-gather of every replica's range (per_rank, a bucket of
// ShardLayout::segments), each padded with zeros to the bucket's largest
// range: an all-gather takes equal sizes.
struct RangeGather {
  std::vector<std::vector<at::Tensor>> outputs;  // outputs[0][r]: replica r's range
  distributed::Work work;
  int64_t bytes_sent = 0;  // by this replica, padding included
};
// Starts the all-gather of `mine`, this replica's range flattened (its
// segments back to back), over `group`. An empty bucket starts nothing.
RangeGather start_range_gather(distributed::ProcessGroup& group,
                               const std::vector<std::vector<ShardSegment>>& per_rank,
                               const at::Tensor& mine);
// After the gather's work finished: copies replica r's range, for every r
// but `skip` (none when out of range), into dest(segment) segment by segment.
void copy_gathered_ranges(const RangeGather& gather,
                          const std::vector<std::vector<ShardSegment>>& per_rank,
                          const std::function<at::Tensor(const ShardSegment&)>& dest,
                          size_t skip);

// Note [Data-parallel sum in a fixed order]
// The data-parallel gradient sum is a reduce-scatter, with or without
// ZeRO-1: each bucket's flattening is cut into the dp ranges of
// shard_layout, an all-to-all sends range r of every replica to replica r,
// and replica r adds the dp pieces in replica order, ((g_0 + g_1) + g_2) +
// ... Without ZeRO-1 an all-gather of the summed ranges then gives every
// replica the whole sum (an all-reduce's result and traffic, 2 (dp - 1) /
// dp of the bucket each way); with ZeRO-1 each replica keeps its range
// only, for its slice of the optimizer (see Note [ZeRO-1]), and all-gathers
// the updated weights instead. Both runs therefore add every gradient
// element in the same order -- the sharded run has the unsharded one's
// bits -- and that order is the replicas', whatever the backend's
// reduction algorithm would pick.
//
// Note [Gradient norm in shard pieces]
// With dp > 1 the clip norm is formed from the same pieces in both runs:
// for every parameter, in FQN order, the fp32 norm of each of its shard
// segments (replica order), squared and added in double. A ZeRO-1 replica
// holds only its own segments' sums, so it forms those and one sum over
// dp fills in the rest (one contributor per slot: exact); the unsharded
// run forms every segment itself. With dp = 1 a segment is the whole
// parameter: the norm of each parameter, as before.
//
// Note [Overlapped data-parallel reduction]
// The data-parallel gradient sum of one step, bucket by bucket
// (grad_buckets), each bucket's all-to-all started as soon as the stage
// holding it has run its last backward of the step
// (PipelineExecutor::set_grads_ready), while the schedule goes on: Gloo
// moves the data on its own threads, NCCL on its own stream. With gradient
// accumulation only the last accumulated batch's schedule starts buckets.
// finish() starts what is left, waits for the all-to-alls in the order
// they were started, adds the pieces, all-gathers where the whole sum is
// wanted and copies the sums into the gradients; the optimizer runs after
// it. Every replica runs the same schedule, so every replica starts the
// same buckets in the same order, and the arithmetic of each bucket does
// not depend on when it started: the same bits.
class GradReduction {
 public:
  // `buckets`: grad_buckets(params, ..., stage_of). `whole`: every replica
  // gets the whole sum (plain data parallelism); else each keeps its own
  // ranges of shard_layout(buckets, group.size()) summed (ZeRO-1), the
  // rest of its gradients holding its own unsummed values.
  GradReduction(distributed::ProcessGroup& group, const std::vector<NamedParam>& params,
                std::vector<std::vector<size_t>> buckets, std::vector<int64_t> stage_of,
                bool whole, const std::vector<int64_t>& units = {});
  // Starts every bucket of `stage`.
  void stage_ready(int64_t stage);
  // Starts the buckets not started yet, waits for all, copies the sums into
  // the gradients and resets for the next step. Returns how many buckets
  // started before the step's last stage_ready call: those summed while
  // this rank still ran another stage's backward.
  int64_t finish(const std::string& context);
  size_t num_buckets() const { return buckets_.size(); }
  const ShardLayout& layout() const { return layout_; }
  // Bytes this replica sent in the last finished step's collectives (it
  // receives as many), padding included.
  int64_t last_step_bytes() const { return last_step_bytes_; }

  // See Note [Gradient norm in shard pieces]: the pieces whose sums this
  // replica holds after finish() (all of them when `whole`), each with its
  // slot: parameter index * dp + the replica owning it.
  struct NormPiece {
    size_t slot = 0;
    at::Tensor grad;  // a view of the parameter's gradient (the gradient
                      // itself where the segment is the whole parameter)
  };
  std::vector<NormPiece> norm_pieces() const;

 private:
  void start(size_t bucket);

  distributed::ProcessGroup& group_;
  const std::vector<NamedParam>& params_;
  std::vector<int64_t> stage_of_;
  std::vector<std::vector<size_t>> buckets_;
  ShardLayout layout_;
  bool whole_;
  struct InFlight {
    size_t bucket;
    at::Tensor send;  // the bucket's flattening, kept alive for the backend
    at::Tensor recv;  // dp pieces of this replica's range, in replica order
    distributed::Work work;
  };
  std::vector<InFlight> in_flight_;  // in the order started
  std::vector<bool> started_;
  int64_t overlapped_ = 0;
  int64_t bytes_sent_ = 0;
  int64_t last_step_bytes_ = 0;
};

}  // namespace viaduct
