// The trainer's sums over process groups: a few doubles (token counts, the
// loss, gradient norms, pipeline metrics) and the data-parallel gradient
// all-reduce. Each adds the same terms in the same order on every rank, so
// every layout gets the same bits.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "train/optimizer.h"

namespace viaduct {

namespace dist {
class ProcessGroup;
}  // namespace dist

// Sums `values` over `group` in float64; a no-op without a group or with one
// rank. Where only one rank holds non-zeros ("the value from the last
// stage"), the sum is exact. A timeout names "<context> all-reduce of <what>
// over <group>".
void sum_over(dist::ProcessGroup* group, std::vector<double>& values,
              const std::string& context, const std::string& what);

// The buckets of the data-parallel gradient sum: runs of consecutive
// parameters (indices into `params`) of about `bucket_bytes`, one dtype per
// bucket; a bucket closes once it holds bucket_bytes or the dtype changes.
// Also the units ZeRO-1 shards (sharded_optimizer.h).
std::vector<std::vector<size_t>> grad_buckets(const std::vector<NamedParam>& params,
                                              int64_t bucket_bytes);

// Sums the gradients of `params` over `group`: flattened into the
// grad_buckets, one all-reduce each, copied back. A parameter without a
// gradient gets zeros first.
void allreduce_grads(dist::ProcessGroup& group, const std::vector<NamedParam>& params,
                     int64_t bucket_bytes, const std::string& context);

}  // namespace viaduct
