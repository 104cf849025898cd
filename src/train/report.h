// The run report: `<job.dump_folder>/report.html`, one self-contained page
// (inline SVG and CSS; no script, no network) a person reads at a glance:
// loss (its spikes marked) and eval loss, LR, gradient norm, tokens/s and
// MFU over the steps, peak memory per rank, the measured against the
// simulated bubble per rank, and the schedule's timeline (`viaduct schedule --svg`). The trainer writes
// it at the end of every run, beside metrics.jsonl; `viaduct report DUMP`
// writes it again from the folder.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace viaduct {

struct JobConfig;
namespace pipeline {
struct PipelinePlan;
}  // namespace pipeline

struct ReportOptions {
  // A step whose loss is above this factor times the running mean of the
  // losses before it is a loss spike (metrics.loss_spike_factor).
  double loss_spike_factor = 1.35;
};

// The decay of the losses' running mean the spikes are measured against:
// mean = decay * mean + (1 - decay) * loss, started at the first step's loss.
constexpr double kLossMeanDecay = 0.9;

// The steps of the records (metrics.jsonl's, in order) whose loss is a spike.
std::vector<int64_t> loss_spike_steps(const std::vector<nlohmann::json>& records,
                                      double loss_spike_factor);

// The page for the records of metrics.jsonl (steps and evals, in order).
// `schedule_svg`: the timeline picture, or "" for none.
std::string run_report_html(const std::vector<nlohmann::json>& records, const std::string& title,
                            const std::string& schedule_svg, const ReportOptions& options = {});

// Reads `<dump>/metrics.jsonl` (and `<dump>/schedule.svg` when
// `schedule_svg` is empty and the file exists), writes `<dump>/report.html`
// atomically and returns its path. FileError without a metrics.jsonl.
std::filesystem::path write_run_report(const std::filesystem::path& dump,
                                       const std::string& title,
                                       const std::string& schedule_svg = "",
                                       const ReportOptions& options = {});

// The end of a run on the logging rank, when metrics.enable_jsonl: the
// schedule's timeline (schedule.svg) and report.html in job.dump_folder. A
// run that trained is not failed by its picture: a report that cannot be
// written is a warning.
void write_run_report_at_end(const JobConfig& job, const pipeline::PipelinePlan& plan,
                             bool logging_rank);

}  // namespace viaduct
