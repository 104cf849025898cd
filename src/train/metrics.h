// A training step's metrics and where they go: the stdout line (or a
// progress bar on a terminal), one JSON object per step and per eval in
// `<job.dump_folder>/metrics.jsonl`, and the truncation of that file after a
// resume so that it reads as one uninterrupted run.
//
// Note [Metrics log is never lost]
// Each line goes to the file with one checked write(2) (no stdio buffer whose
// failure would surface, unseen, at close): a full disk is an error naming
// the file at the step that could not be logged. flush() fsyncs (at every
// checkpoint and at the end of the run). A resume shortens the file in place
// with ftruncate(2) -- which needs no free space -- and only by the lines
// past the resumed step and a torn last line; it never rewrites the history
// it keeps.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/job_config.h"

namespace viaduct {

class File;

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;        // mean token cross-entropy of the step
  double grad_norm = 0;   // before clipping
  double lr = 0;
  int64_t tokens = 0;     // target tokens of the step (all dp ranks)
  // model.attn_mask_type = "block_causal" (see Note [Document boundaries],
  // ops/documents.h): the document pieces per window of the step, and the
  // window tokens per document that starts in them (the data's mean
  // document length as the step saw it; 0 when none started); -1 otherwise.
  double documents_per_window = -1;
  double mean_document_tokens = -1;
  // The step's training FLOPs (forward and backward, every dp replica),
  // which MFU counts: flops_per_token per target token, or under
  // block_causal the FLOPs of the step's documents.
  // See Note [FLOPs of a step's documents] (model/model.h).
  double flops = -1;
  double seconds = 0;
  double tokens_per_sec = 0;
  double mfu = -1;        // fraction of peak; < 0 when the peak is unknown
  double peak_memory_bytes = 0;
  // Joules every rank's GPU used in the step (see Note [Energy per step],
  // core/energy.h); < 0 when unknown (CPU, no NVML).
  double energy_joules = -1;
  // pp > 1: each pp rank's device peak so far, read at the loss's all-reduce
  // (after the backward; on CPU the process's peak resident set).
  std::vector<double> peak_memory_bytes_per_rank;
  int64_t p2p_bytes = 0;  // this rank's pipeline sends + receives
  // Forward and backward (gradient) bytes per hop s -> s+1 (all ranks), and
  // the AttnRes rank block store's peak bytes per pp rank (empty without an
  // AttnRes pipeline).
  std::vector<int64_t> hop_bytes;
  std::vector<int64_t> hop_grad_bytes;
  std::vector<int64_t> attn_res_store_peak_bytes;
  // Pipeline timing (see Note [Measured bubble], pipeline/runtime/executor.h):
  // this rank's span of the schedule, compute and P2P wait seconds, and
  // 1 - compute / span for each pp rank of this pipeline; empty when off.
  double pipeline_seconds = 0;
  double pipeline_compute_seconds = 0;
  double pipeline_p2p_wait_seconds = 0;
  std::vector<double> bubble_measured_per_rank;
  // dp > 1 (see Note [Overlapped data-parallel reduction], train/reduce.h): the
  // gradient buckets of the logging rank, how many of them started their
  // reduce-scatter while the rank still ran another stage's backward, the
  // seconds the step then waited for the sums after the schedule, and the
  // bytes the rank sent over dp (gradients, and ZeRO-1's weights).
  int64_t dp_buckets = 0;
  int64_t dp_buckets_overlapped = 0;
  double dp_reduce_wait_seconds = 0;
  int64_t dp_bytes = 0;
  // With the clip on the device: the host seconds the step's end waited
  // for the device's norm and losses (the rest of step_seconds is host
  // work: where it is most of the step, the host holds the device back);
  // -1 where the clip ran on the host.
  double device_wait_seconds = -1;
  // MoE families: each layer's largest expert load over the mean of the
  // step's global counts (all dp replicas; 0 for a dense layer), indexed by
  // layer; empty without MoE layers.
  std::vector<double> moe_load_max_over_mean;
  // Under model.moe_capacity_factor: the token copies dropped in the step,
  // all layers and replicas (see Note [Expert capacity], model/moe.h); -1: none
  // can be (dropless).
  double moe_dropped_tokens = -1;
  // Expert parallelism (see Note [Expert parallelism], model/moe.h): the token
  // copies each rank of the logging rank's ep group received for its
  // experts in the step (all its MoE layers, forward only), the bytes the
  // logging rank sent by all-to-all and the host seconds its exchanges
  // took (on NCCL the wait is on the stream: the counts' copy to the host
  // is what the host waits for); empty and 0 at ep = 1.
  std::vector<double> ep_tokens_received_per_rank;
  int64_t ep_alltoall_bytes = 0;
  double ep_alltoall_seconds = 0;
};

struct MetricsOptions {
  std::filesystem::path dump_folder;  // job.dump_folder: metrics.jsonl goes here
  bool jsonl = true;                  // metrics.enable_jsonl
  bool logging_rank = true;           // only this rank prints and writes
  bool progress_bar = false;          // already false off a terminal
  int64_t total_steps = 0;            // training.steps
  int64_t log_freq = 1;               // metrics.log_freq
  // Pipelines: p2p_bytes is written with more than one stage; hop bytes and
  // store peaks with AttnRes stages; the measured bubble is set against the
  // schedule simulator's.
  bool pipeline = false;
  bool attn_res = false;
  int pp_rank = 0;
  double bubble_simulated = 0;
  std::optional<double> bubble_simulated_flops;
  // Each pp rank's estimated total bytes (see Note [Activation memory estimate],
  // train/memory_estimate.h), the figure `viaduct plan` prints, written
  // beside the measured peaks; empty: not written.
  std::vector<double> plan_memory_bytes_per_rank;
};

// The job.* and metrics.* keys; the pipeline fields stay at their defaults.
// The progress bar needs stdout to be a terminal.
MetricsOptions metrics_options_from_config(const JobConfig& job, bool logging_rank);

class MetricsWriter {
 public:
  explicit MetricsWriter(MetricsOptions options);
  ~MetricsWriter();

  // The step's JSON line, and its stdout line at metrics.log_freq and at the
  // last step.
  void log_step(const StepMetrics& m);
  void log_eval(int64_t step, double loss);
  // Lines a crashed run wrote past its last checkpoint (`step`) are dropped,
  // with a torn last line (no newline: a crash mid-write). See Note [Metrics log
  // is never lost]. A run that starts from step 0 again drops every line:
  // it writes its step-0 eval again, and a file holds one line per step.
  void truncate_after(int64_t step);
  // fsync of metrics.jsonl: a FileError naming it when the data did not
  // reach the disk.
  void flush();

  // The record written to metrics.jsonl, and the stdout line.
  std::string step_json(const StepMetrics& m) const;
  std::string step_line(const StepMetrics& m) const;
  std::filesystem::path jsonl_path() const { return options_.dump_folder / "metrics.jsonl"; }

 private:
  void append(const std::string& json_line);

  MetricsOptions options_;
  std::unique_ptr<File> out_;  // opened at the first line
};

}  // namespace viaduct
