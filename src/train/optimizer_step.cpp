#include "train/optimizer_step.h"

#include <chrono>
#include <cmath>

#include "config/job_config.h"
#include "core/check.h"
#include "core/log.h"
#include "core/profiler.h"
#include "distributed/distributed.h"
#include "model/model.h"
#include "ops/clip.h"
#include "train/reduce.h"
#include "train/sharded_optimizer.h"

namespace viaduct {

OptimizerStep::OptimizerStep(const JobConfig& job, std::vector<NamedParam> params,
                             OptimizerStepSetup setup)
    : setup_(std::move(setup)) {
  auto* mesh = setup_.mesh;
  const auto& parts = *setup_.parts;
  dp_size_ = mesh ? mesh->dp() : 1;
  shards_ = mesh && dp_size_ > 1 && job.parallelism.dp_shard_optimizer;
  const int rank = mesh ? mesh->rank() : 0;
  int64_t elements = 0;
  for (const auto& np : params) elements += np.param.numel();
  // Each parameter's stage: the gradient buckets never span two stages
  // (see Note [Overlapped data-parallel reduction]).
  std::vector<int64_t> stage_of;
  for (size_t p = 0; p < parts.size(); ++p) {
    stage_of.insert(stage_of.end(), parts[p]->parameters().size(), setup_.stages.at(p));
  }
  VIADUCT_ASSERT(stage_of.size() == params.size(), "rank ", rank, ": ", stage_of.size(),
                 " parameters in the parts, ", params.size(), " to train");
  // The buckets of the data-parallel sum, which ZeRO-1 also shards. Each
  // routed-expert tensor has its own, cut at expert boundaries; sharded
  // ones are summed apart (see Notes [Expert ranges and the clip norm],
  // [Expert gradient sum], train/expert_parallel.h).
  std::vector<bool> own_bucket(params.size(), false), sharded(params.size(), false);
  std::vector<int64_t> units(params.size(), 0);
  for (const auto& part : parts) {
    for (const auto& [fqn, rows] : routed_expert_tensors(*part)) {
      for (size_t i = 0; i < params.size(); ++i) {
        if (params[i].fqn != fqn) continue;
        own_bucket[i] = true;
        units[i] = params[i].param.numel() / rows;
        sharded[i] = params[i].whole_rows > 0;
      }
    }
    for (auto& s : viaduct::expert_shards(*part)) expert_shards_.push_back(std::move(s));
  }
  auto buckets = grad_buckets(params, job.parallelism.dp_bucket_mb << 20, stage_of,
                              own_bucket, sharded);
  if (shards_) {
    // See Note [ZeRO-1] (train/sharded_optimizer.h); sharded experts over their
    // replicas.
    std::vector<std::vector<size_t>> expert_buckets;
    for (size_t i = 0; i < sharded.size(); ++i) {
      if (sharded[i]) expert_buckets.push_back({i});
    }
    auto zero = std::make_unique<ShardedOptimizer>(
        std::move(params), mesh->dp_group(), buckets,
        [section = job.optimizer, this](std::vector<NamedParam> slices) {
          return make_optimizer(section, std::move(slices), setup_.kernels);
        },
        units, mesh->expert_replica_group(), std::move(expert_buckets));
    log::info("rank ", rank, ": optimizer state ", zero->state_bytes(), " bytes for ",
              zero->owned_elements(), " of ", elements,
              " parameter elements (ZeRO-1 over dp ", dp_size_, ")");
    optimizer_ = std::move(zero);
  } else {
    optimizer_ = make_optimizer(job.optimizer, std::move(params), setup_.kernels);
    log::info("rank ", rank, ": optimizer state ", optimizer_->state_bytes(), " bytes for ",
              elements, " of ", elements, " parameter elements");
  }
  if (mesh && dp_size_ > 1) {
    grad_reduction_ = std::make_unique<GradReduction>(mesh->dp_group(), optimizer_->params(),
                                                      std::move(buckets), std::move(stage_of),
                                                      /*whole=*/!shards_, units);
  }
  if (!expert_shards_.empty()) {
    expert_reduction_ = std::make_unique<ExpertGradReduction>(
        mesh->expert_replica_group(), dp_size_, mesh->ep(), mesh->ep_rank(),
        optimizer_->params(), expert_shards_, /*whole=*/!shards_);
  }
}

OptimizerStep::~OptimizerStep() = default;

void OptimizerStep::stage_ready(int64_t stage) { grad_reduction_->stage_ready(stage); }

void OptimizerStep::finish_reduction(StepMetrics& m, const std::string& context) {
  if (!grad_reduction_) return;
  // See Note [Overlapped data-parallel reduction]: the buckets whose stages
  // finished early are summing already.
  const auto t0 = std::chrono::steady_clock::now();
  m.dp_buckets_overlapped = grad_reduction_->finish(context);
  if (expert_reduction_) expert_reduction_->finish(context);
  m.dp_reduce_wait_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  m.dp_buckets = static_cast<int64_t>(grad_reduction_->num_buckets());
  m.dp_bytes = grad_reduction_->last_step_bytes() +
               (expert_reduction_ ? expert_reduction_->last_step_bytes() : 0);
}

namespace {

// The norm is the whole model's on every rank, so every rank stops here
// together.
void check_norm_finite(double norm, int64_t step) {
  VIADUCT_CHECK(std::isfinite(norm), "step ", step, ": the gradient norm is not finite (", norm,
                "); lower optimizer.lr or check the data");
}

}  // namespace

double OptimizerStep::clip_and_step(double lr, double max_norm,
                                    const std::vector<at::Tensor>& pending_losses,
                                    double& loss_sum, int64_t step, const std::string& context) {
  if (auto clip = device_clip(max_norm, pending_losses)) {
    return step_with_device_clip(lr, *clip, loss_sum, /*keep_grads=*/false, step);
  }
  device_wait_seconds_ = -1;
  double norm = 0.0;
  {
    RECORD_USER_SCOPE("viaduct::grad_norm");
    norm = global_grad_norm(context);
  }
  // Read after the norm's launches (see Note [No sync between forward and
  // backward]); the norm's host copy has waited for the device already.
  for (const auto& l : pending_losses) loss_sum += l.item<double>();
  check_norm_finite(norm, step);
  RECORD_USER_SCOPE("viaduct::optimizer");
  // The clip coefficient rides into the update (see Note [Clip folded into
  // AdamW]).
  optimizer_->step_scaled(lr, clip_coefficient(norm, max_norm));
  optimizer_->zero_grad();
  return norm;
}

bool OptimizerStep::updates_on_device() const {
  // A ZeRO-1 replica holds only its ranges' sums, and its norm needs a sum
  // over dp first: the host path; so do a pipeline rank and a rank holding
  // a share of the experts. See Note [Gradient norm in shard pieces].
  auto* mesh = setup_.mesh;
  return !((mesh && mesh->pp() > 1) || shards_ || expert_reduction_ ||
           !optimizer_->takes_device_scale());
}

std::optional<ops::DeviceClip> OptimizerStep::device_clip(
    double max_norm, const std::vector<at::Tensor>& pending_losses) {
  // See Note [Clip coefficient on the device] (kernels/clip.cu): the norm and
  // the coefficient are formed on the device and the update is queued
  // before the host reads the norm and the losses, which wait for the norm
  // only. A norm that is not finite updates nothing.
  if (!updates_on_device()) return std::nullopt;
  std::vector<at::Tensor> grads;
  if (grad_reduction_) {
    for (auto& piece : grad_reduction_->norm_pieces()) grads.push_back(std::move(piece.grad));
  } else {
    grads = defined_grads(optimizer_->params());
  }
  if (!ops::clip_on_device_takes(grads, setup_.kernels)) return std::nullopt;
  RECORD_USER_SCOPE("viaduct::grad_norm");
  return ops::clip_on_device(grads, max_norm, pending_losses);
}

double OptimizerStep::step_with_device_clip(double lr, const ops::DeviceClip& clip,
                                            double& loss_sum, bool keep_grads, int64_t step) {
  std::vector<double> v;  // [norm, the losses in order]
  {
    RECORD_USER_SCOPE("viaduct::optimizer");
    auto fetch = ops::fetch_clip_values(clip);
    optimizer_->step_device_scaled(lr, clip.scale);
    if (!keep_grads) optimizer_->zero_grad();
    const auto t0 = std::chrono::steady_clock::now();
    v = fetch();
    device_wait_seconds_ =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  for (size_t i = 1; i < v.size(); ++i) loss_sum += v[i];
  check_norm_finite(v[0], step);
  return v[0];
}

double OptimizerStep::global_grad_norm(const std::string& context) {
  // Per-parameter squared norms placed at their global FQN index, summed over
  // the pp group (each slot has one non-zero contributor: exact), then added
  // in global order: every layout gets the same bits. With dp > 1 each
  // parameter has a slot per replica (see Note [Gradient norm in shard pieces]).
  auto* mesh = setup_.mesh;
  const auto& parts = *setup_.parts;
  const bool pp1 = !mesh || mesh->pp() == 1;
  const auto& params = optimizer_->params();
  // The global index of each of this rank's parameters.
  std::vector<size_t> global(params.size());
  if (pp1) {
    for (size_t k = 0; k < global.size(); ++k) global[k] = k;
  } else {
    size_t k = 0;
    for (size_t p = 0; p < parts.size(); ++p) {
      const auto n = parts[p]->parameters().size();
      for (size_t j = 0; j < n; ++j, ++k) {
        global[k] = static_cast<size_t>(setup_.param_offsets[p]) + j;
      }
    }
  }
  const size_t slots = pp1 ? params.size() : static_cast<size_t>(setup_.total_param_tensors);
  std::vector<double> all;
  if (!grad_reduction_) {
    const auto local = grad_squared_norms(params);
    if (pp1) return total_norm(local);
    all.assign(slots, 0.0);
    for (size_t k = 0; k < local.size(); ++k) all[global[k]] = local[k];
  } else {
    const auto dp = static_cast<size_t>(dp_size_);
    auto pieces = grad_reduction_->norm_pieces();
    // Under expert parallelism each sharded expert range has one
    // contributor in the dp group (see Note [Expert ranges and the clip norm]).
    const size_t dense = pieces.size();
    if (expert_reduction_) {
      for (auto& piece : expert_reduction_->norm_pieces()) pieces.push_back(std::move(piece));
    }
    std::vector<at::Tensor> grads;
    for (const auto& piece : pieces) grads.push_back(piece.grad);
    const auto sq = squared_norms(grads);
    all.assign(slots * dp, 0.0);
    std::vector<double> owned(shards_ || !expert_reduction_ ? 0 : slots * dp, 0.0);
    for (size_t k = 0; k < pieces.size(); ++k) {
      auto& dest = k < dense || owned.empty() ? all : owned;
      dest[global[pieces[k].slot / dp] * dp + pieces[k].slot % dp] = sq[k];
    }
    if (shards_) sum_over(&mesh->dp_group(), all, context, "gradient norms");
    if (!owned.empty()) {
      sum_over(&mesh->dp_group(), owned, context, "expert gradient norms");
      for (size_t k = 0; k < all.size(); ++k) all[k] += owned[k];
    }
  }
  if (!pp1) sum_over(&mesh->pp_group(), all, context, "gradient norms");
  return total_norm(all);
}

}  // namespace viaduct
