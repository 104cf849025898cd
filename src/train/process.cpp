// Process setup and the job summary (see process.h).
#include "train/process.h"

#include <chrono>
#include <cstdlib>

#include "core/check.h"
#include "core/device.h"
#include "core/log.h"
#include "core/torch_compat.h"
#include "data/sampler.h"
#include "data/token_file.h"
#include "distributed/distributed.h"
#include "model/model.h"
#include "ops/options.h"
#include "pipeline/schedule/plan.h"

namespace viaduct {

at::ScalarType resolve_compute_dtype(const std::string& name, bool on_cuda) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  return on_cuda ? at::kBFloat16 : at::kFloat;  // auto
}

ProcessSetup init_process(const JobConfig& job) {
  ProcessSetup ps;
  const auto& lvl = job.job.log_level;
  log::set_level(lvl == "debug"     ? log::Level::kDebug
                 : lvl == "warning" ? log::Level::kWarn
                 : lvl == "error"   ? log::Level::kError
                                    : log::Level::kInfo);
  // The same thread count whether launched or run alone (determinism).
  at::set_num_threads(static_cast<int>(job.training.num_threads));

  // Where this process sits: pp x dp ranks over c10d, or one process.
  const auto rdv = distributed::rendezvous_from_env();
  const int pp = static_cast<int>(job.parallelism.pipeline_parallel_degree);
  const int dp = static_cast<int>(job.parallelism.data_parallel_degree);
  VIADUCT_CHECK_T(ConfigError, pp * dp == rdv.world_size,
                  "parallelism.pipeline_parallel_degree (", pp,
                  ") x parallelism.data_parallel_degree (", dp, ") = ", pp * dp,
                  " ranks, but WORLD_SIZE is ", rdv.world_size,
                  rdv.world_size == 1
                      ? str("; start the ranks with `viaduct launch --nproc-per-node ",
                            pp * dp, " -- viaduct train ...`")
                      : std::string());
  if (job.training.deterministic) {
    // cuBLAS needs a fixed workspace for reproducible results; it must be set
    // before the first cuBLAS handle exists.
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
    // Deterministic kernels without LibTorch's NaN fill of every new tensor
    // (compat::set_deterministic_fill says why).
    compat::set_deterministic_fill(false);
  }
  ps.device = resolve_device(job.training.device, rdv.local_rank);
  if (rdv.world_size > 1) {
    const auto timeout =
        std::chrono::seconds(job.parallelism.comm_timeout_seconds);
    ps.mesh = distributed::init_mesh(rdv, pp, dp, ps.device,
                              std::chrono::duration_cast<std::chrono::milliseconds>(timeout),
                              static_cast<int>(job.parallelism.expert_parallel_degree));
    ps.pp_rank = ps.mesh->pp_rank();
    ps.dp_rank = ps.mesh->dp_rank();
    ps.dp_size = ps.mesh->dp();
    if (rdv.rank != 0 && log::level() < log::Level::kWarn) {
      log::set_level(log::Level::kWarn);  // rank 0 reports for the job
    }
  }
  ps.compute_dtype = resolve_compute_dtype(job.training.dtype, ps.device.is_cuda());
  // After the determinism settings: the probe may make the first cuBLAS
  // handle.
  ps.capabilities = ops::probe_capabilities(ps.device);
  return ps;
}

void log_job_summary(const JobConfig& config, const JobSummary& job) {
  const auto& info = job.model;
  const auto& plan = job.plan;
  const auto& split = plan.split;
  log::info("model ", info.family, "/", info.flavor, ": ", info.n_layers,
            " layers, ", info.params, " parameters; device ", device_name(job.device),
            ", dtype ", c10::toString(job.compute_dtype), ", LibTorch ",
            compat::torch_version(), ", ", at::get_num_threads(), " threads");
  if (job.device.is_cuda()) {
    const bool fused = ops::fused_runs(
        at::empty({1}, at::TensorOptions(job.device).dtype(job.compute_dtype)),
        kernel_options(config.model));
    log::info("fused kernels: ", fused ? "on"
                                 : config.model.cuda_kernels
                                     ? "off (this GPU or build has none; ATen ops)"
                                     : "off (model.cuda_kernels = false)");
    log::info("GEMM path: ", ops::describe(job.capabilities));
  }
  if (split.num_stages > 1 || job.dp_size > 1) {
    log::info("parallelism: pp ", split.pp, " x dp ", job.dp_size, ", ",
              split.num_stages, " stages (", split.stages_per_rank, " per rank, ",
              pipeline::placement_name(split.placement), "), schedule ",
              config.parallelism.pipeline_parallel_schedule, ", ",
              job.num_microbatches, " micro-batches, simulated bubble ",
              plan.simulation.bubble_fraction,
              plan.simulation_flops
                  ? str(" (", plan.simulation_flops->bubble_fraction,
                        " with stage costs by FLOPs)")
                  : std::string());
    const auto& bw = plan.balanced_weights;
    if (bw && plan.balanced) {
      log::info("split balanced by FLOPs: the embedding counts ", bw->first,
                " layer(s), the head ", bw->second, " (see Note [Split balanced by FLOPs])");
    } else if (bw && plan.simulation_flops &&
               plan.simulation_flops->bubble_fraction - plan.balanced_bubble_flops > 0.02) {
      log::info("hint: parallelism.pipeline_parallel_balance = \"flops\" (embedding ", bw->first,
                ", head ", bw->second, " layers) would cut the FLOP-weighted bubble from ",
                plan.simulation_flops->bubble_fraction, " to ", plan.balanced_bubble_flops);
    }
  }
  log::info("data ", job.sampler.describe(),
            job.eval_tokens ? ", eval " + job.eval_tokens->describe() : "");
}

}  // namespace viaduct
