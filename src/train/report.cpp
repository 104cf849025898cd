// The run report (see report.h): SVG charts drawn here, by hand, so the page
// needs nothing but a browser.
#include "train/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "core/check.h"
#include "config/job_config.h"
#include "core/file_io.h"
#include "core/log.h"
#include "core/strings.h"
#include "pipeline/schedule/plan.h"
#include "pipeline/schedule/timeline_svg.h"

namespace viaduct {
namespace fs = std::filesystem;

namespace {

using Points = std::vector<std::pair<double, double>>;  // (step, value)

struct Series {
  std::string name;
  std::string color;
  Points points;
};

std::string fmt(double v) {
  char buf[32];
  const double a = std::fabs(v);
  if (a != 0 && (a >= 1e5 || a < 1e-3)) {
    std::snprintf(buf, sizeof(buf), "%.3g", v);
  } else {
    std::snprintf(buf, sizeof(buf), "%.4g", v);
  }
  return buf;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

constexpr double kW = 520, kH = 220, kLeft = 64, kRight = 12, kTop = 28, kBottom = 34;

// One line chart: every series over the same step axis.
std::string line_chart(const std::string& title, const std::vector<Series>& series) {
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const auto& s : series) {
    for (const auto& [x, y] : s.points) {
      x0 = std::min(x0, x);
      x1 = std::max(x1, x);
      y0 = std::min(y0, y);
      y1 = std::max(y1, y);
    }
  }
  std::ostringstream os;
  os << "<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kW
     << "\" height=\"" << kH << "\" viewBox=\"0 0 " << kW << ' ' << kH << "\">"
     << "<text x=\"" << kLeft << "\" y=\"18\" class=\"title\">" << escape(title) << "</text>";
  if (!std::isfinite(x0)) {
    os << "<text x=\"" << kW / 2 << "\" y=\"" << kH / 2
       << "\" text-anchor=\"middle\" class=\"none\">no data</text></svg>";
    return os.str();
  }
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) {
    y0 -= std::max(1e-12, std::fabs(y0) * 0.05);
    y1 += std::max(1e-12, std::fabs(y1) * 0.05);
  }
  const double pw = kW - kLeft - kRight, ph = kH - kTop - kBottom;
  auto px = [&](double x) { return kLeft + (x - x0) / (x1 - x0) * pw; };
  auto py = [&](double y) { return kTop + (1 - (y - y0) / (y1 - y0)) * ph; };
  os << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << pw << "\" height=\"" << ph
     << "\" class=\"frame\"/>";
  for (int i = 0; i <= 4; ++i) {
    const double y = y0 + (y1 - y0) * i / 4;
    os << "<line x1=\"" << kLeft << "\" x2=\"" << kLeft + pw << "\" y1=\"" << py(y) << "\" y2=\""
       << py(y) << "\" class=\"grid\"/><text x=\"" << kLeft - 4 << "\" y=\"" << py(y) + 4
       << "\" text-anchor=\"end\" class=\"tick\">" << fmt(y) << "</text>";
  }
  for (int i = 0; i <= 4; ++i) {
    const double x = x0 + (x1 - x0) * i / 4;
    os << "<text x=\"" << px(x) << "\" y=\"" << kTop + ph + 16
       << "\" text-anchor=\"middle\" class=\"tick\">" << fmt(std::round(x)) << "</text>";
  }
  os << "<text x=\"" << kLeft + pw / 2 << "\" y=\"" << kH - 4
     << "\" text-anchor=\"middle\" class=\"tick\">step</text>";
  double legend_x = kW - kRight;
  for (auto it = series.rbegin(); it != series.rend(); ++it) {
    legend_x -= 8.0 * static_cast<double>(it->name.size()) + 22;
    os << "<rect x=\"" << legend_x << "\" y=\"9\" width=\"10\" height=\"10\" fill=\""
       << it->color << "\"/><text x=\"" << legend_x + 14 << "\" y=\"18\" class=\"tick\">"
       << escape(it->name) << "</text>";
  }
  for (const auto& s : series) {
    if (s.points.size() == 1) {
      os << "<circle cx=\"" << px(s.points[0].first) << "\" cy=\"" << py(s.points[0].second)
         << "\" r=\"3\" fill=\"" << s.color << "\"/>";
      continue;
    }
    os << "<polyline fill=\"none\" stroke=\"" << s.color << "\" stroke-width=\"2\" points=\"";
    for (const auto& [x, y] : s.points) os << px(x) << ',' << py(y) << ' ';
    os << "\"/>";
  }
  os << "</svg>";
  return os.str();
}

// Grouped bars: one group per rank, one bar per series.
std::string bar_chart(const std::string& title, const std::string& unit,
                      const std::vector<Series>& series) {
  size_t groups = 0;
  double top = 0;
  for (const auto& s : series) {
    groups = std::max(groups, s.points.size());
    for (const auto& p : s.points) top = std::max(top, p.second);
  }
  std::ostringstream os;
  os << "<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kW
     << "\" height=\"" << kH << "\" viewBox=\"0 0 " << kW << ' ' << kH << "\">"
     << "<text x=\"" << kLeft << "\" y=\"18\" class=\"title\">" << escape(title) << "</text>";
  if (groups == 0 || top <= 0) {
    os << "<text x=\"" << kW / 2 << "\" y=\"" << kH / 2
       << "\" text-anchor=\"middle\" class=\"none\">no data</text></svg>";
    return os.str();
  }
  const double pw = kW - kLeft - kRight, ph = kH - kTop - kBottom;
  const double gw = pw / static_cast<double>(groups);
  const double bw = gw * 0.7 / static_cast<double>(series.size());
  os << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << pw << "\" height=\"" << ph
     << "\" class=\"frame\"/>";
  for (int i = 0; i <= 4; ++i) {
    const double v = top * i / 4;
    const double y = kTop + (1 - v / top) * ph;
    os << "<line x1=\"" << kLeft << "\" x2=\"" << kLeft + pw << "\" y1=\"" << y << "\" y2=\"" << y
       << "\" class=\"grid\"/><text x=\"" << kLeft - 4 << "\" y=\"" << y + 4
       << "\" text-anchor=\"end\" class=\"tick\">" << fmt(v) << "</text>";
  }
  for (size_t g = 0; g < groups; ++g) {
    os << "<text x=\"" << kLeft + gw * (static_cast<double>(g) + 0.5) << "\" y=\""
       << kTop + ph + 16 << "\" text-anchor=\"middle\" class=\"tick\">rank " << g << "</text>";
  }
  double legend_x = kW - kRight;
  for (auto it = series.rbegin(); it != series.rend(); ++it) {
    legend_x -= 8.0 * static_cast<double>(it->name.size()) + 22;
    os << "<rect x=\"" << legend_x << "\" y=\"9\" width=\"10\" height=\"10\" fill=\""
       << it->color << "\"/><text x=\"" << legend_x + 14 << "\" y=\"18\" class=\"tick\">"
       << escape(it->name) << "</text>";
  }
  for (size_t s = 0; s < series.size(); ++s) {
    for (const auto& [g, v] : series[s].points) {
      const double h = v / top * ph;
      const double x = kLeft + gw * g + gw * 0.15 + bw * static_cast<double>(s);
      os << "<rect x=\"" << x << "\" y=\"" << kTop + ph - h << "\" width=\"" << bw
         << "\" height=\"" << h << "\" fill=\"" << series[s].color << "\"><title>"
         << escape(series[s].name) << ", rank " << g << ": " << fmt(v) << unit
         << "</title></rect>";
    }
  }
  os << "</svg>";
  return os.str();
}

Points column(const std::vector<nlohmann::json>& records, const char* key, double scale = 1) {
  Points out;
  for (const auto& r : records) {
    if (!r.is_object() || !r.contains(key) || !r[key].is_number() || !r.contains("step")) continue;
    const double v = r[key].get<double>() * scale;
    if (std::isfinite(v)) out.emplace_back(r["step"].get<double>(), v);
  }
  return out;
}

// Per rank: the value of `key` (an array) in the last step record holding it.
Points per_rank_last(const std::vector<nlohmann::json>& records, const char* key, double scale) {
  for (auto it = records.rbegin(); it != records.rend(); ++it) {
    if (it->is_object() && it->contains(key) && (*it)[key].is_array()) {
      Points out;
      for (size_t r = 0; r < (*it)[key].size(); ++r) {
        out.emplace_back(static_cast<double>(r), (*it)[key][r].get<double>() * scale);
      }
      return out;
    }
  }
  return {};
}

// Per rank: the median over the steps of `key` (an array), the first step
// (warm-up) left out when there are others.
Points per_rank_median(const std::vector<nlohmann::json>& records, const char* key) {
  std::vector<std::vector<double>> by_rank;
  bool first = true;
  for (const auto& r : records) {
    if (!r.is_object() || !r.contains(key) || !r[key].is_array()) continue;
    if (first) {
      first = false;
      if (records.size() > 2) continue;
    }
    by_rank.resize(std::max(by_rank.size(), r[key].size()));
    for (size_t i = 0; i < r[key].size(); ++i) by_rank[i].push_back(r[key][i].get<double>());
  }
  Points out;
  for (size_t i = 0; i < by_rank.size(); ++i) {
    auto v = by_rank[i];
    if (v.empty()) continue;
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    out.emplace_back(static_cast<double>(i), v[v.size() / 2]);
  }
  return out;
}

// Per step: the largest value of `key` (an array), e.g. the most
// imbalanced MoE layer's max / mean load.
Points max_of_array(const std::vector<nlohmann::json>& records, const char* key) {
  Points out;
  for (const auto& r : records) {
    if (!r.is_object() || !r.contains(key) || !r[key].is_array() || r[key].empty() ||
        !r.contains("step")) {
      continue;
    }
    double v = 0;
    for (const auto& x : r[key]) v = std::max(v, x.get<double>());
    out.emplace_back(r["step"].get<double>(), v);
  }
  return out;
}

}  // namespace

std::string run_report_html(const std::vector<nlohmann::json>& records, const std::string& title,
                            const std::string& schedule_svg) {
  const double gib = 1.0 / (1024.0 * 1024 * 1024);
  const auto loss = column(records, "loss");
  const auto eval = column(records, "eval_loss");
  std::ostringstream os;
  os << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>"
     << escape(title) << "</title><style>"
     << "body{font-family:Helvetica,Arial,sans-serif;margin:24px;color:#222;background:#fff}"
     << "h1{font-size:20px}h2{font-size:16px;margin-top:28px}"
     << ".grid-charts{display:flex;flex-wrap:wrap;gap:12px}"
     << "svg.chart{border:1px solid #ddd;background:#fff}"
     << "svg .title{font-size:13px;font-weight:bold}svg .tick{font-size:11px;fill:#444}"
     << "svg .none{font-size:13px;fill:#888}svg .frame{fill:none;stroke:#999}"
     << "svg .grid{stroke:#eee}table{border-collapse:collapse}"
     << "td{padding:2px 12px 2px 0}</style></head><body>\n<h1>" << escape(title) << "</h1>\n";
  os << "<table>";
  if (!loss.empty()) {
    os << "<tr><td>steps</td><td>" << fmt(loss.back().first) << "</td></tr>"
       << "<tr><td>final loss</td><td>" << fmt(loss.back().second) << "</td></tr>";
  }
  if (!eval.empty()) os << "<tr><td>last eval loss</td><td>" << fmt(eval.back().second) << "</td></tr>";
  os << "</table>\n<h2>Training</h2>\n<div class=\"grid-charts\">\n";
  std::vector<Series> loss_series{{"loss", "#1f77b4", loss}};
  if (!eval.empty()) loss_series.push_back({"eval loss", "#d62728", eval});
  os << line_chart("loss", loss_series) << '\n'
     << line_chart("learning rate", {{"lr", "#2ca02c", column(records, "lr")}}) << '\n'
     << line_chart("gradient norm (before clipping)",
                   {{"grad norm", "#9467bd", column(records, "grad_norm")}})
     << '\n'
     << line_chart("throughput", {{"tokens/s", "#ff7f0e", column(records, "tokens_per_sec")}})
     << '\n'
     << line_chart("MFU (%)", {{"MFU", "#8c564b", column(records, "mfu", 100.0)}}) << '\n';
  // MoE runs: the balance the selection bias keeps (1 = every expert
  // equally loaded).
  if (const auto imbalance = max_of_array(records, "moe_load_max_over_mean"); !imbalance.empty()) {
    os << line_chart("MoE load: busiest expert / mean (worst layer)",
                     {{"max / mean", "#bcbd22", imbalance}})
       << '\n';
  }
  os << "</div>\n<h2>Ranks</h2>\n<div class=\"grid-charts\">\n";
  auto memory = per_rank_last(records, "peak_memory_bytes_per_rank", gib);
  if (memory.empty()) {
    const auto last = column(records, "peak_memory_bytes", gib);
    if (!last.empty()) memory.emplace_back(0.0, last.back().second);
  }
  os << bar_chart("peak memory per rank (GiB)", " GiB", {{"peak", "#17becf", memory}}) << '\n';
  const auto measured = per_rank_median(records, "bubble_measured_per_rank");
  Points simulated;
  for (auto it = records.rbegin(); it != records.rend(); ++it) {
    if (it->is_object() && it->contains("bubble_simulated")) {
      for (const auto& p : measured) simulated.emplace_back(p.first, (*it)["bubble_simulated"].get<double>() * 100);
      break;
    }
  }
  Points measured_pct;
  for (const auto& [r, v] : measured) measured_pct.emplace_back(r, v * 100);
  os << bar_chart("bubble per rank (%)", "%",
                  {{"measured", "#e377c2", measured_pct}, {"simulated", "#7f7f7f", simulated}})
     << "\n</div>\n";
  if (!schedule_svg.empty()) {
    os << "<h2>Schedule</h2>\n<div>" << schedule_svg << "</div>\n";
  }
  os << "</body></html>\n";
  return os.str();
}

fs::path write_run_report(const fs::path& dump, const std::string& title,
                          const std::string& schedule_svg) {
  const fs::path metrics = dump / "metrics.jsonl";
  std::error_code ec;
  VIADUCT_CHECK_T(FileError, fs::exists(metrics, ec), "no ", metrics.string(),
                  ": a run report needs the folder of a run with metrics.enable_jsonl = true");
  std::vector<nlohmann::json> records;
  std::istringstream in(read_text_file(metrics));
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object()) records.push_back(std::move(j));
  }
  std::string svg = schedule_svg;
  if (svg.empty() && fs::exists(dump / "schedule.svg", ec)) svg = read_text_file(dump / "schedule.svg");
  const fs::path out = dump / "report.html";
  atomic_write_file(out, run_report_html(records, title, svg));
  return out;
}

void write_run_report_at_end(const JobConfig& job, const pipeline::PipelinePlan& plan,
                             bool logging_rank) {
  // The run report beside metrics.jsonl (train/report.h); a run that trained
  // is not failed by its picture, but a report that cannot be written says so.
  if (!logging_rank || !job.metrics.enable_jsonl) return;
  const fs::path dump = job.job.dump_folder;
  const std::string description = job.job.description;
  const std::string title = description.empty() ? dump.string() : description;
  try {
    const std::string svg = pipeline::timeline_svg(
        plan.lowered, plan.simulation,
        str(plan.compute.name, ": pp ", plan.split.pp, ", ", plan.split.stages_per_rank,
            " stage(s) per rank, ", plan.compute.microbatches, " micro-batches"));
    atomic_write_file(dump / "schedule.svg", svg);
    const auto path = write_run_report(dump, title, svg);
    log::info("run report: ", path.string());
  } catch (const std::exception& e) {
    log::warn("cannot write the run report: ", e.what());
  }
}

}  // namespace viaduct
