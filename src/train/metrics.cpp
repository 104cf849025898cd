// The stdout line, the progress bar and metrics.jsonl (see metrics.h).
#include "train/metrics.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/check.h"
#include "core/file_io.h"
#include "core/log.h"

namespace viaduct {
namespace fs = std::filesystem;

namespace {

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

MetricsOptions metrics_options_from_config(const JobConfig& job, bool logging_rank) {
  MetricsOptions mo;
  mo.dump_folder = job.job.dump_folder;
  mo.jsonl = job.metrics.enable_jsonl;
  mo.logging_rank = logging_rank;
  mo.progress_bar = job.metrics.progress_bar && isatty(STDOUT_FILENO) &&
                    logging_rank;
  mo.total_steps = job.training.steps;
  mo.log_freq = job.metrics.log_freq;
  return mo;
}

MetricsWriter::MetricsWriter(MetricsOptions options) : options_(std::move(options)) {}

MetricsWriter::~MetricsWriter() = default;

void MetricsWriter::append(const std::string& line) {
  if (!options_.jsonl || !options_.logging_rank) return;
  if (!out_) {
    make_dirs(options_.dump_folder);
    out_ = std::make_unique<File>(File::open_append(jsonl_path()));
  }
  // A metrics file removed under the run would take every later line with
  // it while the run "succeeds".
  VIADUCT_CHECK_T(FileError, !out_->removed(), jsonl_path().string(),
                  " was removed while this run wrote it (by another process); stopping rather "
                  "than lose its metrics");
  const std::string text = line + '\n';
  out_->write_all(text.data(), text.size());
}

void MetricsWriter::flush() {
  if (out_) out_->sync();
}

void MetricsWriter::truncate_after(int64_t step) {
  if (!options_.logging_rank) return;
  const fs::path file = jsonl_path();
  std::error_code ec;
  if (!fs::exists(file, ec)) return;
  out_.reset();
  const std::string text = read_text_file(file);
  // Lines are in step order (every resume cuts the file this way), so the
  // kept history is the prefix before the first line past `step` (or before
  // a torn last line).
  size_t keep = 0;
  size_t pos = 0;
  bool cut = false;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) {
      cut = true;  // a torn last line
      break;
    }
    const auto j = nlohmann::json::parse(text.begin() + static_cast<std::ptrdiff_t>(pos),
                                         text.begin() + static_cast<std::ptrdiff_t>(nl),
                                         nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && (step == 0 || j.value("step", int64_t{0}) > step)) {
      cut = true;
      break;
    }
    pos = nl + 1;
    keep = pos;
  }
  if (!cut) return;
  const auto dropped = static_cast<uint64_t>(text.size() - keep);
  File f = File::open_read_write(file);
  f.truncate(keep);
  f.sync();
  f.close();
  if (step == 0) {
    log::info("metrics: dropped ", dropped, " bytes of ", file.string(),
              ": the run starts again from step 0");
  } else {
    log::info("metrics: dropped ", dropped, " bytes of ", file.string(), " past step ", step,
              " (the resumed checkpoint)");
  }
}

std::string MetricsWriter::step_json(const StepMetrics& m) const {
  nlohmann::json j;
  j["step"] = m.step;
  j["loss"] = nlohmann::json::parse(float_repr(m.loss));
  j["grad_norm"] = nlohmann::json::parse(float_repr(m.grad_norm));
  j["lr"] = m.lr;
  j["tokens"] = m.tokens;
  if (m.documents_per_window >= 0) {
    j["documents_per_window"] = m.documents_per_window;
    j["mean_document_tokens"] = m.mean_document_tokens;
  }
  j["tokens_per_sec"] = m.tokens_per_sec;
  if (m.flops >= 0) j["flops"] = m.flops;
  j["step_seconds"] = m.seconds;
  j["mfu"] = m.mfu >= 0 ? nlohmann::json(m.mfu) : nlohmann::json(nullptr);
  j["peak_memory_bytes"] = m.peak_memory_bytes;
  if (m.energy_joules >= 0) j["energy_joules"] = m.energy_joules;
  if (!m.peak_memory_bytes_per_rank.empty()) {
    j["peak_memory_bytes_per_rank"] = m.peak_memory_bytes_per_rank;
  }
  const auto& plan_memory = options_.plan_memory_bytes_per_rank;
  if (static_cast<size_t>(options_.pp_rank) < plan_memory.size()) {
    j["plan_memory_bytes"] = plan_memory[static_cast<size_t>(options_.pp_rank)];
    if (plan_memory.size() > 1) j["plan_memory_bytes_per_rank"] = plan_memory;
  }
  if (options_.pipeline) j["p2p_bytes"] = m.p2p_bytes;
  if (m.device_wait_seconds >= 0) j["device_wait_seconds"] = m.device_wait_seconds;
  if (m.dp_buckets > 0) {
    j["dp_buckets"] = m.dp_buckets;
    j["dp_buckets_overlapped"] = m.dp_buckets_overlapped;
    j["dp_reduce_wait_seconds"] = m.dp_reduce_wait_seconds;
    j["dp_bytes"] = m.dp_bytes;
  }
  if (!m.moe_load_max_over_mean.empty()) {
    j["moe_load_max_over_mean"] = m.moe_load_max_over_mean;
  }
  if (m.moe_dropped_tokens >= 0) j["moe_dropped_tokens"] = m.moe_dropped_tokens;
  if (!m.ep_tokens_received_per_rank.empty()) {
    j["ep_tokens_received_per_rank"] = m.ep_tokens_received_per_rank;
    j["ep_alltoall_bytes"] = m.ep_alltoall_bytes;
    j["ep_alltoall_seconds"] = m.ep_alltoall_seconds;
  }
  if (!m.bubble_measured_per_rank.empty()) {
    // See Note [Measured bubble]: this rank's times; the mean over the pp ranks
    // is what compares with the simulator's bubble.
    j["pipeline_seconds"] = m.pipeline_seconds;
    j["pipeline_compute_seconds"] = m.pipeline_compute_seconds;
    j["pipeline_p2p_wait_seconds"] = m.pipeline_p2p_wait_seconds;
    j["bubble_measured"] = m.bubble_measured_per_rank.at(static_cast<size_t>(options_.pp_rank));
    j["bubble_measured_per_rank"] = m.bubble_measured_per_rank;
    j["bubble_measured_mean"] = mean(m.bubble_measured_per_rank);
    j["bubble_simulated"] = options_.bubble_simulated;
    if (options_.bubble_simulated_flops) {
      j["bubble_simulated_flops"] = *options_.bubble_simulated_flops;
    }
  }
  if (options_.attn_res) {
    j["hop_bytes"] = m.hop_bytes;
    j["hop_grad_bytes"] = m.hop_grad_bytes;
    j["attn_res_store_peak_bytes"] = m.attn_res_store_peak_bytes;
  }
  return j.dump();
}

std::string MetricsWriter::step_line(const StepMetrics& m) const {
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
  if (m.energy_joules >= 0 && m.tokens > 0) {
    line << " | " << std::setprecision(2)
         << 1e3 * m.energy_joules / static_cast<double>(m.tokens) << " mJ/tok";
  }
  if (!m.bubble_measured_per_rank.empty()) {
    line << " | bubble " << std::setprecision(1) << 100 * mean(m.bubble_measured_per_rank)
         << "% (sim " << 100 * options_.bubble_simulated << "%";
    if (options_.bubble_simulated_flops) {
      line << ", " << 100 * *options_.bubble_simulated_flops << "% by FLOPs";
    }
    line << ")";
  }
  return line.str();
}

void MetricsWriter::log_step(const StepMetrics& m) {
  append(step_json(m));
  if (!options_.logging_rank) return;
  const int64_t total = options_.total_steps;
  const bool log_now = m.step % options_.log_freq == 0 || m.step == total;
  if (options_.progress_bar) {
    const int width = 30;
    const int filled = static_cast<int>(width * m.step / std::max<int64_t>(total, 1));
    std::printf("\r\033[K");
    if (log_now) std::printf("%s\n", step_line(m).c_str());
    std::printf("[%s%s] %lld/%lld", std::string(filled, '#').c_str(),
                std::string(width - filled, ' ').c_str(),
                static_cast<long long>(m.step), static_cast<long long>(total));
    if (m.step == total) std::printf("\n");
    std::fflush(stdout);
  } else if (log_now) {
    std::printf("%s\n", step_line(m).c_str());
    std::fflush(stdout);
  }
}

void MetricsWriter::log_eval(int64_t step, double loss) {
  nlohmann::json j;
  j["step"] = step;
  j["eval_loss"] = nlohmann::json::parse(float_repr(loss));
  append(j.dump());
  if (!options_.logging_rank) return;
  if (options_.progress_bar) std::printf("\r\033[K");
  std::printf("step %5lld | eval_loss %.4f\n", static_cast<long long>(step), loss);
  std::fflush(stdout);
}

}  // namespace viaduct
