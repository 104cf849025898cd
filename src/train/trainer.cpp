#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <filesystem>

#include "checkpoint/manager.h"
#include "core/check.h"
#include "core/device.h"
#include "core/profiler.h"
#include "core/log.h"
#include "distributed/distributed.h"
#include "model/family.h"
#include "pipeline/attn_res/block_store.h"
#include "pipeline/runtime/executor.h"
#include "pipeline/schedule/plan.h"
#include "train/checkpointer.h"
#include "train/moe_metrics.h"
#include "train/optimizer_step.h"
#include "train/resume_checks.h"
#include "train/fault_injection.h"
#include "train/fresh_run.h"
#include "train/memory_estimate.h"
#include "train/pipeline_metrics.h"
#include "train/preemption.h"
#include "train/process.h"
#include "train/rank_model.h"
#include "train/step_graph.h"
#include "train/reduce.h"
#include "train/report.h"
#include "train/train_state.h"
#include "train/training_data.h"
#include "train/warm_start.h"

namespace viaduct {
namespace fs = std::filesystem;

// ---- setup -----------------------------------------------------------------

Trainer::Trainer(JobConfig job) : job_(std::move(job)), device_(at::kCPU) {
  auto process = init_process(job_);
  mesh_ = std::move(process.mesh);
  device_ = process.device;
  compute_dtype_ = process.compute_dtype;
  pp_rank_ = process.pp_rank;
  dp_rank_ = process.dp_rank;
  dp_size_ = process.dp_size;
  capabilities_ = process.capabilities;
  // See Note [The step as one CUDA graph] (train/step_graph.h); the config
  // refused pp, dp and block_causal already where the key is true.
  const bool graphs_required = job_.training.cuda_graphs.value_or(false);
  VIADUCT_CHECK_T(ConfigError, !graphs_required || device_.is_cuda(),
                  "training.cuda_graphs = true needs a CUDA device, but this run trains on ",
                  device_, " (training.device = \"", job_.training.device,
                  "\"); set training.cuda_graphs = false");
  // checkpoint.last_save_in_hf: a missing data.tokenizer fails before
  // anything is written.
  if (job_.checkpoint.last_save_in_hf && rank() == 0) {
    hf_export_tokenizer_files(job_);
  }
  if (rank() == 0) folder_locks_ = lock_run_folders(job_);
  check_memory_fits();
  data_ = std::make_unique<TrainingData>(job_, dp_rank_, dp_size_);
  if (job_.checkpoint.last_save_in_hf) {
    state_dict_adapter(job_);  // a family without an HF layout fails before training
    if (rank() == 0) data_->hint_export_tokenizer();
    VIADUCT_CHECK_T(ConfigError,
                    !mesh_ || (job_.checkpoint.enable &&
                               job_.checkpoint.save_final),
                    "checkpoint.last_save_in_hf under a launcher needs checkpoint.enable = "
                    "true and checkpoint.save_final = true: the export reads the final "
                    "checkpoint");
  }
  info_ = build_model();
  // What keeps this run from the step graph ("" when nothing does): true
  // refuses the run naming it, unset runs eager steps.
  std::string graph_blocker;
  if (!device_.is_cuda()) {
    graph_blocker = "needs a CUDA device";
  } else if (executor_ || mesh_) {
    graph_blocker = str("runs one process holding one stage, but this run has ",
                        plan_->split.num_stages, " pipeline stages",
                        mesh_ ? " under a launcher" : "");
  } else if (!update_->updates_on_device()) {
    graph_blocker = str("needs the clip and the update on the device (optimizer.name = "
                        "\"AdamW\" on viaduct's CUDA kernel), but optimizer.name = \"",
                        job_.optimizer.name, "\"");
  } else if (job_.model.block_causal()) {
    graph_blocker = "needs the same shapes every step, but model.attn_mask_type = \"block_causal\"";
  }
  VIADUCT_CHECK_T(ConfigError, !graphs_required || graph_blocker.empty(),
                  "training.cuda_graphs = true ", graph_blocker,
                  "; set training.cuda_graphs = false");
  // Unset, the graph where the run allows it, and not in a run that
  // profiles a step (a profile names the host op behind each kernel, which
  // a replay has none of). What only the warm-up steps show (images in the
  // data, gradients the device clip cannot take) drops it before the
  // capture (graph_unfit_).
  if (graph_blocker.empty() &&
      (graphs_required ||
       (!job_.training.cuda_graphs.has_value() && job_.metrics.profile_step == 0))) {
    step_graph_ = std::make_unique<StepGraph>(device_);
  }
  data_->cut_eval_batches(num_microbatches());
  if (executor_) {
    // Boundary shapes from one forward-only micro-batch (see Note [Boundary metadata]).
    const auto& so = data_->options();
    executor_->infer_metadata(at::zeros({so.batch_size / num_microbatches(), so.seq_len}, at::kLong));
  }
  gather_ = std::make_unique<StepGather>(*plan_, pp_rank_, mesh_.get(), executor_.get(),
                                         attn_res_store_.get(), device_, compute_dtype_,
                                         info_.flops_per_token);
  faults_ = FaultInjection::from_environment();
  CheckpointLayout layout;
  layout.pp = static_cast<int>(plan_->split.pp);
  layout.pp_rank = pp_rank_;
  layout.dp = dp_size_;
  layout.dp_rank = dp_rank_;
  layout.num_stages = plan_->split.num_stages;
  layout.shards_optimizer = update_->shards_optimizer();
  layout.ep = mesh_ ? mesh_->ep() : 1;
  layout.moe = moe_metrics_ != nullptr;
  CheckpointerOptions checkpoint_options;
  checkpoint_options.async = job_.checkpoint.async_mode == "async";
  checkpoint_options.timeout = std::chrono::seconds(job_.parallelism.comm_timeout_seconds);
  checkpoint_options.hold_writes = faults_.slow_save;
  checkpointer_ = std::make_unique<Checkpointer>(checkpoint_folder(),
                                                 checkpoint_policy_from_config(job_.checkpoint), layout,
                                                 checkpoint_options, mesh_.get(), device_);
  auto mo = metrics_options_from_config(job_, is_logging_rank());
  mo.pipeline = executor_ != nullptr;
  mo.attn_res = attn_res_tables_ != nullptr;
  mo.pp_rank = pp_rank_;
  mo.bubble_simulated = plan_->simulation.bubble_fraction;
  if (plan_->simulation_flops) mo.bubble_simulated_flops = plan_->simulation_flops->bubble_fraction;
  for (const auto& e : estimate_memory_per_rank(job_, info_, *plan_, compute_dtype_, device_.is_cuda())) {
    mo.plan_memory_bytes_per_rank.push_back(e.total());
  }
  metrics_ = std::make_unique<MetricsWriter>(std::move(mo));
  log_job_summary(job_, {info_, *plan_, device_, compute_dtype_, capabilities_, dp_size_,
                         num_microbatches(), data_->sampler(), data_->eval_tokens()});
}

void Trainer::check_memory_fits() const {
  // See Note [Activation memory estimate] (train/memory_estimate.h).
  const auto avail = device_memory_bytes(device_);
  if (!avail) return;
  check_rank_memory_fits(job_, pp_rank_, compute_dtype_, device_.is_cuda(), *avail,
                         device_name(device_));
}

ModelInfo Trainer::build_model() {
  auto rm = build_rank_model(job_, pp_rank_, device_, compute_dtype_, capabilities_,
                             mesh_ ? &mesh_->pp_group() : nullptr, step_context(),
                             mesh_ ? mesh_->ep_group() : nullptr);
  plan_ = std::move(rm.plan);
  parts_ = std::move(rm.parts);
  attn_res_tables_ = std::move(rm.attn_res_tables);
  attn_res_store_ = std::move(rm.attn_res_store);
  // Token ids must fit the embedding.
  for (const auto& np : rm.params) {
    if (np.fqn == "tok_embeddings.weight") data_->check_fits_vocab(np.param.size(0));
  }
  OptimizerStepSetup setup;
  setup.parts = &parts_;
  setup.stages = plan_->split.rank_to_stages.at(pp_rank_);
  setup.param_offsets = std::move(rm.param_offsets);
  setup.total_param_tensors = rm.total_param_tensors;
  setup.mesh = mesh_.get();
  setup.kernels = rm.kernel_options;  // the rank's weight cache among them
  loss_grad_scale_ = rm.kernel_options.loss_grad_scale;
  update_ = std::make_unique<OptimizerStep>(job_, std::move(rm.params), std::move(setup));
  if (rm.info.routed_experts > 0) {
    moe_metrics_ = std::make_unique<MoeStepMetrics>(
        parts_, rm.info.n_layers, rm.info.routed_experts, std::move(rm.expert_stats),
        job_.model.moe_capacity_factor > 0, mesh_.get(), device_);
  }
  if (plan_->split.num_stages > 1) {
    executor_ = std::make_unique<pipeline::PipelineExecutor>(
        *plan_, pp_rank_, std::move(rm.stages), mesh_ ? &mesh_->pp_group() : nullptr,
        device_);
    executor_->set_timing(job_.metrics.pipeline_timing);
  }
  return rm.info;
}

Trainer::~Trainer() {
  // A save still being written finishes first (the Checkpointer's
  // destructor logs its error, which run() saw only when it did not fail).
  checkpointer_.reset();
}

int Trainer::rank() const { return mesh_ ? mesh_->rank() : 0; }

const Optimizer& Trainer::optimizer() const { return update_->optimizer(); }

int64_t Trainer::graph_replays() const { return step_graph_ ? step_graph_->replays() : 0; }

int64_t Trainer::num_microbatches() const {
  // One stage: the key alone decides (default 1); else the schedule's count.
  if (!executor_) {
    return job_.parallelism.pipeline_parallel_microbatches.value_or(1);
  }
  return executor_->num_microbatches();
}

std::string Trainer::checkpoint_folder() const { return checkpoint_folder_from_config(job_); }

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
  StepMetrics m;
  if (step_graph_ && !graph_unfit_.empty() && !step_graph_->eager_now() &&
      step_graph_->replays() == 0) {
    log::info("training.cuda_graphs (unset): eager steps, the step graph cannot run here: ",
              graph_unfit_);
    step_graph_.reset();
  }
  // See Note [The step as one CUDA graph]: the step on the graph's stream.
  std::optional<DeviceGraph::StreamScope> on_graph_stream;
  if (step_graph_) on_graph_stream.emplace(step_graph_->stream_scope());
  const auto batches = next_batches(tokens, m);
  // See Note [Loss scaling]: the denominator is the global token count.
  const double scale = 1.0 / static_cast<double>(tokens);
  // What the loss's backward will receive: (loss * scale)'s gradient is
  // scale rounded to fp32, as fill_ rounds it (see Note [The loss's
  // gradient scale known to its forward], ops/options.h). On the step's
  // stream, ahead of the forward (eager or replayed) that reads it.
  if (loss_grad_scale_) loss_grad_scale_->value.fill_(scale);
  std::vector<at::Tensor> pending_losses;
  const ops::DeviceClip* clip = nullptr;  // from the step graph's replay
  if (step_graph_ && !step_graph_->eager_now()) {
    clip = &replay_step_graph(batches, scale);
  } else {
    forward_backward(batches, scale, pending_losses);
    if (step_graph_) step_graph_->eager_step_done();
    if (step_graph_ && !job_.training.cuda_graphs.has_value()) {
      for (const auto& b : batches) {
        if (b.images.defined()) graph_unfit_ = "the data has images, whose tower's work is not captured";
      }
    }
  }
  double loss_sum = 0.0;  // the pending losses', read after the update is queued
  update_->finish_reduction(m, step_context());
  // Queued before the update, read after the norm (train/moe_metrics.h).
  const auto moe_counts = moe_metrics_ ? moe_metrics_->snapshot() : at::Tensor();
  m.lr = lr_at(job_, step_ + 1);
  // See Note [Energy read while the device works] (core/energy.h): before
  // the update's read of the norm waits for the device.
  const auto joules = gather_->read_energy();
  m.grad_norm = clip != nullptr
                    ? update_->step_with_device_clip(m.lr, *clip, loss_sum,
                                                     /*keep_grads=*/true, step_ + 1)
                    : update_->clip_and_step(m.lr, job_.training.max_norm, pending_losses,
                                             loss_sum, step_ + 1, step_context());
  m.device_wait_seconds = update_->last_device_wait_seconds();
  if (step_graph_ && m.device_wait_seconds < 0 && !job_.training.cuda_graphs.has_value()) {
    graph_unfit_ = "the gradient clip runs on the host (it needs fp32 gradients on the GPU and "
                   "model.cuda_kernels = true)";
  }
  m.dp_bytes += update_->optimizer().last_step_bytes();
  RECORD_USER_SCOPE("viaduct::step_end");
  m.loss = gather_->gather_loss(loss_sum, joules, stop_signal() != 0, m, step_context()) /
           static_cast<double>(tokens);
  if (moe_metrics_) moe_metrics_->gather(moe_counts, m, step_context());
  sync_replica_statistics();
  for (auto& p : parts_) p->after_optimizer_step();
  ++step_;
  tokens_seen_ += tokens;
  // Note [Step time without a final sync]
  // The step ends with the optimizer
  // queued, not finished; the next step's host work (data, the first
  // launches) overlaps its device tail, and the reads of the loss and the
  // gradient norm wait for it. A step's time is host time from its start to
  // here, so the steps' times add up to the loop's wall time.
  m.step = step_;
  m.tokens = tokens;
  gather_->fill_throughput(
      m, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  if (attn_res_tables_) gather_->gather_attn_res_bytes(m, step_context());
  return m;
}

std::vector<data::TokenBatch> Trainer::next_batches(int64_t& global_tokens, StepMetrics& m) {
  RECORD_USER_SCOPE("viaduct::next_batches");  // named in profiles, as the step's other host phases
  const int64_t accum = job_.training.gradient_accumulation_steps;
  std::vector<data::TokenBatch> batches;
  // target tokens, windows, document pieces, documents started, the
  // documents' FLOPs.
  // See Note [FLOPs of a step's documents] (model/model.h).
  std::vector<double> counts(5, 0.0);
  for (int64_t a = 0; a < accum; ++a) {
    batches.push_back(data_->next_batch());
    data_->mask_document_starts(batches.back());
    const auto& b = batches.back();
    const auto documents = data_->count_documents(b.inputs);
    counts[0] += static_cast<double>((b.targets != -100).sum().item<int64_t>());
    counts[1] += static_cast<double>(b.inputs.size(0));
    counts[2] += static_cast<double>(documents.pieces);
    counts[3] += static_cast<double>(documents.starts);
    if (documents.documents) counts[4] += training_flops(info_, *documents.documents);
  }
  sum_over(mesh_ ? &mesh_->dp_group() : nullptr, counts, "token counts");
  global_tokens = static_cast<int64_t>(counts[0]);
  if (data_->document_marker().recorded()) {
    m.documents_per_window = counts[2] / counts[1];
    m.mean_document_tokens =
        counts[3] > 0 ? counts[1] * static_cast<double>(job_.training.seq_len) / counts[3] : 0.0;
    m.flops = counts[4];
  }
  return batches;
}

void Trainer::forward_backward(const std::vector<data::TokenBatch>& batches, double scale,
                               std::vector<at::Tensor>& pending_losses) {
  // Note [No sync between forward and backward]
  // Each micro-batch's loss stays on the device, in pending_losses, and is
  // read once every backward and the gradient norm are queued; reading it in
  // between stalls the device while the host starts the backward. The
  // pipeline executor hands its last stage's losses over the same way.
  for (auto& p : parts_) p->train();
  for (size_t a = 0; a < batches.size(); ++a) {
    const auto& batch = batches[a];
    RECORD_USER_SCOPE("viaduct::forward_backward");
    auto mbs = data::split_microbatches(batch, num_microbatches());
    if (executor_) {
      // See Note [Overlapped data-parallel reduction]: a stage's gradients are
      // final after its last backward of the last accumulated batch only.
      if (update_->reduces_over_dp() && a + 1 == batches.size()) {
        executor_->set_grads_ready([this](int64_t stage) { update_->stage_ready(stage); });
      } else {
        executor_->set_grads_ready(nullptr);
      }
      std::vector<at::Tensor> in, tgt, img;
      for (const auto& mb : mbs) {
        in.push_back(mb.inputs);
        tgt.push_back(mb.targets);
        if (mb.images.defined()) img.push_back(mb.images);
      }
      for (auto& l : executor_->run_step(in, tgt, scale, img, documents_of(mbs))) {
        pending_losses.push_back(std::move(l));
      }
    } else {
      for (const auto& mb : mbs) {
        const auto documents = data_->documents(mb.inputs);
        for (auto& p : parts_) p->set_documents(documents);
        auto loss = forward_loss(mb);
        (loss * scale).backward();
        pending_losses.push_back(loss.detach());
      }
    }
  }
}

const ops::DeviceClip& Trainer::replay_step_graph(const std::vector<data::TokenBatch>& batches,
                                                  double scale) {
  // See Note [The step as one CUDA graph] (train/step_graph.h).
  std::vector<data::TokenBatch> mbs;
  for (const auto& batch : batches) {
    for (auto& mb : data::split_microbatches(batch, num_microbatches())) {
      mbs.push_back(std::move(mb));
    }
  }
  step_graph_->load(mbs, scale);
  // The modules' host flags as an eager step sets them (an eval between
  // steps leaves them in eval mode); the capture below reads them.
  for (auto& p : parts_) {
    p->train();
    p->set_documents(nullptr);
  }
  return step_graph_->run([this] {
    std::vector<at::Tensor> losses;
    for (const auto& mb : step_graph_->microbatches()) {
      RECORD_USER_SCOPE("viaduct::forward_backward");
      auto loss = forward_loss(mb);
      VIADUCT_ASSERT(loss.scalar_type() == at::kFloat, "the step graph scales an fp32 loss, not ",
                     loss.scalar_type());
      (loss * step_graph_->loss_scale()).backward();
      losses.push_back(loss.detach());
    }
    auto clip = update_->device_clip(job_.training.max_norm, losses);
    VIADUCT_CHECK_T(ConfigError, clip.has_value(),
                    "training.cuda_graphs = true: the gradient clip cannot run on the device "
                    "for these gradients (fp32 on the GPU with viaduct's kernels: check "
                    "model.cuda_kernels); set training.cuda_graphs = false");
    return *clip;
  });
}

std::vector<ops::DocumentsPtr> Trainer::documents_of(
    const std::vector<data::TokenBatch>& mbs) const {
  std::vector<ops::DocumentsPtr> out;
  if (!data_->document_marker().recorded()) return out;
  for (const auto& mb : mbs) out.push_back(data_->documents(mb.inputs));
  return out;
}

at::Tensor Trainer::forward_loss(const data::TokenBatch& mb) {
  Activations acts{to_device_async(mb.inputs, device_)};
  if (mb.images.defined()) acts.push_back(to_device_async(mb.images, device_));
  for (size_t i = 0; i + 1 < parts_.size(); ++i) acts = parts_[i]->forward(acts);
  return parts_.back()->forward_loss(acts, to_device_async(mb.targets, device_));
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

// ---- eval, checkpoints, the job ---------------------------------------------

double Trainer::evaluate() {
  if (!data_->can_eval(false)) return std::nan("");
  torch::NoGradGuard no_grad;
  for (auto& p : parts_) p->eval();
  std::vector<double> sums{0.0, 0.0};  // loss, tokens
  for (auto b : data_->eval_loader().batches()) {
    data_->mask_document_starts(b);
    const auto mbs = data::split_microbatches(b, num_microbatches());
    if (executor_) {
      std::vector<at::Tensor> in, tgt, img;
      for (const auto& mb : mbs) {
        in.push_back(mb.inputs);
        tgt.push_back(mb.targets);
        if (mb.images.defined()) img.push_back(mb.images);
      }
      sums[0] += executor_->run_eval(in, tgt, img, documents_of(mbs));
    } else {
      // The same micro-batches as training and the pipeline, so eval losses
      // agree bitwise across layouts.
      for (const auto& mb : mbs) {
        const auto documents = data_->documents(mb.inputs);
        for (auto& p : parts_) p->set_documents(documents);
        sums[0] += forward_loss(mb).item<double>();
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
      {step_, tokens_seen_}, data_->sampler(), update_->optimizer(), job_.to_toml(),
      {{"pp", plan_->split.pp},
       {"dp", dp_size_},
       {"stages", plan_->split.num_stages},
       {"dp_shard_optimizer", update_->shards_optimizer()},
       {"ep", mesh_ ? mesh_->ep() : 1}});
  const int optim_dp = update_->shards_optimizer() ? dp_size_ : 1;
  checkpointer_->save(meta,
                      training_state_parts(parts_, update_->optimizer(), pp_rank_,
                                           static_cast<int>(plan_->split.pp), dp_rank_, optim_dp),
                      update_->expert_shards());
}

bool Trainer::warm_start() {
  if (job_.checkpoint.initial_load_path.empty()) return false;
  const auto progress =
      viaduct::warm_start(job_, parts_, update_->optimizer(), data_->sampler(),
                          mesh_ ? checkpoint::Verify::kSizes : checkpoint::Verify::kChecksums);
  step_ = progress.step;
  tokens_seen_ = progress.tokens_seen;
  return true;
}

bool Trainer::resume() {
  const auto latest = checkpointer_->manager().resume_step();
  if (!latest) return false;
  // Under pipeline parallelism each rank reads only its own tensors; their
  // per-tensor CRCs are still checked as they are read.
  const auto ckpt = checkpointer_->manager().open(*latest, mesh_ ? checkpoint::Verify::kSizes
                                                      : checkpoint::Verify::kChecksums);
  check_checkpoint_matches_model(job_, ckpt);
  const auto progress =
      load_training_state(ckpt, parts_, update_->optimizer(), data_->sampler(),
                          resume_loads_optimizer(job_, ckpt, rank() == 0));
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
  const int64_t total = job_.training.steps;
  const int64_t eval_every = job_.training.eval_interval;
  const bool can_eval = data_->can_eval(/*warn_if_not=*/eval_every > 0);
  if (can_eval && eval_every > 0 && step_ == 0) metrics_->log_eval(step_, evaluate());
  StepMetrics last;
  reset_peak_memory(device_);
  const int64_t profile_step = job_.metrics.profile_step;
  const bool profile_host_ops = job_.metrics.profile_host_ops;
  VIADUCT_CHECK_T(ConfigError, profile_step == 0 || profile_host_ops || device_.is_cuda(),
                  "metrics.profile_host_ops = false records device kernels only, but "
                  "training.device is ", device_, ": nothing would be profiled");
  while (step_ < total) {
    if (step_ + 1 == profile_step) {
      // Note [Profiling one step]
      // The step's host ops and device kernels,
      // between two device synchronisations so nothing earlier or later
      // leaks in; each rank writes its own trace.
      synchronize(device_);
      StepProfiler profiler(device_, profile_host_ops);
      last = train_step();
      synchronize(device_);
      const auto path = (fs::path(job_.job.dump_folder) / "profile" /
                         str("step-", step_, "-rank-", rank(), ".trace.json"))
                            .string();
      profiler.save(path);
      log::info("profile of step ", step_, " written to ", path,
                " (summary: python3 reference/profile_summary.py ", path, ")");
    } else {
      last = train_step();
    }
    // See Note [One trainer per dump folder]: a folder removed under the run
    // stops it.
    for (const auto& lock : folder_locks_) lock->check_still_there();
    metrics_->log_step(last);
    if (can_eval && eval_every > 0 && (step_ % eval_every == 0 || step_ == total)) {
      metrics_->log_eval(step_, evaluate());
    }
    const bool saved = checkpointer_->manager().save_due(step_, total);
    if (saved) save_checkpoint();
    if (gather_->stop_requested() && step_ < total) {
      stop_on_signal(saved);
      break;
    }
  }
  metrics_->flush();
  checkpointer_->wait();
  if (job_.checkpoint.last_save_in_hf && step_ == total && !stopped_on_signal_) {
    checkpointer_->write_final_hf(job_, step_, parts_);
  }
  write_run_report_at_end(job_, *plan_, is_logging_rank());
  return last;
}

void Trainer::stop_on_signal(bool saved_this_step) {
  // See Note [Save and exit on a signal].
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
