#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpoint/checkpoint.h"
#include "core/check.h"
#include "core/device.h"
#include "core/profiler.h"
#include "core/log.h"
#include "core/torch_compat.h"
#include "data/sampler.h"
#include "data/token_file.h"
#include "dist/dist.h"
#include "ops/clip.h"
#include "kernels/weight_cache.h"
#include "model/kimi_k3.h"
#include "pipeline/attn_res/attn_res_stage.h"
#include "pipeline/runtime/executor.h"
#include "pipeline/schedule/plan.h"
#include "pipeline/schedule/plan_config.h"

namespace viaduct {
namespace fs = std::filesystem;

namespace {

at::ScalarType resolve_dtype(const std::string& name, const at::Device& dev) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  return dev.is_cuda() ? at::kBFloat16 : at::kFloat;  // auto
}

std::string human_bytes(double b) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2) << b / (1024.0 * 1024 * 1024) << " GiB";
  return os.str();
}

double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
}

// Enough digits to round-trip a float32 (and more than enough for display).
std::string float_repr(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

}  // namespace

Trainer::Trainer(Config cfg) : cfg_(std::move(cfg)), device_(at::kCPU) {
  const auto lvl = cfg_.get_string("job.log_level");
  log::set_level(lvl == "debug"     ? log::Level::kDebug
                 : lvl == "warning" ? log::Level::kWarn
                 : lvl == "error"   ? log::Level::kError
                                    : log::Level::kInfo);
  // The same thread count whether launched or run alone (determinism).
  at::set_num_threads(static_cast<int>(cfg_.get_int("training.num_threads")));

  // Where this process sits: pp x dp ranks over c10d, or one process.
  const auto rdv = dist::rendezvous_from_env();
  const int pp = static_cast<int>(cfg_.get_int("parallelism.pipeline_parallel_degree"));
  const int dp = static_cast<int>(cfg_.get_int("parallelism.data_parallel_degree"));
  VIADUCT_CHECK_T(ConfigError, pp * dp == rdv.world_size,
                  "parallelism.pipeline_parallel_degree (", pp,
                  ") x parallelism.data_parallel_degree (", dp, ") = ", pp * dp,
                  " ranks, but WORLD_SIZE is ", rdv.world_size,
                  rdv.world_size == 1
                      ? str("; start the ranks with `viaduct launch --nproc-per-node ",
                            pp * dp, " -- viaduct train ...`")
                      : std::string());
  if (cfg_.get_bool("training.deterministic")) {
    // cuBLAS needs a fixed workspace for reproducible results; it must be set
    // before the first cuBLAS handle exists.
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  }
  device_ = resolve_device(cfg_.get_string("training.device"), rdv.local_rank);
  if (rdv.world_size > 1) {
    const auto timeout =
        std::chrono::seconds(cfg_.get_int("parallelism.comm_timeout_seconds"));
    mesh_ = dist::init_mesh(rdv, pp, dp, device_,
                            std::chrono::duration_cast<std::chrono::milliseconds>(timeout));
    pp_rank_ = mesh_->pp_rank();
    dp_rank_ = mesh_->dp_rank();
    dp_size_ = mesh_->dp();
    if (rdv.rank != 0 && log::level() < log::Level::kWarn) {
      log::set_level(log::Level::kWarn);  // rank 0 reports for the job
    }
  }
  compute_dtype_ = resolve_dtype(cfg_.get_string("training.dtype"), device_);

  const auto path = cfg_.get_string("data.path");
  const auto format = cfg_.get_string("data.format");
  train_tokens_ = data::open_token_stream(path, format);
  const auto val = data::resolve_val_path(path, cfg_.get_string("data.val_path"));
  if (!val.empty()) eval_tokens_ = data::open_token_stream(val, format);

  // The pipeline plan (a pure function of the config: every rank agrees).
  const auto info = describe_model(cfg_);
  auto plan_spec = pipeline::plan_spec_from_config(cfg_, model_module_fqns(cfg_));
  plan_spec.module_flops = info.module_flops;  // Note [Bubble weighted by FLOPs]
  plan_ = std::make_unique<pipeline::PipelinePlan>(pipeline::make_pipeline_plan(plan_spec));
  const auto& split = plan_->split;
  flops_per_token_ = info.flops_per_token;
  const auto seed = static_cast<uint64_t>(cfg_.get_int("training.seed"));
  std::vector<NamedParam> params;
  std::vector<std::unique_ptr<pipeline::PipelineStage>> stages;
  std::vector<double> counts(static_cast<size_t>(split.num_stages), 0.0);
  if (split.num_stages > 1 && cfg_.get_string("model.family") == "kimi_k3" &&
      kimi_k3_options(cfg_).attn_res) {
    // Note [AttnRes transports] (pipeline/attn_res/block_layout.h). Without
    // AttnRes (model.attn_res = false) kimi_k3 is a chain: plain stages.
    attn_res_tables_ = std::make_shared<const pipeline::BlockLayoutTables>(
        pipeline::make_block_layout_tables(
            split, kimi_k3_options(cfg_).block_size,
            cfg_.get_bool("parallelism.attn_res_cache")
                ? pipeline::AttnResTransport::kRankCache
                : pipeline::AttnResTransport::kWholeStack,
            pipeline::cache_backward_from_name(
                cfg_.get_string("parallelism.attn_res_cache_backward"))));
    attn_res_store_ = std::make_shared<pipeline::RankBlockStore>(
        pp_rank_, *attn_res_tables_, cfg_.get_bool("parallelism.attn_res_cache_offload"));
  }
  for (int64_t s : split.rank_to_stages.at(pp_rank_)) {
    auto part = build_model_part(
        cfg_, split.num_stages == 1 ? std::vector<std::string>{} : split.stage_modules.at(s));
    part->init_weights(seed);
    part->to(device_);
    part->set_compute_dtype(compute_dtype_);
    auto named = named_params_for_training(*part);
    counts[static_cast<size_t>(s)] = static_cast<double>(named.size());
    params.insert(params.end(), named.begin(), named.end());
    parts_.push_back(part);
    stages.push_back(pipeline::make_stage(s, split.num_stages, part, attn_res_tables_,
                                          attn_res_store_));
  }
  // Global FQN order = stage order, then each part's registration order.
  sum_over(mesh_ ? &mesh_->pp_group() : nullptr, counts, "parameter counts");
  std::vector<int64_t> stage_offset(counts.size() + 1, 0);
  for (size_t s = 0; s < counts.size(); ++s)
    stage_offset[s + 1] = stage_offset[s] + static_cast<int64_t>(counts[s]);
  total_param_tensors_ = stage_offset.back();
  for (int64_t s : split.rank_to_stages.at(pp_rank_))
    param_offsets_.push_back(stage_offset[static_cast<size_t>(s)]);

  // Token ids must fit the embedding.
  for (const auto& np : params) {
    if (np.fqn == "tok_embeddings.weight") {
      VIADUCT_CHECK_T(ConfigError, train_tokens_->max_token() < np.param.size(0),
                      "the data ", train_tokens_->describe(), " holds token id ",
                      train_tokens_->max_token(), ", but model.vocab_size is ",
                      np.param.size(0));
    }
  }
  optimizer_ = make_optimizer(cfg_, std::move(params));

  if (split.num_stages > 1) {
    executor_ = std::make_unique<pipeline::PipelineExecutor>(
        *plan_, pp_rank_, std::move(stages), mesh_ ? &mesh_->pp_group() : nullptr,
        device_);
    executor_->set_timing(cfg_.get_bool("metrics.pipeline_timing"));
  }

  data::SamplerOptions so;
  so.batch_size = cfg_.get_int("training.local_batch_size");
  so.seq_len = cfg_.get_int("training.seq_len");
  so.seed = seed;
  so.shuffle = cfg_.get_bool("data.shuffle");
  so.dp_rank = dp_rank_;
  so.dp_size = dp_size_;
  VIADUCT_CHECK_T(ConfigError, so.batch_size % num_microbatches() == 0,
                  "training.local_batch_size (", so.batch_size,
                  ") must be divisible by the ", num_microbatches(),
                  " micro-batches (parallelism.pipeline_parallel_microbatches)");
  sampler_ = std::make_unique<data::TokenSampler>(train_tokens_, so);
  if (eval_tokens_) {
    eval_loader_ = std::make_unique<data::EvalLoader>(
        eval_tokens_, so, cfg_.get_int("data.eval_batches"));
  }
  if (executor_) {
    // Boundary shapes from one forward-only micro-batch (Note [Boundary metadata]).
    auto probe = at::zeros({so.batch_size / num_microbatches(), so.seq_len}, at::kLong);
    executor_->infer_metadata(probe);
  }
  progress_bar_ = cfg_.get_bool("metrics.progress_bar") && isatty(STDOUT_FILENO) &&
                  is_logging_rank();

  log::info("model ", info.family, "/", info.flavor, ": ", info.n_layers,
            " layers, ", info.params, " parameters; device ", device_name(device_),
            ", dtype ", c10::toString(compute_dtype_), ", LibTorch ",
            compat::torch_version(), ", ", at::get_num_threads(), " threads");
  if (device_.is_cuda()) {
    const bool fused = ops::fused_runs(at::empty({1}, at::TensorOptions(device_).dtype(compute_dtype_)),
                                       kernel_options(cfg_));
    log::info("fused kernels: ", fused ? "on"
                                 : cfg_.get_bool("model.fused_kernels")
                                     ? "off (this GPU or build has none; ATen ops)"
                                     : "off (model.fused_kernels = false)");
  }
  if (split.num_stages > 1 || dp_size_ > 1) {
    log::info("parallelism: pp ", split.pp, " x dp ", dp_size_, ", ",
              split.num_stages, " stages (", split.stages_per_rank, " per rank, ",
              pipeline::placement_name(split.placement), "), schedule ",
              cfg_.get_string("parallelism.pipeline_parallel_schedule"), ", ",
              num_microbatches(), " micro-batches, simulated bubble ",
              plan_->simulation.bubble_fraction,
              plan_->simulation_flops
                  ? str(" (", plan_->simulation_flops->bubble_fraction,
                        " with stage costs by FLOPs)")
                  : std::string());
    const auto& bw = plan_->balanced_weights;
    if (bw && plan_->balanced) {
      log::info("split balanced by FLOPs: the embedding counts ", bw->first,
                " layer(s), the head ", bw->second, " (Note [Split balanced by FLOPs])");
    } else if (bw && plan_->simulation_flops &&
               plan_->simulation_flops->bubble_fraction - plan_->balanced_bubble_flops > 0.02) {
      log::info("hint: parallelism.pipeline_parallel_balance = \"flops\" (embedding ", bw->first,
                ", head ", bw->second, " layers) would cut the FLOP-weighted bubble from ",
                plan_->simulation_flops->bubble_fraction, " to ", plan_->balanced_bubble_flops);
    }
  }
  log::info("data ", train_tokens_->describe(), ": ", train_tokens_->size(),
            " tokens", eval_tokens_ ? ", eval " + eval_tokens_->describe() : "");
}

int Trainer::rank() const { return mesh_ ? mesh_->rank() : 0; }

int64_t Trainer::num_microbatches() const {
  // One stage: the key alone decides (default 1); else the schedule's count.
  if (!executor_) {
    return cfg_.get_int_opt("parallelism.pipeline_parallel_microbatches").value_or(1);
  }
  return executor_->num_microbatches();
}

void Trainer::sum_over(dist::ProcessGroup* group, std::vector<double>& values,
                       const std::string& what) {
  if (group == nullptr || group->size() == 1 || values.empty()) return;
  auto t = at::tensor(values, at::TensorOptions().dtype(at::kDouble)).to(group->device());
  std::vector<at::Tensor> ts{t};
  group->allreduce(ts).wait(str("rank ", rank(), " step ", step_ + 1, " all-reduce of ", what,
                                " over ", group->name()));
  auto c = ts[0].cpu();
  for (size_t i = 0; i < values.size(); ++i) values[i] = c[static_cast<int64_t>(i)].item<double>();
}

void Trainer::allreduce_grads_over_dp() {
  if (!mesh_ || dp_size_ == 1) return;
  // Flatten gradients into buckets of parallelism.dp_bucket_mb, all-reduce
  // (sum) each, copy back. Every replica adds the same terms in the same order.
  const int64_t bucket_bytes = cfg_.get_int("parallelism.dp_bucket_mb") << 20;
  const auto& params = optimizer_->params();
  size_t i = 0;
  while (i < params.size()) {
    std::vector<at::Tensor> grads;
    int64_t bytes = 0;
    at::ScalarType dtype = at::kFloat;
    for (; i < params.size(); ++i) {
      auto& p = params[i].param;
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      if (!grads.empty() && (bytes >= bucket_bytes || p.grad().scalar_type() != dtype)) break;
      dtype = p.grad().scalar_type();
      grads.push_back(p.grad());
      bytes += p.grad().numel() * static_cast<int64_t>(p.grad().element_size());
    }
    std::vector<at::Tensor> flat{at::cat([&] {
      std::vector<at::Tensor> f;
      for (auto& g : grads) f.push_back(g.reshape(-1));
      return f;
    }())};
    mesh_->dp_group().allreduce(flat).wait(
        str("rank ", rank(), " step ", step_ + 1, " data-parallel gradient all-reduce"));
    int64_t off = 0;
    torch::NoGradGuard no_grad;
    for (auto& g : grads) {
      g.copy_(flat[0].slice(0, off, off + g.numel()).view_as(g));
      off += g.numel();
    }
  }
}

double Trainer::global_grad_norm() {
  // Per-parameter squared norms placed at their global FQN index, summed over
  // the pp group (each slot has one non-zero contributor: exact), then added
  // in global order: every layout gets the same bits.
  const auto local = grad_squared_norms(optimizer_->params());
  if (!mesh_ || mesh_->pp() == 1) return total_norm(local);
  std::vector<double> all(static_cast<size_t>(total_param_tensors_), 0.0);
  size_t k = 0;
  for (size_t p = 0; p < parts_.size(); ++p) {
    const auto n = parts_[p]->parameters().size();
    for (size_t j = 0; j < n; ++j, ++k) all[static_cast<size_t>(param_offsets_[p]) + j] = local[k];
  }
  sum_over(&mesh_->pp_group(), all, "gradient norms");
  return total_norm(all);
}

Trainer::~Trainer() {
  // The weight cache's copies live in a process-wide registry; drop them
  // with the model rather than at static destruction, after the CUDA
  // runtime may be gone (Note [Low-precision weight cache]).
  kernels::weight_cache::clear();
}

std::string Trainer::checkpoint_folder() const {
  fs::path f = cfg_.get_string("checkpoint.folder");
  if (f.is_absolute()) return f.string();
  return (fs::path(cfg_.get_string("job.dump_folder")) / f).string();
}

at::Tensor Trainer::forward_loss(const at::Tensor& inputs,
                                 const at::Tensor& targets) {
  Activations acts{to_device_async(inputs, device_)};
  for (size_t i = 0; i + 1 < parts_.size(); ++i) acts = parts_[i]->forward(acts);
  return parts_.back()->forward_loss(acts, to_device_async(targets, device_));
}

StepMetrics Trainer::train_step() {
  // Fault injection for the failure tests: VIADUCT_FAULT_KILL="<rank>:<step>"
  // kills that rank with SIGKILL as the step starts.
  if (const char* fault = std::getenv("VIADUCT_FAULT_KILL")) {
    int r = -1;
    long long st = -1;
    if (std::sscanf(fault, "%d:%lld", &r, &st) == 2 && r == rank() && st == step_ + 1) {
      log::error("VIADUCT_FAULT_KILL: killing rank ", r, " at step ", st);
      std::raise(SIGKILL);
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t accum = cfg_.get_int("training.gradient_accumulation_steps");
  const int64_t n_micro = num_microbatches();
  std::vector<data::TokenBatch> batches;
  int64_t local_tokens = 0;
  for (int64_t a = 0; a < accum; ++a) {
    batches.push_back(sampler_->next());
    local_tokens += (batches.back().targets != -100).sum().item<int64_t>();
  }
  // Note [Loss scaling]: the denominator is the global token count.
  std::vector<double> counts{static_cast<double>(local_tokens)};
  sum_over(mesh_ ? &mesh_->dp_group() : nullptr, counts, "token counts");
  const auto tokens = static_cast<int64_t>(counts[0]);
  const double scale = 1.0 / static_cast<double>(tokens);
  for (auto& p : parts_) p->train();
  double loss_sum = 0.0;
  std::vector<at::Tensor> pending_losses;
  for (const auto& batch : batches) {
    RECORD_USER_SCOPE("viaduct::forward_backward");
    auto mbs = data::split_microbatches(batch, n_micro);
    if (executor_) {
      std::vector<at::Tensor> in, tgt;
      for (const auto& mb : mbs) {
        in.push_back(mb.inputs);
        tgt.push_back(mb.targets);
      }
      loss_sum += executor_->run_step(in, tgt, scale);
    } else {
      // Note [No sync between forward and backward]: the loss is read once
      // every backward and the gradient norm are queued; reading it in
      // between stalled the device while the host started the backward
      // (3 ms of the llama-1B step's idle time, bench/NOTES.md).
      for (const auto& mb : mbs) {
        auto loss = forward_loss(mb.inputs, mb.targets);
        (loss * scale).backward();
        pending_losses.push_back(loss.detach());
      }
    }
  }
  allreduce_grads_over_dp();
  const double lr = lr_at(cfg_, step_ + 1);
  const double max_norm = cfg_.get_float("training.max_norm");
  // Note [Clip coefficient on the device] (kernels/clip.cu): where
  // this process holds every parameter and AdamW's CUDA kernel runs, the
  // norm and the clip coefficient are formed on the device and the update
  // is queued before the host reads the norm and the losses, which wait for
  // the norm only. The update has the host path's bits; a norm that is not
  // finite updates nothing, and the check below raises the error.
  std::optional<ops::DeviceClip> device_clip;
  if ((!mesh_ || mesh_->pp() == 1) && optimizer_->takes_device_scale()) {
    const auto grads = defined_grads(optimizer_->params());
    if (ops::clip_on_device_takes(grads, kernel_options(cfg_))) {
      RECORD_USER_SCOPE("viaduct::optimizer");
      device_clip = ops::clip_on_device(grads, max_norm, pending_losses);
      optimizer_->step_device_scaled(lr, device_clip->scale);
      optimizer_->zero_grad();
    }
  }
  double norm = 0.0;
  if (device_clip) {
    RECORD_USER_SCOPE("viaduct::grad_norm");
    const auto v = device_clip->fetch();  // [norm, the losses in order]
    norm = v[0];
    for (size_t i = 1; i < v.size(); ++i) loss_sum += v[i];
  } else {
    {
      RECORD_USER_SCOPE("viaduct::grad_norm");
      norm = global_grad_norm();
    }
    // Read after the norm's launches (Note [No sync between forward and
    // backward]); the norm's host copy has waited for the device already.
    for (const auto& l : pending_losses) loss_sum += l.item<double>();
  }
  // The loss lives on the last stage's rank; gather it (exact: one non-zero).
  // With pipeline timing the same all-reduce gathers each pp rank's span and
  // compute seconds into its own slots: v = [loss, spans, computes]. The
  // device has finished the pipeline's work here (the norm was read).
  std::vector<double> gathered{loss_sum};
  const auto pp = static_cast<size_t>(plan_->split.pp);
  pipeline::PipelineTimes times;
  const bool timed = executor_ && executor_->timing();
  if (timed) {
    times = executor_->take_times();
    gathered.resize(1 + 2 * pp, 0.0);
    gathered[1 + static_cast<size_t>(pp_rank_)] = times.seconds;
    gathered[1 + pp + static_cast<size_t>(pp_rank_)] = times.compute_seconds;
  }
  // Each pp rank's memory peak rides in the same all-reduce (the JSON line
  // is written by one rank).
  const size_t mem_at = gathered.size();
  const bool per_rank_mem = mesh_ && pp > 1;
  if (per_rank_mem) {
    gathered.resize(mem_at + pp, 0.0);
    gathered[mem_at + static_cast<size_t>(pp_rank_)] = peak_memory_bytes(device_);
  }
  sum_over(mesh_ ? &mesh_->pp_group() : nullptr, gathered,
           timed ? "the loss and pipeline times" : "the loss");
  std::vector<double> loss{gathered[0]};
  sum_over(mesh_ ? &mesh_->dp_group() : nullptr, loss, "the loss");
  VIADUCT_CHECK(std::isfinite(norm), "step ", step_ + 1,
                ": the gradient norm is not finite (", norm,
                "); lower optimizer.lr or check the data");
  if (!device_clip) {
    RECORD_USER_SCOPE("viaduct::optimizer");
    // The clip coefficient rides into the update (Note [Clip folded into
    // AdamW]).
    optimizer_->step_scaled(lr, clip_coefficient(norm, max_norm));
    optimizer_->zero_grad();
  }
  if (mesh_ && dp_size_ > 1) {
    for (auto& p : parts_) {
      for (auto& stat : p->replica_statistics()) {
        std::vector<at::Tensor> one{stat};
        mesh_->dp_group().allreduce(one).wait(
            str("rank ", rank(), " step ", step_ + 1, " all-reduce of model statistics"));
      }
    }
  }
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

  StepMetrics m;
  m.step = step_;
  m.loss = loss[0] / static_cast<double>(tokens);
  m.grad_norm = norm;
  m.lr = lr;
  m.tokens = tokens;
  m.seconds = secs;
  m.tokens_per_sec = static_cast<double>(tokens) / secs;
  if (auto peak = peak_flops(device_, compute_dtype_)) {
    // Every rank's device counts toward the peak.
    const int world = mesh_ ? mesh_->world_size() : 1;
    m.mfu = flops_per_token_ * m.tokens_per_sec / (*peak * world);
  }
  m.peak_memory_bytes = peak_memory_bytes(device_);
  m.p2p_bytes = executor_ ? executor_->last_step_p2p_bytes() : 0;
  if (per_rank_mem) {
    m.peak_memory_bytes_per_rank.assign(gathered.begin() + static_cast<std::ptrdiff_t>(mem_at),
                                        gathered.begin() + static_cast<std::ptrdiff_t>(mem_at + pp));
  }
  if (timed) {
    m.pipeline_seconds = times.seconds;
    m.pipeline_compute_seconds = times.compute_seconds;
    m.pipeline_p2p_wait_seconds = times.p2p_wait_seconds;
    for (size_t r = 0; r < pp; ++r) {
      m.bubble_measured_per_rank.push_back(
          pipeline::PipelineTimes{gathered[1 + r], gathered[1 + pp + r], 0.0}.bubble());
    }
  }
  if (attn_res_tables_) {
    // Each rank knows its own sends and store: one sum over pp gathers them.
    // v = [forward bytes per hop, backward bytes per hop, store peak per rank].
    const auto H = static_cast<size_t>(plan_->split.num_stages - 1);
    std::vector<double> v(2 * H + static_cast<size_t>(plan_->split.pp), 0.0);
    for (const auto& [hop, bytes] : executor_->last_step_hop_bytes()) {
      v[static_cast<size_t>(hop)] = static_cast<double>(bytes);
    }
    for (const auto& [hop, bytes] : executor_->last_step_hop_grad_bytes()) {
      v[H + static_cast<size_t>(hop)] = static_cast<double>(bytes);
    }
    v[2 * H + static_cast<size_t>(pp_rank_)] =
        static_cast<double>(attn_res_store_->peak_bytes());
    sum_over(mesh_ ? &mesh_->pp_group() : nullptr, v, "pipeline byte counts");
    for (size_t i = 0; i < v.size(); ++i) {
      (i < H ? m.hop_bytes : i < 2 * H ? m.hop_grad_bytes : m.attn_res_store_peak_bytes)
          .push_back(static_cast<int64_t>(v[i]));
    }
  }
  return m;
}

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
  namespace ck = checkpoint;
  ck::CheckpointMetadata meta;
  meta.step = step_;
  meta.tokens_seen = tokens_seen_;
  meta.data_cursor = nlohmann::json::parse(sampler_->cursor().to_json());
  meta.config_toml = cfg_.to_toml();
  meta.layout = {{"pp", plan_->split.pp},
                 {"dp", dp_size_},
                 {"stages", plan_->split.num_stages}};
  meta.extra = {{"optimizer_steps", optimizer_->steps_taken()}};
  meta.torch_version = compat::torch_version();
  const int pp = static_cast<int>(plan_->split.pp);
  ck::CheckpointPart model_part{ck::part_file_name("model", pp_rank_, pp), {}, {}};
  for (const auto& part : parts_) {
    for (const auto& p : part->named_parameters()) {
      model_part.tensors.emplace_back(p.key(), p.value().detach());
    }
    for (const auto& [k, t] : part->extra_state()) model_part.tensors.emplace_back(k, t);
  }
  ck::CheckpointPart optim_part{ck::part_file_name("optim", pp_rank_, pp),
                                optimizer_->state(), {}};
  std::filesystem::path dir;
  if (!mesh_) {
    dir = ck::save_checkpoint(checkpoint_folder(), meta, {model_part, optim_part});
  } else {
    // Two phases: the dp-rank-0 replica of every pipeline rank writes its
    // parts, all wait, rank 0 commits (Note [Atomic checkpoint save]).
    const auto tmp = ck::checkpoint_tmp_dir(checkpoint_folder(), step_, str("s", step_));
    if (dp_rank_ == 0) {
      ck::write_checkpoint_part(tmp, model_part);
      ck::write_checkpoint_part(tmp, optim_part);
    }
    mesh_->world().barrier().wait(str("rank ", rank(), " checkpoint step ", step_, " (write)"));
    if (rank() == 0) {
      std::vector<std::string> expected;
      for (int r = 0; r < pp; ++r) {
        expected.push_back(ck::part_file_name("model", r, pp));
        expected.push_back(ck::part_file_name("optim", r, pp));
      }
      dir = ck::commit_checkpoint(checkpoint_folder(), tmp, meta, expected);
    }
    mesh_->world().barrier().wait(str("rank ", rank(), " checkpoint step ", step_, " (commit)"));
  }
  if (rank() == 0) {
    const auto removed = ck::prune_checkpoints(
        checkpoint_folder(), static_cast<int>(cfg_.get_int("checkpoint.keep_latest_k")));
    log::info("saved checkpoint ", dir.string(),
              removed.empty() ? "" : str(" (pruned ", removed.size(), " older)"));
  }
  if (mesh_) mesh_->world().barrier().wait(str("rank ", rank(), " checkpoint prune"));
}

bool Trainer::resume() {
  namespace ck = checkpoint;
  // The newest step-<N> folder must load: a damaged one is an error rather
  // than a silent restart from an older step (or from scratch).
  std::optional<int64_t> newest;
  if (fs::is_directory(checkpoint_folder())) {
    for (const auto& e : fs::directory_iterator(checkpoint_folder())) {
      const auto name = e.path().filename().string();
      if (!e.is_directory() || name.rfind("step-", 0) != 0 ||
          name.find(".tmp") != std::string::npos) {
        continue;
      }
      try {
        const int64_t s = std::stoll(name.substr(5));
        if (!newest || s > *newest) newest = s;
      } catch (const std::exception&) {
      }
    }
  }
  const auto latest = ck::find_latest_checkpoint(checkpoint_folder());
  if (newest && (!latest || *latest != *newest)) {
    ck::verify_checkpoint(ck::checkpoint_dir(checkpoint_folder(), *newest),
                          ck::Verify::kSizes);  // throws, naming the file
    throw FileError(str("checkpoint ", ck::checkpoint_dir(checkpoint_folder(), *newest).string(),
                        " is incomplete; remove it to resume from an older one"));
  }
  if (!latest) return false;
  // Under pipeline parallelism each rank reads only its own tensors; their
  // per-tensor CRCs are still checked as they are read.
  const auto ckpt = ck::open_checkpoint(ck::checkpoint_dir(checkpoint_folder(), *latest),
                                        mesh_ ? ck::Verify::kSizes : ck::Verify::kChecksums);
  for (const auto& part : parts_) {
    ckpt.tensors.load_into(*part);
    ckpt.tensors.load_into(part->extra_state());
  }
  const auto keys = optimizer_->state_keys();
  optimizer_->load_state(ckpt.tensors.load_many(keys));
  optimizer_->set_steps_taken(ckpt.metadata.extra.value("optimizer_steps", ckpt.metadata.step));
  sampler_->restore(data::DataCursor::from_json(ckpt.metadata.data_cursor.dump()));
  step_ = ckpt.metadata.step;
  tokens_seen_ = ckpt.metadata.tokens_seen;
  log::info("resumed from ", ckpt.dir.string(), " at step ", step_);
  return true;
}

void Trainer::append_metrics(const std::string& line) {
  if (!cfg_.get_bool("metrics.enable_jsonl") || !is_logging_rank()) return;
  const fs::path dir = cfg_.get_string("job.dump_folder");
  fs::create_directories(dir);
  std::ofstream out(dir / "metrics.jsonl", std::ios::app);
  VIADUCT_CHECK_T(FileError, out.good(), "cannot append to ",
                  (dir / "metrics.jsonl").string());
  out << line << '\n';
}

void Trainer::truncate_metrics_after(int64_t step) {
  // Lines a crashed run wrote past its last checkpoint are dropped, so the
  // file reads as one uninterrupted run.
  if (!is_logging_rank()) return;
  const fs::path file = fs::path(cfg_.get_string("job.dump_folder")) / "metrics.jsonl";
  if (!fs::exists(file)) return;
  std::ifstream in(file);
  std::ostringstream kept;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.value("step", int64_t{0}) > step) continue;
    kept << line << '\n';
  }
  in.close();
  const fs::path tmp = file.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << kept.str();
    VIADUCT_CHECK_T(FileError, out.good(), "cannot write ", tmp.string());
  }
  fs::rename(tmp, file);
}

void Trainer::log_step(const StepMetrics& m) {
  nlohmann::json j;
  j["step"] = m.step;
  j["loss"] = nlohmann::json::parse(float_repr(m.loss));
  j["grad_norm"] = nlohmann::json::parse(float_repr(m.grad_norm));
  j["lr"] = m.lr;
  j["tokens"] = m.tokens;
  j["tokens_per_sec"] = m.tokens_per_sec;
  j["step_seconds"] = m.seconds;
  j["mfu"] = m.mfu >= 0 ? nlohmann::json(m.mfu) : nlohmann::json(nullptr);
  j["peak_memory_bytes"] = m.peak_memory_bytes;
  if (!m.peak_memory_bytes_per_rank.empty()) {
    j["peak_memory_bytes_per_rank"] = m.peak_memory_bytes_per_rank;
  }
  if (executor_) j["p2p_bytes"] = m.p2p_bytes;
  if (!m.bubble_measured_per_rank.empty()) {
    // Note [Measured bubble]: this rank's times; the mean over the pp ranks
    // is what compares with the simulator's bubble.
    j["pipeline_seconds"] = m.pipeline_seconds;
    j["pipeline_compute_seconds"] = m.pipeline_compute_seconds;
    j["pipeline_p2p_wait_seconds"] = m.pipeline_p2p_wait_seconds;
    j["bubble_measured"] = m.bubble_measured_per_rank.at(static_cast<size_t>(pp_rank_));
    j["bubble_measured_per_rank"] = m.bubble_measured_per_rank;
    j["bubble_measured_mean"] = mean(m.bubble_measured_per_rank);
    j["bubble_simulated"] = plan_->simulation.bubble_fraction;
    if (plan_->simulation_flops) {
      j["bubble_simulated_flops"] = plan_->simulation_flops->bubble_fraction;
    }
  }
  if (attn_res_tables_) {
    j["hop_bytes"] = m.hop_bytes;
    j["hop_grad_bytes"] = m.hop_grad_bytes;
    j["attn_res_store_peak_bytes"] = m.attn_res_store_peak_bytes;
  }
  append_metrics(j.dump());
  if (!is_logging_rank()) return;

  const int64_t total = cfg_.get_int("training.steps");
  const bool log_now = m.step % cfg_.get_int("metrics.log_freq") == 0 ||
                       m.step == total;
  std::ostringstream line;
  line << "step " << std::setw(5) << m.step << " | loss " << std::fixed
       << std::setprecision(4) << m.loss << " | grad_norm " << std::setprecision(3)
       << m.grad_norm << " | lr " << std::scientific << std::setprecision(2) << m.lr
       << std::fixed << " | " << std::setprecision(0) << m.tokens_per_sec
       << " tok/s | mfu ";
  if (m.mfu >= 0) {
    line << std::setprecision(2) << 100 * m.mfu << "%";
  } else {
    line << "n/a";
  }
  line << " | mem " << human_bytes(m.peak_memory_bytes);
  if (!m.bubble_measured_per_rank.empty()) {
    line << " | bubble " << std::setprecision(1) << 100 * mean(m.bubble_measured_per_rank)
         << "% (sim " << 100 * plan_->simulation.bubble_fraction << "%";
    if (plan_->simulation_flops) {
      line << ", " << 100 * plan_->simulation_flops->bubble_fraction << "% by FLOPs";
    }
    line << ")";
  }
  if (progress_bar_) {
    const int width = 30;
    const int filled = static_cast<int>(width * m.step / std::max<int64_t>(total, 1));
    std::printf("\r\033[K");
    if (log_now) std::printf("%s\n", line.str().c_str());
    std::printf("[%s%s] %lld/%lld", std::string(filled, '#').c_str(),
                std::string(width - filled, ' ').c_str(),
                static_cast<long long>(m.step), static_cast<long long>(total));
    if (m.step == total) std::printf("\n");
    std::fflush(stdout);
  } else if (log_now) {
    std::printf("%s\n", line.str().c_str());
    std::fflush(stdout);
  }
}

void Trainer::log_eval(double loss) {
  nlohmann::json j;
  j["step"] = step_;
  j["eval_loss"] = nlohmann::json::parse(float_repr(loss));
  append_metrics(j.dump());
  if (!is_logging_rank()) return;
  if (progress_bar_) std::printf("\r\033[K");
  std::printf("step %5lld | eval_loss %.4f\n", static_cast<long long>(step_), loss);
  std::fflush(stdout);
}

StepMetrics Trainer::run() {
  const bool ckpt = cfg_.get_bool("checkpoint.enable");
  bool resumed = false;
  if (ckpt && cfg_.get_bool("checkpoint.resume")) resumed = resume();
  if (ckpt && !resumed && step_ == 0 && cfg_.get_bool("checkpoint.save_initial")) {
    save_checkpoint();  // step-0: the initial weights (for reference runs)
  }
  truncate_metrics_after(step_);
  const int64_t total = cfg_.get_int("training.steps");
  const int64_t eval_every = cfg_.get_int("training.eval_interval");
  const bool can_eval = eval_loader_ && eval_loader_->num_batches() > 0;
  if (!can_eval && eval_every > 0) {
    log::warn("no held-out data (", data::val_path_for(cfg_.get_string("data.path")),
              " missing, data.val_path unset): eval is off");
  }
  if (can_eval && eval_every > 0 && step_ == 0) log_eval(evaluate());
  StepMetrics last;
  reset_peak_memory(device_);
  const int64_t profile_step = cfg_.get_int("metrics.profile_step");
  while (step_ < total) {
    if (step_ + 1 == profile_step) {
      // Note [Profiling one step]: the step's host ops and device kernels,
      // between two device synchronisations so nothing earlier or later
      // leaks in; each rank writes its own trace.
      synchronize(device_);
      StepProfiler profiler(device_);
      last = train_step();
      synchronize(device_);
      const auto path = (std::filesystem::path(cfg_.get_string("job.dump_folder")) /
                         "profile" / str("step-", step_, "-rank-", rank(), ".trace.json"))
                            .string();
      profiler.save(path);
      log::info("profile of step ", step_, " written to ", path,
                " (summary: python3 bench/profile_summary.py ", path, ")");
    } else {
      last = train_step();
    }
    log_step(last);
    if (can_eval && eval_every > 0 && (step_ % eval_every == 0 || step_ == total)) {
      log_eval(evaluate());
    }
    if (ckpt && (step_ % cfg_.get_int("checkpoint.interval") == 0 ||
                 (step_ == total && cfg_.get_bool("checkpoint.save_final")))) {
      save_checkpoint();
    }
  }
  return last;
}

}  // namespace viaduct
