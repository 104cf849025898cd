#include "train/trainer.h"

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <optional>
#include <thread>

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "checkpoint/manager.h"
#include "core/check.h"
#include "core/device.h"
#include "core/file_io.h"
#include "core/folder_lock.h"
#include "core/profiler.h"
#include "core/log.h"
#include "data/sampler.h"
#include "data/token_file.h"
#include "distributed/distributed.h"
#include "kernels/weight_cache.h"
#include "model/moe.h"
#include "ops/clip.h"
#include "pipeline/attn_res/block_store.h"
#include "pipeline/runtime/executor.h"
#include "pipeline/schedule/plan.h"
#include "pipeline/schedule/timeline_svg.h"
#include "train/checkpointer.h"
#include "train/expert_parallel.h"
#include "train/fault_injection.h"
#include "train/fresh_run.h"
#include "train/memory_estimate.h"
#include "train/pipeline_metrics.h"
#include "train/preemption.h"
#include "train/process.h"
#include "train/rank_model.h"
#include "train/reduce.h"
#include "train/report.h"
#include "train/sharded_optimizer.h"
#include "train/train_state.h"
#include "train/warm_start.h"

namespace viaduct {
namespace fs = std::filesystem;

// ---- setup -----------------------------------------------------------------

Trainer::Trainer(Config cfg) : cfg_(std::move(cfg)), device_(at::kCPU) {
  auto process = init_process(cfg_);
  mesh_ = std::move(process.mesh);
  device_ = process.device;
  compute_dtype_ = process.compute_dtype;
  pp_rank_ = process.pp_rank;
  dp_rank_ = process.dp_rank;
  dp_size_ = process.dp_size;
  // checkpoint.last_save_in_hf: a missing data.tokenizer fails before
  // anything is written.
  if (cfg_.get_bool("checkpoint.last_save_in_hf") && rank() == 0) {
    hf_export_tokenizer_files(cfg_);
  }
  lock_folders();
  check_memory_fits();
  open_data();
  if (cfg_.get_bool("checkpoint.last_save_in_hf")) {
    hf_model_shape(cfg_);  // a family without an HF layout fails before training
    if (rank() == 0) hint_export_tokenizer();
    VIADUCT_CHECK_T(ConfigError,
                    !mesh_ || (cfg_.get_bool("checkpoint.enable") &&
                               cfg_.get_bool("checkpoint.save_final")),
                    "checkpoint.last_save_in_hf under a launcher needs checkpoint.enable = "
                    "true and checkpoint.save_final = true: the export reads the final "
                    "checkpoint");
  }
  const auto info = build_model();
  init_data();
  faults_ = FaultInjection::from_environment();
  CheckpointLayout layout;
  layout.pp = static_cast<int>(plan_->split.pp);
  layout.pp_rank = pp_rank_;
  layout.dp = dp_size_;
  layout.dp_rank = dp_rank_;
  layout.num_stages = plan_->split.num_stages;
  layout.shards_optimizer = shards_optimizer();
  layout.ep = ep_size_;
  layout.moe = moe_experts_ > 0;
  CheckpointerOptions checkpoint_options;
  checkpoint_options.async = cfg_.get_string("checkpoint.async_mode") == "async";
  checkpoint_options.timeout = std::chrono::seconds(cfg_.get_int("parallelism.comm_timeout_seconds"));
  checkpoint_options.hold_writes = faults_.slow_save;
  checkpointer_ = std::make_unique<Checkpointer>(checkpoint_folder(),
                                                 checkpoint_policy_from_config(cfg_), layout,
                                                 checkpoint_options, mesh_.get(), device_);
  auto mo = metrics_options_from_config(cfg_, is_logging_rank());
  mo.pipeline = executor_ != nullptr;
  mo.attn_res = attn_res_tables_ != nullptr;
  mo.pp_rank = pp_rank_;
  mo.bubble_simulated = plan_->simulation.bubble_fraction;
  if (plan_->simulation_flops) mo.bubble_simulated_flops = plan_->simulation_flops->bubble_fraction;
  for (const auto& e : estimate_memory_per_rank(cfg_, info, *plan_, compute_dtype_, device_.is_cuda())) {
    mo.plan_memory_bytes_per_rank.push_back(e.total());
  }
  metrics_ = std::make_unique<MetricsWriter>(std::move(mo));
  log_job_summary(cfg_, {info, *plan_, device_, compute_dtype_, dp_size_, num_microbatches(),
                         *sampler_, eval_tokens_.get()});
}

void Trainer::hint_export_tokenizer() const {
  if (!cfg_.get_string("data.tokenizer").empty()) return;
  // The token files' headers name the tokenizer that made them; a real one
  // belongs beside the exported weights.
  for (size_t s = 0; s < sampler_->num_sources(); ++s) {
    for (const auto& file : sampler_->source(s).tokens->files()) {
      const auto& name = file.tokenizer();
      if (name.empty() || name == "byte") continue;
      log::info("the data ", file.path(), " was made with the tokenizer ", name,
                "; set data.tokenizer to its tokenizer.json to copy it into the Hugging "
                "Face folder of checkpoint.last_save_in_hf");
      return;
    }
  }
}

void Trainer::lock_folders() {
  // Note [One trainer per dump folder]: rank 0 speaks for the job; a
  // checkpoint folder outside the dump folder is locked too.
  if (rank() != 0) return;
  const fs::path dump = cfg_.get_string("job.dump_folder");
  folder_locks_.push_back(std::make_unique<FolderLock>(dump, "job.dump_folder"));
  if (!cfg_.get_bool("checkpoint.enable")) return;
  const fs::path ckpt = fs::absolute(checkpoint_folder()).lexically_normal();
  const fs::path dump_abs = fs::absolute(dump).lexically_normal();
  const auto rel = ckpt.lexically_relative(dump_abs);
  if (rel.empty() || *rel.begin() == "..") {
    folder_locks_.push_back(std::make_unique<FolderLock>(ckpt, "checkpoint.folder"));
  }
  make_room_for_fresh_run(cfg_);  // Note [A fresh run never mixes with an old one]
}

void Trainer::check_memory_fits() const {
  // Note [Activation memory estimate] (train/memory_estimate.h).
  const auto avail = device_memory_bytes(device_);
  if (!avail) return;
  check_rank_memory_fits(cfg_, pp_rank_, compute_dtype_, device_.is_cuda(), *avail,
                         device_name(device_));
}

ModelInfo Trainer::build_model() {
  ep_size_ = mesh_ ? mesh_->ep() : 1;
  auto rm = build_rank_model(cfg_, pp_rank_, device_, compute_dtype_,
                             mesh_ ? &mesh_->pp_group() : nullptr, step_context(),
                             mesh_ ? mesh_->ep_group() : nullptr);
  plan_ = std::move(rm.plan);
  parts_ = std::move(rm.parts);
  attn_res_tables_ = std::move(rm.attn_res_tables);
  attn_res_store_ = std::move(rm.attn_res_store);
  param_offsets_ = std::move(rm.param_offsets);
  expert_stats_ = std::move(rm.expert_stats);
  n_layers_ = rm.info.n_layers;
  moe_experts_ = rm.info.routed_experts;
  total_param_tensors_ = rm.total_param_tensors;
  flops_per_token_ = rm.info.flops_per_token;
  const auto& params = rm.params;
  // Token ids must fit the embedding.
  for (const auto& np : params) {
    if (np.fqn != "tok_embeddings.weight") continue;
    for (size_t s = 0; s < sampler_->num_sources(); ++s) {
      const auto& tokens = *sampler_->source(s).tokens;
      VIADUCT_CHECK_T(ConfigError, tokens.max_token() < np.param.size(0), "the data ",
                      tokens.describe(), " holds token id ", tokens.max_token(),
                      ", but model.vocab_size is ", np.param.size(0));
    }
    // The held-out tokens too: eval would index past the embedding.
    if (eval_tokens_) {
      VIADUCT_CHECK_T(ConfigError, eval_tokens_->max_token() < np.param.size(0),
                      "the held-out data ", eval_tokens_->describe(), " (data.val_path, or "
                      "<stem>.val<.ext> beside the training data) holds token id ",
                      eval_tokens_->max_token(), ", but model.vocab_size is ",
                      np.param.size(0));
    }
  }
  int64_t elements = 0;
  for (const auto& np : rm.params) elements += np.param.numel();
  // Each parameter's stage: the gradient buckets never span two stages
  // (Note [Overlapped data-parallel reduction]).
  std::vector<int64_t> stage_of;
  const auto& my_stages = plan_->split.rank_to_stages.at(pp_rank_);
  for (size_t p = 0; p < parts_.size(); ++p) {
    stage_of.insert(stage_of.end(), parts_[p]->parameters().size(), my_stages.at(p));
  }
  VIADUCT_ASSERT(stage_of.size() == rm.params.size(), "rank ", rank(), ": ", stage_of.size(),
                 " parameters in the parts, ", rm.params.size(), " to train");
  // The buckets of the data-parallel sum, which ZeRO-1 also shards. Each
  // routed-expert tensor has its own, cut at expert boundaries; sharded
  // ones are summed apart (Notes [Expert ranges and the clip norm],
  // [Expert gradient sum], train/expert_parallel.h).
  std::vector<bool> own_bucket(rm.params.size(), false), sharded(rm.params.size(), false);
  std::vector<int64_t> units(rm.params.size(), 0);
  std::vector<ExpertShard> shards;
  for (const auto& part : parts_) {
    for (const auto& [fqn, rows] : routed_expert_tensors(*part)) {
      for (size_t i = 0; i < rm.params.size(); ++i) {
        if (rm.params[i].fqn != fqn) continue;
        own_bucket[i] = true;
        units[i] = rm.params[i].param.numel() / rows;
        sharded[i] = rm.params[i].whole_rows > 0;
      }
    }
    for (auto& s : expert_shards(*part)) shards.push_back(std::move(s));
    for (const auto& ref : moe_layer_refs(*part)) moe_layers_.push_back(ref);
  }
  expert_shards_ = shards;
  auto buckets = grad_buckets(rm.params, cfg_.get_int("parallelism.dp_bucket_mb") << 20,
                              stage_of, own_bucket, sharded);
  if (shards_optimizer()) {
    // Note [ZeRO-1] (train/sharded_optimizer.h); sharded experts over their
    // replicas.
    std::vector<std::vector<size_t>> expert_buckets;
    for (size_t i = 0; i < sharded.size(); ++i) {
      if (sharded[i]) expert_buckets.push_back({i});
    }
    auto zero = std::make_unique<ShardedOptimizer>(
        std::move(rm.params), mesh_->dp_group(), buckets,
        [this](std::vector<NamedParam> slices) { return make_optimizer(cfg_, std::move(slices)); },
        units, mesh_->expert_replica_group(), std::move(expert_buckets));
    log::info("rank ", rank(), ": optimizer state ", zero->state_bytes(), " bytes for ",
              zero->owned_elements(), " of ", elements,
              " parameter elements (ZeRO-1 over dp ", dp_size_, ")");
    optimizer_ = std::move(zero);
  } else {
    optimizer_ = make_optimizer(cfg_, std::move(rm.params));
    log::info("rank ", rank(), ": optimizer state ", optimizer_->state_bytes(), " bytes for ",
              elements, " of ", elements, " parameter elements");
  }

  if (mesh_ && dp_size_ > 1) {
    grad_reduction_ = std::make_unique<GradReduction>(mesh_->dp_group(), optimizer_->params(),
                                                      std::move(buckets), std::move(stage_of),
                                                      /*whole=*/!shards_optimizer(), units);
  }
  if (!shards.empty()) {
    expert_reduction_ = std::make_unique<ExpertGradReduction>(
        mesh_->expert_replica_group(), dp_size_, ep_size_, mesh_->ep_rank(),
        optimizer_->params(), std::move(shards), /*whole=*/!shards_optimizer());
  }
  if (plan_->split.num_stages > 1) {
    executor_ = std::make_unique<pipeline::PipelineExecutor>(
        *plan_, pp_rank_, std::move(rm.stages), mesh_ ? &mesh_->pp_group() : nullptr,
        device_);
    executor_->set_timing(cfg_.get_bool("metrics.pipeline_timing"));
  }
  return rm.info;
}

data::SamplerOptions Trainer::sampler_options() const {
  data::SamplerOptions so;
  so.batch_size = cfg_.get_int("training.local_batch_size");
  so.seq_len = cfg_.get_int("training.seq_len");
  so.seed = static_cast<uint64_t>(cfg_.get_int("training.seed"));
  so.shuffle = cfg_.get_bool("data.shuffle");
  so.dp_rank = dp_rank_;
  so.dp_size = dp_size_;
  return so;
}

void Trainer::open_data() {
  // data.path is a blend of one source (Note [Windows and the data cursor]).
  const auto format = cfg_.get_string("data.format");
  const auto paths = cfg_.get_string_list("data.paths");
  const bool blend = !paths.empty();
  const std::vector<std::string> specs =
      blend ? paths : std::vector<std::string>{cfg_.get_string("data.path")};
  auto sources = data::open_data_sources(
      blend ? "data.paths" : "data.path", specs,
      blend ? cfg_.get_float_list("data.weights") : std::vector<double>{}, format);
  const auto val = data::resolve_val_paths(specs, cfg_.get_string("data.val_path"));
  if (!val.empty()) eval_tokens_ = data::open_token_stream(val, format);
  sampler_ = std::make_unique<data::TokenSampler>(std::move(sources), sampler_options());
}

void Trainer::init_data() {
  const auto so = sampler_options();
  VIADUCT_CHECK_T(ConfigError, so.batch_size % num_microbatches() == 0,
                  "training.local_batch_size (", so.batch_size,
                  ") must be divisible by the ", num_microbatches(),
                  " micro-batches (parallelism.pipeline_parallel_microbatches)");
  if (eval_tokens_) {
    eval_loader_ = std::make_unique<data::EvalLoader>(
        eval_tokens_, so, cfg_.get_int("data.eval_batches"));
  }
  if (executor_) {
    // Boundary shapes from one forward-only micro-batch (Note [Boundary metadata]).
    auto probe = at::zeros({so.batch_size / num_microbatches(), so.seq_len}, at::kLong);
    executor_->infer_metadata(probe);
  }
}

Trainer::~Trainer() {
  // A save still being written finishes first (the Checkpointer's
  // destructor logs its error, which run() saw only when it did not fail).
  checkpointer_.reset();
  // The weight cache's copies live in a process-wide registry; drop them
  // with the model rather than at static destruction, after the CUDA
  // runtime may be gone (Note [Low-precision weight cache]).
  kernels::weight_cache::clear();
}

int Trainer::rank() const { return mesh_ ? mesh_->rank() : 0; }

bool Trainer::shards_optimizer() const {
  return mesh_ && dp_size_ > 1 && cfg_.get_bool("parallelism.dp_shard_optimizer");
}

int64_t Trainer::num_microbatches() const {
  // One stage: the key alone decides (default 1); else the schedule's count.
  if (!executor_) {
    return cfg_.get_int_opt("parallelism.pipeline_parallel_microbatches").value_or(1);
  }
  return executor_->num_microbatches();
}

std::string Trainer::checkpoint_folder() const { return checkpoint_folder_from_config(cfg_); }

std::string Trainer::step_context() const { return str("rank ", rank(), " step ", step_ + 1); }

void Trainer::sum_over(distributed::ProcessGroup* group, std::vector<double>& values,
                       const std::string& what) {
  viaduct::sum_over(group, values, step_context(), what);
}

// ---- the step --------------------------------------------------------------

StepMetrics Trainer::train_step() {
  faults_.kill_if_due(rank(), step_ + 1);
  const auto t0 = std::chrono::steady_clock::now();
  int64_t tokens = 0;
  const auto batches = next_batches(tokens);
  // Note [Loss scaling]: the denominator is the global token count.
  std::vector<at::Tensor> pending_losses;
  double loss_sum = forward_backward(batches, 1.0 / static_cast<double>(tokens), pending_losses);
  StepMetrics m;
  reduce_grads_over_dp(m);
  const auto moe_counts = snapshot_moe_counts();
  const double lr = lr_at(cfg_, step_ + 1);
  const double max_norm = cfg_.get_float("training.max_norm");
  // Where it can, the update is queued on the device before the norm is read;
  // else it waits for the norm's check below.
  const auto device_norm = step_with_device_clip(lr, max_norm, pending_losses, loss_sum);
  const double norm = device_norm ? *device_norm : host_grad_norm(pending_losses, loss_sum);
  const double loss = gather_loss_and_pipeline_metrics(loss_sum, m);
  // Every rank of an MoE model joins (a pp rank without MoE layers adds
  // zeros): the sums are collectives.
  if (moe_experts_ > 0) gather_moe_metrics(moe_counts, m);
  VIADUCT_CHECK(std::isfinite(norm), "step ", step_ + 1,
                ": the gradient norm is not finite (", norm,
                "); lower optimizer.lr or check the data");
  if (!device_norm) {
    RECORD_USER_SCOPE("viaduct::optimizer");
    // The clip coefficient rides into the update (Note [Clip folded into
    // AdamW]).
    optimizer_->step_scaled(lr, clip_coefficient(norm, max_norm));
    optimizer_->zero_grad();
  }
  if (const auto* zero = dynamic_cast<const ShardedOptimizer*>(optimizer_.get())) {
    m.dp_bytes += zero->last_step_bytes();
  }
  sync_replica_statistics();
  for (auto& p : parts_) p->after_optimizer_step();
  ++step_;
  tokens_seen_ += tokens;
  // Note [Step time without a final sync]: the step ends with the optimizer
  // queued, not finished; the next step's host work (data, the first
  // launches) overlaps its device tail, and the reads of the loss and the
  // gradient norm wait for it. A step's time is host time from its start to
  // here, so the steps' times add up to the loop's wall time.
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  m.step = step_;
  m.loss = loss / static_cast<double>(tokens);
  m.grad_norm = norm;
  m.lr = lr;
  m.tokens = tokens;
  fill_throughput(m, secs);
  if (attn_res_tables_) gather_attn_res_bytes(m);
  return m;
}


std::vector<data::TokenBatch> Trainer::next_batches(int64_t& global_tokens) {
  const int64_t accum = cfg_.get_int("training.gradient_accumulation_steps");
  std::vector<data::TokenBatch> batches;
  int64_t local_tokens = 0;
  for (int64_t a = 0; a < accum; ++a) {
    batches.push_back(sampler_->next());
    local_tokens += (batches.back().targets != -100).sum().item<int64_t>();
  }
  std::vector<double> counts{static_cast<double>(local_tokens)};
  sum_over(mesh_ ? &mesh_->dp_group() : nullptr, counts, "token counts");
  global_tokens = static_cast<int64_t>(counts[0]);
  return batches;
}

double Trainer::forward_backward(const std::vector<data::TokenBatch>& batches, double scale,
                                 std::vector<at::Tensor>& pending_losses) {
  for (auto& p : parts_) p->train();
  double loss_sum = 0.0;
  for (size_t a = 0; a < batches.size(); ++a) {
    const auto& batch = batches[a];
    RECORD_USER_SCOPE("viaduct::forward_backward");
    auto mbs = data::split_microbatches(batch, num_microbatches());
    if (executor_) {
      // Note [Overlapped data-parallel reduction]: a stage's gradients are
      // final after its last backward of the last accumulated batch only.
      if (grad_reduction_ && a + 1 == batches.size()) {
        executor_->set_grads_ready([this](int64_t stage) { grad_reduction_->stage_ready(stage); });
      } else {
        executor_->set_grads_ready(nullptr);
      }
      std::vector<at::Tensor> in, tgt;
      for (const auto& mb : mbs) {
        in.push_back(mb.inputs);
        tgt.push_back(mb.targets);
      }
      loss_sum += executor_->run_step(in, tgt, scale);
    } else {
      // Note [No sync between forward and backward]: the loss is read once
      // every backward and the gradient norm are queued; reading it in
      // between stalls the device while the host starts the backward.
      for (const auto& mb : mbs) {
        auto loss = forward_loss(mb.inputs, mb.targets);
        (loss * scale).backward();
        pending_losses.push_back(loss.detach());
      }
    }
  }
  return loss_sum;
}

at::Tensor Trainer::forward_loss(const at::Tensor& inputs,
                                 const at::Tensor& targets) {
  Activations acts{to_device_async(inputs, device_)};
  for (size_t i = 0; i + 1 < parts_.size(); ++i) acts = parts_[i]->forward(acts);
  return parts_.back()->forward_loss(acts, to_device_async(targets, device_));
}

void Trainer::reduce_grads_over_dp(StepMetrics& m) {
  if (!grad_reduction_) return;
  // Note [Overlapped data-parallel reduction]: the buckets whose stages
  // finished early are summing already.
  const auto t0 = std::chrono::steady_clock::now();
  m.dp_buckets_overlapped = grad_reduction_->finish(step_context());
  if (expert_reduction_) expert_reduction_->finish(step_context());
  m.dp_reduce_wait_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  m.dp_buckets = static_cast<int64_t>(grad_reduction_->num_buckets());
  m.dp_bytes = grad_reduction_->last_step_bytes() +
               (expert_reduction_ ? expert_reduction_->last_step_bytes() : 0);
}

std::optional<double> Trainer::step_with_device_clip(
    double lr, double max_norm, const std::vector<at::Tensor>& pending_losses,
    double& loss_sum) {
  // Note [Clip coefficient on the device] (kernels/clip.cu): where
  // this process holds every parameter and AdamW's CUDA kernel runs, the
  // norm and the clip coefficient are formed on the device and the update
  // is queued before the host reads the norm and the losses, which wait for
  // the norm only. The update has the host path's bits; a norm that is not
  // finite updates nothing, and train_step's check raises the error.
  std::optional<ops::DeviceClip> device_clip;
  // A ZeRO-1 replica holds only its ranges' sums, and its norm needs a sum
  // over dp first (Note [Gradient norm in shard pieces]): the host path; so
  // does a rank holding a share of the experts.
  if ((!mesh_ || mesh_->pp() == 1) && !shards_optimizer() && !expert_reduction_ &&
      optimizer_->takes_device_scale()) {
    std::vector<at::Tensor> grads;
    if (grad_reduction_) {
      for (auto& piece : grad_reduction_->norm_pieces()) grads.push_back(std::move(piece.grad));
    } else {
      grads = defined_grads(optimizer_->params());
    }
    if (ops::clip_on_device_takes(grads, kernel_options(cfg_))) {
      RECORD_USER_SCOPE("viaduct::optimizer");
      device_clip = ops::clip_on_device(grads, max_norm, pending_losses);
      optimizer_->step_device_scaled(lr, device_clip->scale);
      optimizer_->zero_grad();
    }
  }
  if (!device_clip) return std::nullopt;
  RECORD_USER_SCOPE("viaduct::grad_norm");
  const auto v = device_clip->fetch();  // [norm, the losses in order]
  for (size_t i = 1; i < v.size(); ++i) loss_sum += v[i];
  return v[0];
}

double Trainer::host_grad_norm(const std::vector<at::Tensor>& pending_losses,
                               double& loss_sum) {
  double norm = 0.0;
  {
    RECORD_USER_SCOPE("viaduct::grad_norm");
    norm = global_grad_norm();
  }
  // Read after the norm's launches (Note [No sync between forward and
  // backward]); the norm's host copy has waited for the device already.
  for (const auto& l : pending_losses) loss_sum += l.item<double>();
  return norm;
}

double Trainer::global_grad_norm() {
  // Per-parameter squared norms placed at their global FQN index, summed over
  // the pp group (each slot has one non-zero contributor: exact), then added
  // in global order: every layout gets the same bits. With dp > 1 each
  // parameter has a slot per replica (Note [Gradient norm in shard pieces]).
  const bool pp1 = !mesh_ || mesh_->pp() == 1;
  const auto& params = optimizer_->params();
  // The global index of each of this rank's parameters.
  std::vector<size_t> global(params.size());
  if (pp1) {
    for (size_t k = 0; k < global.size(); ++k) global[k] = k;
  } else {
    size_t k = 0;
    for (size_t p = 0; p < parts_.size(); ++p) {
      const auto n = parts_[p]->parameters().size();
      for (size_t j = 0; j < n; ++j, ++k) global[k] = static_cast<size_t>(param_offsets_[p]) + j;
    }
  }
  const size_t slots = pp1 ? params.size() : static_cast<size_t>(total_param_tensors_);
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
    // contributor in the dp group (Note [Expert ranges and the clip norm]).
    const size_t dense = pieces.size();
    if (expert_reduction_) {
      for (auto& piece : expert_reduction_->norm_pieces()) pieces.push_back(std::move(piece));
    }
    std::vector<at::Tensor> grads;
    for (const auto& piece : pieces) grads.push_back(piece.grad);
    const auto sq = squared_norms(grads);
    all.assign(slots * dp, 0.0);
    std::vector<double> owned(shards_optimizer() || !expert_reduction_ ? 0 : slots * dp, 0.0);
    for (size_t k = 0; k < pieces.size(); ++k) {
      auto& dest = k < dense || owned.empty() ? all : owned;
      dest[global[pieces[k].slot / dp] * dp + pieces[k].slot % dp] = sq[k];
    }
    if (shards_optimizer()) sum_over(&mesh_->dp_group(), all, "gradient norms");
    if (!owned.empty()) {
      sum_over(&mesh_->dp_group(), owned, "expert gradient norms");
      for (size_t k = 0; k < all.size(); ++k) all[k] += owned[k];
    }
  }
  if (!pp1) sum_over(&mesh_->pp_group(), all, "gradient norms");
  return total_norm(all);
}

double Trainer::gather_loss_and_pipeline_metrics(double loss_sum, StepMetrics& m) {
  // The loss lives on the last stage's rank; one sum over pp gathers it with
  // each pp rank's pipeline times (when timed) and memory peak (pp > 1). The
  // device has finished the pipeline's work here (the norm was read).
  StepGatherLayout layout;
  layout.pp = static_cast<size_t>(plan_->split.pp);
  layout.pp_rank = static_cast<size_t>(pp_rank_);
  layout.timed = executor_ && executor_->timing();
  layout.per_rank_memory = mesh_ && layout.pp > 1;
  pipeline::PipelineTimes times;
  if (layout.timed) times = executor_->take_times();
  auto gathered = layout.pack(loss_sum, times,
                              layout.per_rank_memory ? peak_memory_bytes(device_) : 0.0);
  // Note [Save and exit on a signal]: the ranks' stop requests ride along
  // (a separate element: the loss's sum is unchanged); pp then dp covers
  // the mesh.
  gathered.push_back(stop_signal() != 0 ? 1.0 : 0.0);
  sum_over(mesh_ ? &mesh_->pp_group() : nullptr, gathered,
           layout.timed ? "the loss and pipeline times" : "the loss");
  std::vector<double> loss{gathered[0], gathered.back()};
  sum_over(mesh_ ? &mesh_->dp_group() : nullptr, loss, "the loss");
  gathered.pop_back();
  layout.unpack(gathered, times, m);
  stop_requested_ = loss[1] > 0;
  return loss[0];
}

void Trainer::gather_attn_res_bytes(StepMetrics& m) {
  // Each rank knows its own sends and store: one sum over pp gathers them.
  const int64_t stages = plan_->split.num_stages;
  auto v = pack_attn_res_bytes(*executor_, *attn_res_store_, stages, plan_->split.pp, pp_rank_);
  sum_over(mesh_ ? &mesh_->pp_group() : nullptr, v, "pipeline byte counts");
  unpack_attn_res_bytes(v, stages, m);
}

at::Tensor Trainer::snapshot_moe_counts() {
  // Per layer: the experts' counts, then the dropped copies (Note [Expert
  // capacity], model/moe.h); reset for the next step.
  std::vector<at::Tensor> counts;
  for (const auto& ref : moe_layers_) {
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
  moe_counts_ready_ = std::make_unique<c10::Event>(device_.type());
  moe_counts_ready_->record(c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_));
  return host;
}

void Trainer::gather_moe_metrics(const at::Tensor& counts, StepMetrics& m) {
  if (moe_counts_ready_) {
    // (LibTorch 1.13's c10::Event has no synchronize; the copy is short.)
    while (!moe_counts_ready_->query()) std::this_thread::yield();
    moe_counts_ready_.reset();
  }
  const auto& refs = moe_layers_;
  const int64_t E = moe_experts_;
  // Every layer's counts summed over the replicas, then each layer's
  // largest load over the mean, gathered over the pipeline ranks (one
  // contributor per layer); the dropped copies ride in the last slot.
  std::vector<double> loads(static_cast<size_t>(n_layers_ * E + 1), 0.0);
  const auto c = counts.defined() ? counts.to(at::kDouble).contiguous() : at::zeros({0}, at::kDouble);
  const auto* v = c.data_ptr<double>();
  for (size_t k = 0; k < refs.size(); ++k) {
    const auto* row = v + static_cast<int64_t>(k) * (E + 1);
    std::copy(row, row + E, loads.begin() + refs[k].layer * E);
    loads.back() += row[E];
  }
  sum_over(mesh_ ? &mesh_->dp_group() : nullptr, loads, "MoE expert loads");
  std::vector<double> ratio(static_cast<size_t>(n_layers_), 0.0);
  for (const auto& ref : refs) {
    const auto first = loads.begin() + ref.layer * E;
    const double total = std::accumulate(first, first + E, 0.0);
    if (total > 0) {
      ratio[static_cast<size_t>(ref.layer)] =
          *std::max_element(first, first + E) / (total / static_cast<double>(E));
    }
  }
  ratio.push_back(loads.back());
  sum_over(mesh_ ? &mesh_->pp_group() : nullptr, ratio, "MoE load imbalance");
  if (cfg_.get_float("model.moe_capacity_factor") > 0) m.moe_dropped_tokens = ratio.back();
  ratio.pop_back();
  m.moe_load_max_over_mean = std::move(ratio);
  if (!expert_stats_) return;
  // The copies each rank of the logging rank's ep group received.
  std::vector<double> received(static_cast<size_t>(ep_size_), 0.0);
  for (const auto& ref : refs) {
    received[static_cast<size_t>(mesh_->ep_rank())] += static_cast<double>(ref.moe->tokens_received);
    ref.moe->tokens_received = 0;
  }
  sum_over(mesh_->ep_group(), received, "expert tokens received");
  m.ep_tokens_received_per_rank = std::move(received);
  m.ep_alltoall_bytes = expert_stats_->bytes_sent;
  m.ep_alltoall_seconds = expert_stats_->seconds;
  *expert_stats_ = ExpertExchangeStats{};
}

void Trainer::sync_replica_statistics() {
  if (!mesh_ || dp_size_ == 1) return;
  for (auto& p : parts_) {
    for (auto& stat : p->replica_statistics()) {
      std::vector<at::Tensor> one{stat};
      mesh_->dp_group().allreduce(one).wait(
          str("rank ", rank(), " step ", step_ + 1, " all-reduce of model statistics"));
    }
  }
}

void Trainer::fill_throughput(StepMetrics& m, double seconds) const {
  m.seconds = seconds;
  m.tokens_per_sec = static_cast<double>(m.tokens) / seconds;
  if (auto peak = peak_flops(device_, compute_dtype_)) {
    // Every rank's device counts toward the peak.
    const int world = mesh_ ? mesh_->world_size() : 1;
    m.mfu = flops_per_token_ * m.tokens_per_sec / (*peak * world);
  }
  m.peak_memory_bytes = peak_memory_bytes(device_);
  m.p2p_bytes = executor_ ? executor_->last_step_p2p_bytes() : 0;
}

// ---- eval, checkpoints, the job ---------------------------------------------

double Trainer::evaluate() {
  if (!eval_loader_ || eval_loader_->num_batches() == 0) return std::nan("");
  torch::NoGradGuard no_grad;
  for (auto& p : parts_) p->eval();
  std::vector<double> sums{0.0, 0.0};  // loss, tokens
  for (const auto& b : eval_loader_->batches()) {
    if (executor_) {
      std::vector<at::Tensor> in, tgt;
      for (const auto& mb : data::split_microbatches(b, num_microbatches())) {
        in.push_back(mb.inputs);
        tgt.push_back(mb.targets);
      }
      sums[0] += executor_->run_eval(in, tgt);
    } else {
      // The same micro-batches as training and the pipeline, so eval losses
      // agree bitwise across layouts.
      for (const auto& mb : data::split_microbatches(b, num_microbatches())) {
        sums[0] += forward_loss(mb.inputs, mb.targets).item<double>();
      }
    }
    sums[1] += static_cast<double>((b.targets != -100).sum().item<int64_t>());
  }
  std::vector<double> loss{sums[0]};
  sum_over(mesh_ ? &mesh_->pp_group() : nullptr, loss, "the eval loss");
  sums[0] = loss[0];
  sum_over(mesh_ ? &mesh_->dp_group() : nullptr, sums, "the eval loss");
  return sums[0] / sums[1];
}

void Trainer::save_checkpoint() {
  metrics_->flush();  // the log reaches the disk no later than the checkpoint
  const auto meta = training_state_metadata(
      {step_, tokens_seen_}, *sampler_, *optimizer_, cfg_.to_toml(),
      {{"pp", plan_->split.pp},
       {"dp", dp_size_},
       {"stages", plan_->split.num_stages},
       {"dp_shard_optimizer", shards_optimizer()},
       {"ep", ep_size_}});
  const int optim_dp = shards_optimizer() ? dp_size_ : 1;
  checkpointer_->save(meta,
                      training_state_parts(parts_, *optimizer_, pp_rank_,
                                           static_cast<int>(plan_->split.pp), dp_rank_, optim_dp),
                      expert_shards_);
}

void Trainer::check_checkpoint_matches_model(const checkpoint::Checkpoint& ckpt) const {
  // Every checkpoint tensor must belong to a module of this model: a model
  // with fewer layers would otherwise drop the others without a word
  // (shapes and missing tensors are checked as the tensors load).
  const auto modules = model_module_fqns(cfg_);
  std::vector<std::string> strays;
  for (const auto& name : ckpt.tensors.names()) {
    if (name.rfind("optim.", 0) == 0) continue;
    bool owned = false;
    for (const auto& m : modules) {
      owned = owned || name == m || name.rfind(m + ".", 0) == 0;
    }
    if (!owned) strays.push_back(name);
  }
  std::string differences;
  try {
    const auto saved = Config::parse(ckpt.metadata.config_toml, ckpt.dir.string());
    const auto was = describe_model(saved);
    const auto now = describe_model(cfg_);
    if (was.family != now.family || was.n_layers != now.n_layers || was.params != now.params) {
      differences = str("; the checkpoint's model is ", was.family, "/", was.flavor, " with ",
                        was.n_layers, " layers and ", was.params, " parameters, this config's ",
                        now.family, "/", now.flavor, " with ", now.n_layers, " layers and ",
                        now.params, " parameters");
      for (const auto& k : config_schema()) {
        if (k.section != "model" || k.type != ConfigType::kInt) continue;
        const auto a = saved.get_int_opt(k.dotted());
        const auto b = cfg_.get_int_opt(k.dotted());
        if (a == b) continue;
        differences += str("; ", k.dotted(), " = ", a ? str(*a) : std::string("(flavor)"),
                           " in the checkpoint, ", b ? str(*b) : std::string("(flavor)"),
                           " now (from ", cfg_.source(k.dotted()), ")");
      }
    }
  } catch (const Error&) {
    // A checkpoint of an older config vocabulary: the tensors decide alone.
  }
  if (strays.empty() && differences.empty()) return;
  std::string stray_text;
  for (size_t i = 0; i < strays.size() && i < 4; ++i) {
    stray_text += str(i ? ", " : "", strays[i]);
  }
  if (strays.size() > 4) stray_text += str(" and ", strays.size() - 4, " more");
  throw ConfigError(str(
      "cannot resume from ", ckpt.dir.string(), ": it holds a different model than this config",
      differences.empty() ? "" : differences,
      strays.empty() ? "" : str("; tensors this model has no place for: ", stray_text),
      ". Resume with the checkpoint's model settings, or start a new run in another "
      "job.dump_folder (or with checkpoint.resume = false)"));
}

bool Trainer::warm_start() {
  if (cfg_.get_string("checkpoint.initial_load_path").empty()) return false;
  const auto progress =
      viaduct::warm_start(cfg_, parts_, *optimizer_, *sampler_,
                          mesh_ ? checkpoint::Verify::kSizes : checkpoint::Verify::kChecksums);
  step_ = progress.step;
  tokens_seen_ = progress.tokens_seen;
  return true;
}

bool Trainer::resume_loads_optimizer(const checkpoint::Checkpoint& ckpt) const {
  // A checkpoint of another optimizer holds state this one cannot take (or
  // none that it needs): dropping it is the user's call, never silent.
  std::string saved;
  try {
    saved = Config::parse(ckpt.metadata.config_toml, ckpt.dir.string()).get_string("optimizer.name");
  } catch (const Error&) {
    return true;  // an older config vocabulary: the tensors decide as they load
  }
  const std::string now = cfg_.get_string("optimizer.name");
  if (saved == now) return true;
  size_t state_tensors = 0;
  for (const auto& name : ckpt.tensors.names()) state_tensors += name.rfind("optim.", 0) == 0;
  const std::string dropped =
      state_tensors > 0 ? str("its ", saved, " state (", state_tensors, " optim.* tensors)")
                        : str("its ", saved, " step count");
  VIADUCT_CHECK_T(ConfigError, cfg_.get_bool("checkpoint.resume_with_new_optimizer"),
                  "cannot resume from ", ckpt.dir.string(), ": it was saved with optimizer.name = ",
                  saved, ", this config has ", now, " (from ", cfg_.source("optimizer.name"),
                  "), and ", dropped, " would be dropped. Resume with optimizer.name = ", saved,
                  ", or set checkpoint.resume_with_new_optimizer = true to start ", now,
                  " fresh from the checkpoint's weights");
  if (rank() == 0) {
    log::warn("resuming ", ckpt.dir.string(), " (saved with optimizer.name = ", saved, ") with ",
              now, ": ", dropped, " is dropped and ", now, " starts fresh "
              "(checkpoint.resume_with_new_optimizer = true)");
  }
  return false;
}

bool Trainer::resume() {
  const auto latest = checkpointer_->manager().resume_step();
  if (!latest) return false;
  // Under pipeline parallelism each rank reads only its own tensors; their
  // per-tensor CRCs are still checked as they are read.
  const auto ckpt = checkpointer_->manager().open(*latest, mesh_ ? checkpoint::Verify::kSizes
                                                      : checkpoint::Verify::kChecksums);
  check_checkpoint_matches_model(ckpt);
  const auto progress =
      load_training_state(ckpt, parts_, *optimizer_, *sampler_, resume_loads_optimizer(ckpt));
  step_ = progress.step;
  tokens_seen_ = progress.tokens_seen;
  log::info("resumed from ", ckpt.dir.string(), " at step ", step_);
  return true;
}

StepMetrics Trainer::run() {
  const auto& policy = checkpointer_->manager().policy();
  const bool resumed = policy.enable && policy.resume && resume();
  // A restart resumes from the run's own checkpoint, never the warm start's.
  if (!resumed) warm_start();
  if (!resumed && step_ == 0 && checkpointer_->manager().initial_save_due()) {
    save_checkpoint();  // step-0: the initial weights (for reference runs)
  }
  metrics_->truncate_after(step_);
  const int64_t total = cfg_.get_int("training.steps");
  const int64_t eval_every = cfg_.get_int("training.eval_interval");
  const bool can_eval = eval_loader_ && eval_loader_->num_batches() > 0;
  if (!can_eval && eval_every > 0) {
    if (cfg_.get_string_list("data.paths").empty()) {
      log::warn("no held-out data (", data::val_path_for(cfg_.get_string("data.path")),
                " missing, data.val_path unset): eval is off");
    } else {
      log::warn("no held-out data (no data.paths entry is a file with a <stem>.val<.ext> "
                "beside it, data.val_path unset): eval is off");
    }
  }
  if (can_eval && eval_every > 0 && step_ == 0) metrics_->log_eval(step_, evaluate());
  StepMetrics last;
  reset_peak_memory(device_);
  const int64_t profile_step = cfg_.get_int("metrics.profile_step");
  const bool profile_host_ops = cfg_.get_bool("metrics.profile_host_ops");
  VIADUCT_CHECK_T(ConfigError, profile_step == 0 || profile_host_ops || device_.is_cuda(),
                  "metrics.profile_host_ops = false records device kernels only, but "
                  "training.device is ", device_, ": nothing would be profiled");
  while (step_ < total) {
    if (step_ + 1 == profile_step) {
      // Note [Profiling one step]: the step's host ops and device kernels,
      // between two device synchronisations so nothing earlier or later
      // leaks in; each rank writes its own trace.
      synchronize(device_);
      StepProfiler profiler(device_, profile_host_ops);
      last = train_step();
      synchronize(device_);
      const auto path = (fs::path(cfg_.get_string("job.dump_folder")) / "profile" /
                         str("step-", step_, "-rank-", rank(), ".trace.json"))
                            .string();
      profiler.save(path);
      log::info("profile of step ", step_, " written to ", path,
                " (summary: python3 reference/profile_summary.py ", path, ")");
    } else {
      last = train_step();
    }
    // Note [One trainer per dump folder]: a folder removed under the run
    // stops it.
    for (const auto& lock : folder_locks_) lock->check_still_there();
    metrics_->log_step(last);
    if (can_eval && eval_every > 0 && (step_ % eval_every == 0 || step_ == total)) {
      metrics_->log_eval(step_, evaluate());
    }
    const bool saved = checkpointer_->manager().save_due(step_, total);
    if (saved) save_checkpoint();
    if (stop_requested_ && step_ < total) {
      stop_on_signal(saved);
      break;
    }
  }
  metrics_->flush();
  checkpointer_->wait();
  if (cfg_.get_bool("checkpoint.last_save_in_hf") && step_ == total && !stopped_on_signal_) {
    write_final_hf();
  }
  write_report();
  return last;
}

void Trainer::write_final_hf() const {
  if (rank() != 0) return;
  const fs::path folder = hf_export_folder(cfg_, step_);
  if (fs::exists(folder)) {
    log::info("the final weights' Hugging Face folder ", folder.string(), " is already there");
    return;
  }
  checkpoint::TensorMap tensors;
  if (!mesh_) {
    for (const auto& part : parts_) {
      for (const auto& p : part->named_parameters()) {
        tensors[p.key()] = p.value().detach().to(at::kCPU).contiguous();
      }
    }
  } else {
    // Every rank's weights are in the final checkpoint, which every rank
    // has finished with (the save's last barrier).
    const auto ckpt = checkpointer_->manager().open(step_, checkpoint::Verify::kSizes);
    for (const auto& name : ckpt.tensors.names()) {
      if (name.rfind("optim.", 0) != 0) tensors[name] = ckpt.tensors.load(name);
    }
  }
  write_hf_export(cfg_, folder, tensors);
  log::info("final weights as a Hugging Face model: ", folder.string());
}

void Trainer::write_report() const {
  // The run report beside metrics.jsonl (train/report.h); a run that trained
  // is not failed by its picture, but a report that cannot be written says so.
  if (!is_logging_rank() || !cfg_.get_bool("metrics.enable_jsonl")) return;
  const fs::path dump = cfg_.get_string("job.dump_folder");
  const std::string description = cfg_.get_string("job.description");
  const std::string title = description.empty() ? dump.string() : description;
  try {
    const std::string svg = pipeline::timeline_svg(
        plan_->lowered, plan_->simulation,
        str(plan_->compute.name, ": pp ", plan_->split.pp, ", ", plan_->split.stages_per_rank,
            " stage(s) per rank, ", plan_->compute.microbatches, " micro-batches"));
    atomic_write_file(dump / "schedule.svg", svg);
    const auto path = write_run_report(dump, title, svg);
    log::info("run report: ", path.string());
  } catch (const std::exception& e) {
    log::warn("cannot write the run report: ", e.what());
  }
}

void Trainer::stop_on_signal(bool saved_this_step) {
  // Note [Save and exit on a signal].
  stopped_on_signal_ = true;
  if (!checkpointer_->manager().policy().enable) {
    log::warn("stopping at step ", step_, " on a signal; checkpoint.enable = false, so "
              "nothing is saved");
    return;
  }
  if (!saved_this_step) save_checkpoint();
  checkpointer_->wait();
  log::info("stopped at step ", step_, " on a signal after saving ",
            checkpoint::checkpoint_dir(checkpoint_folder(), step_).string(),
            "; the next run resumes from it");
}

}  // namespace viaduct
