// The run report (see report.h): SVG charts drawn here, by hand, so the page
// needs nothing but a browser.
#include "train/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
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
  bool dots = false;  // points on their own steps (eval loss), not a line
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

// Note [Axis ticks]
// An axis is labelled at the multiples of a round step, 1, 2 or 5 times a
// power of ten, the smallest that cuts the range into at most
// kMaxIntervals; a value axis is widened to the multiples around its data,
// the step axis keeps the data's range and labels the multiples inside it.
// A label shows the digits the step needs ("0.5", "2", "0.5e-3"), so the
// ticks of one axis differ in their last shown digit.
constexpr int kMaxIntervals = 6;

struct Axis {
  double lo = 0, hi = 1, step = 1;
  std::vector<double> ticks;
};

Axis make_axis(double lo, double hi, bool widen, double min_step) {
  if (!(hi > lo)) {  // one value: a range around it
    const double pad = std::max(std::fabs(lo) * 0.05, min_step > 0 ? min_step : 1e-12);
    lo -= pad;
    hi += pad;
  }
  Axis a;
  const double raw = (hi - lo) / kMaxIntervals;
  double exponent = std::floor(std::log10(raw)) - 1;
  for (bool found = false; !found; exponent += 1) {
    for (double m : {1.0, 2.0, 5.0}) {
      const double step = m * std::pow(10.0, exponent);
      if (step < min_step) continue;
      const double n = std::ceil(hi / step - 1e-9) - std::floor(lo / step + 1e-9);
      if (n <= kMaxIntervals) {
        a.step = step;
        found = true;
        break;
      }
    }
  }
  a.lo = lo;
  a.hi = hi;
  if (widen) {
    a.lo = std::floor(lo / a.step + 1e-9) * a.step;
    a.hi = std::ceil(hi / a.step - 1e-9) * a.step;
  }
  const auto first = static_cast<int64_t>(std::ceil(a.lo / a.step - 1e-9));
  const auto last = static_cast<int64_t>(std::floor(a.hi / a.step + 1e-9));
  for (int64_t k = first; k <= last; ++k) a.ticks.push_back(static_cast<double>(k) * a.step);
  return a;
}

// The labels of an axis's ticks with the digits its step needs: fixed-point,
// or where the step is below 0.001 or a tick reaches a million, every label
// as a mantissa times the largest tick's power of ten ("0.5e-3 1.0e-3").
// See Note [Axis ticks].
std::vector<std::string> tick_labels(const Axis& axis) {
  const int step_exp = static_cast<int>(std::floor(std::log10(axis.step) + 1e-9));
  double largest = 0;
  for (double v : axis.ticks) largest = std::max(largest, std::fabs(v));
  const bool scientific = step_exp < -3 || largest >= 1e6;
  const int exp = largest > 0 ? static_cast<int>(std::floor(std::log10(largest) + 1e-9)) : 0;
  std::vector<std::string> out;
  for (double v : axis.ticks) {
    if (std::fabs(v) < axis.step * 1e-6) v = 0;  // no "-0.0"
    char buf[32];
    if (!scientific) {
      std::snprintf(buf, sizeof(buf), "%.*f", std::max(0, -step_exp), v);
    } else if (v == 0) {
      std::snprintf(buf, sizeof(buf), "0");
    } else {
      std::snprintf(buf, sizeof(buf), "%.*fe%d", std::max(0, exp - step_exp),
                    v / std::pow(10.0, exp), exp);
    }
    out.emplace_back(buf);
  }
  return out;
}

constexpr double kW = 520, kH = 220, kLeft = 64, kRight = 12, kTop = 28, kBottom = 34;
constexpr double kTitleFont = 13, kTickFont = 11;

// A generous width of `text` in px: wider than Helvetica's and DejaVu Sans's
// average glyph, so what is placed by it neither clips nor overlaps.
double text_width(const std::string& text, double font_size, bool bold = false) {
  return static_cast<double>(text.size()) * font_size * (bold ? 0.68 : 0.62);
}

std::string chart_open(const std::string& title) {
  std::ostringstream os;
  os << "<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kW
     << "\" height=\"" << kH << "\" viewBox=\"0 0 " << kW << ' ' << kH << "\">"
     << "<text x=\"" << kLeft << "\" y=\"18\" class=\"title\">" << escape(title) << "</text>";
  return os.str();
}

// A panel without data says why.
std::string empty_chart(const std::string& title, const std::string& why) {
  std::ostringstream os;
  os << chart_open(title) << "<text x=\"" << kW / 2 << "\" y=\"" << kH / 2
     << "\" text-anchor=\"middle\" class=\"none\">" << escape(why) << "</text></svg>";
  return os.str();
}

// The legend, right-aligned on the title's row, or on a row of its own
// below the title when the two would overlap; returns the plot's top.
double legend(std::ostringstream& os, const std::string& title, const std::vector<Series>& series) {
  double width = 0;
  for (const auto& s : series) width += text_width(s.name, kTickFont) + 26;
  const bool own_row = kLeft + text_width(title, kTitleFont, true) + 12 > kW - kRight - width;
  const double y = own_row ? 32 : 18;
  double x = kW - kRight;
  for (auto it = series.rbegin(); it != series.rend(); ++it) {
    x -= text_width(it->name, kTickFont) + 26;
    if (it->dots) {
      os << "<circle cx=\"" << x + 5 << "\" cy=\"" << y - 4 << "\" r=\"4\" fill=\"" << it->color
         << "\"/>";
    } else {
      os << "<rect x=\"" << x << "\" y=\"" << y - 9 << "\" width=\"10\" height=\"10\" fill=\""
         << it->color << "\"/>";
    }
    os << "<text x=\"" << x + 14 << "\" y=\"" << y << "\" class=\"tick\">" << escape(it->name)
       << "</text>";
  }
  return own_row ? kTop + 14 : kTop;
}

// One line chart: every series over the same step axis; `marks` (steps and
// values, e.g. loss spikes) ringed with their `mark_label`.
std::string line_chart(const std::string& title, const std::vector<Series>& series,
                       const std::string& why_empty, const Points& marks = {},
                       const std::string& mark_label = "") {
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const auto& s : series) {
    for (const auto& [x, y] : s.points) {
      x0 = std::min(x0, x);
      x1 = std::max(x1, x);
      y0 = std::min(y0, y);
      y1 = std::max(y1, y);
    }
  }
  if (!std::isfinite(x0)) return empty_chart(title, why_empty);
  std::vector<Series> shown;
  for (const auto& s : series) {
    if (!s.points.empty()) shown.push_back(s);
  }
  std::ostringstream os;
  os << chart_open(title);
  const double top = legend(os, title, shown);
  const Axis xa = make_axis(x0, x1, /*widen=*/false, /*min_step=*/1);
  const Axis ya = make_axis(y0, y1, /*widen=*/true, /*min_step=*/0);
  const double pw = kW - kLeft - kRight, ph = kH - top - kBottom;
  auto px = [&](double x) { return kLeft + (x - xa.lo) / (xa.hi - xa.lo) * pw; };
  auto py = [&](double y) { return top + (1 - (y - ya.lo) / (ya.hi - ya.lo)) * ph; };
  os << "<rect x=\"" << kLeft << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
     << "\" class=\"frame\"/>";
  const auto y_labels = tick_labels(ya), x_labels = tick_labels(xa);
  for (size_t i = 0; i < ya.ticks.size(); ++i) {
    const double y = py(ya.ticks[i]);
    os << "<line x1=\"" << kLeft << "\" x2=\"" << kLeft + pw << "\" y1=\"" << y << "\" y2=\"" << y
       << "\" class=\"grid\"/><text x=\"" << kLeft - 4 << "\" y=\"" << y + 4
       << "\" text-anchor=\"end\" class=\"tick y\">" << y_labels[i] << "</text>";
  }
  for (size_t i = 0; i < xa.ticks.size(); ++i) {
    os << "<text x=\"" << px(xa.ticks[i]) << "\" y=\"" << top + ph + 16
       << "\" text-anchor=\"middle\" class=\"tick x\">" << x_labels[i] << "</text>";
  }
  os << "<text x=\"" << kLeft + pw / 2 << "\" y=\"" << kH - 4
     << "\" text-anchor=\"middle\" class=\"tick\">step</text>";
  for (const auto& s : shown) {
    if (s.dots || s.points.size() == 1) {
      for (const auto& [x, y] : s.points) {
        os << "<circle cx=\"" << px(x) << "\" cy=\"" << py(y) << "\" r=\"4\" fill=\"" << s.color
           << "\"><title>" << escape(s.name) << " at step " << fmt(x) << ": " << fmt(y)
           << "</title></circle>";
      }
      continue;
    }
    os << "<polyline fill=\"none\" stroke=\"" << s.color << "\" stroke-width=\"2\" points=\"";
    for (const auto& [x, y] : s.points) os << px(x) << ',' << py(y) << ' ';
    os << "\"/>";
  }
  for (const auto& [x, y] : marks) {
    os << "<circle class=\"mark\" cx=\"" << px(x) << "\" cy=\"" << py(y)
       << "\" r=\"7\" fill=\"none\" stroke=\"#000\" stroke-width=\"1.5\"><title>" << mark_label
       << " at step " << fmt(x) << ": " << fmt(y) << "</title></circle>";
  }
  os << "</svg>";
  return os.str();
}

// Grouped bars: one group per rank, one bar per series.
std::string bar_chart(const std::string& title, const std::string& unit,
                      const std::vector<Series>& series, const std::string& why_empty) {
  size_t groups = 0;
  double top_value = 0;
  for (const auto& s : series) {
    groups = std::max(groups, s.points.size());
    for (const auto& p : s.points) top_value = std::max(top_value, p.second);
  }
  if (groups == 0 || top_value <= 0) return empty_chart(title, why_empty);
  std::ostringstream os;
  os << chart_open(title);
  const double top = legend(os, title, series);
  const Axis ya = make_axis(0, top_value, /*widen=*/true, /*min_step=*/0);
  const double pw = kW - kLeft - kRight, ph = kH - top - kBottom;
  const double gw = pw / static_cast<double>(groups);
  const double bw = gw * 0.7 / static_cast<double>(series.size());
  auto py = [&](double v) { return top + (1 - v / ya.hi) * ph; };
  os << "<rect x=\"" << kLeft << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
     << "\" class=\"frame\"/>";
  const auto y_labels = tick_labels(ya);
  for (size_t i = 0; i < ya.ticks.size(); ++i) {
    const double y = py(ya.ticks[i]);
    os << "<line x1=\"" << kLeft << "\" x2=\"" << kLeft + pw << "\" y1=\"" << y << "\" y2=\"" << y
       << "\" class=\"grid\"/><text x=\"" << kLeft - 4 << "\" y=\"" << y + 4
       << "\" text-anchor=\"end\" class=\"tick y\">" << y_labels[i] << "</text>";
  }
  for (size_t g = 0; g < groups; ++g) {
    os << "<text x=\"" << kLeft + gw * (static_cast<double>(g) + 0.5) << "\" y=\""
       << top + ph + 16 << "\" text-anchor=\"middle\" class=\"tick\">rank " << g << "</text>";
  }
  for (size_t s = 0; s < series.size(); ++s) {
    for (const auto& [g, v] : series[s].points) {
      const double h = v / ya.hi * ph;
      const double x = kLeft + gw * g + gw * 0.15 + bw * static_cast<double>(s);
      os << "<rect x=\"" << x << "\" y=\"" << top + ph - h << "\" width=\"" << bw
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

std::vector<int64_t> loss_spike_steps(const std::vector<nlohmann::json>& records,
                                      double loss_spike_factor) {
  std::vector<int64_t> out;
  std::optional<double> mean;
  for (const auto& [step, loss] : column(records, "loss")) {
    if (mean && loss > loss_spike_factor * *mean) out.push_back(static_cast<int64_t>(step));
    mean = mean ? kLossMeanDecay * *mean + (1 - kLossMeanDecay) * loss : loss;
  }
  return out;
}

std::string run_report_html(const std::vector<nlohmann::json>& records, const std::string& title,
                            const std::string& schedule_svg, const ReportOptions& options) {
  const double gib = 1.0 / (1024.0 * 1024 * 1024);
  const auto loss = column(records, "loss");
  const auto eval = column(records, "eval_loss");
  const auto spikes = loss_spike_steps(records, options.loss_spike_factor);
  // Why a panel has nothing to draw: no step yet, or what it needs.
  auto why = [&](const std::string& needs) { return loss.empty() ? "no steps recorded" : needs; };
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
  os << "<table class=\"summary\">";
  if (!loss.empty()) {
    os << "<tr><td>steps</td><td>" << fmt(loss.back().first) << "</td></tr>"
       << "<tr><td>final loss</td><td>" << fmt(loss.back().second) << "</td></tr>";
  }
  if (!eval.empty()) os << "<tr><td>last eval loss</td><td>" << fmt(eval.back().second) << "</td></tr>";
  const std::string spike_rule = str("loss above ", fmt(options.loss_spike_factor),
                                     " &times; its running mean");
  if (!loss.empty()) {
    os << "<tr><td>loss spikes</td><td class=\"spikes\">" << spikes.size();
    if (!spikes.empty()) {
      os << (spikes.size() == 1 ? ", at step " : ", at steps ");
      for (size_t i = 0; i < spikes.size() && i < 10; ++i) os << (i ? ", " : "") << spikes[i];
      if (spikes.size() > 10) os << ", ...";
    }
    os << " (" << spike_rule << ")</td></tr>";
  }
  // block_causal runs: every step's windows hold the same tokens, so the
  // run's mean document length is the harmonic mean of the steps' values.
  const auto doc_tokens = column(records, "mean_document_tokens");
  double inverse_sum = 0;
  for (const auto& [step, tokens] : doc_tokens) inverse_sum += tokens > 0 ? 1.0 / tokens : 0.0;
  if (inverse_sum > 0) {
    os << "<tr><td>mean document length</td><td class=\"documents\">"
       << fmt(static_cast<double>(doc_tokens.size()) / inverse_sum)
       << " tokens (the documents that start in the run's windows)</td></tr>";
  }
  os << "</table>\n<h2>Training</h2>\n<div class=\"grid-charts\">\n";
  std::vector<Series> loss_series{{"loss", "#1f77b4", loss}};
  if (!eval.empty()) loss_series.push_back({"eval loss", "#d62728", eval, /*dots=*/true});
  Points spike_points;
  for (const auto& [step, value] : loss) {
    if (std::binary_search(spikes.begin(), spikes.end(), static_cast<int64_t>(step))) {
      spike_points.emplace_back(step, value);
    }
  }
  os << line_chart("loss", loss_series, why("no values recorded"), spike_points, "loss spike") << '\n'
     << line_chart("learning rate", {{"lr", "#2ca02c", column(records, "lr")}}, why("no values recorded")) << '\n'
     << line_chart("gradient norm (before clipping)",
                   {{"grad norm", "#9467bd", column(records, "grad_norm")}}, why("no values recorded"))
     << '\n'
     << line_chart("throughput", {{"tokens/s", "#ff7f0e", column(records, "tokens_per_sec")}},
                   why("no values recorded"))
     << '\n'
     << line_chart("MFU (%)", {{"MFU", "#8c564b", column(records, "mfu", 100.0)}},
                   why("MFU needs a GPU with a known peak"))
     << '\n';
  if (const auto docs = column(records, "documents_per_window"); !docs.empty()) {
    os << line_chart("documents per window", {{"documents", "#7f7f7f", docs}},
                     why("no values recorded"))
       << '\n';
  }
  // MoE runs: the balance the selection bias keeps (1 = every expert
  // equally loaded).
  if (const auto imbalance = max_of_array(records, "moe_load_max_over_mean"); !imbalance.empty()) {
    os << line_chart("MoE load: busiest expert / mean (worst layer)",
                     {{"max / mean", "#bcbd22", imbalance}}, why("no values recorded"))
       << '\n';
  }
  os << "</div>\n<h2>Ranks</h2>\n<div class=\"grid-charts\">\n";
  auto memory = per_rank_last(records, "peak_memory_bytes_per_rank", gib);
  if (memory.empty()) {
    const auto last = column(records, "peak_memory_bytes", gib);
    if (!last.empty()) memory.emplace_back(0.0, last.back().second);
  }
  os << bar_chart("peak memory per rank (GiB)", " GiB", {{"peak", "#17becf", memory}},
                  why("no peak memory recorded"))
     << '\n';
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
                  {{"measured", "#e377c2", measured_pct}, {"simulated", "#7f7f7f", simulated}},
                  why("the bubble needs pp > 1 and metrics.pipeline_timing"))
     << "\n</div>\n";
  if (!schedule_svg.empty()) {
    os << "<h2>Schedule</h2>\n<div>" << schedule_svg << "</div>\n";
  }
  os << "</body></html>\n";
  return os.str();
}

fs::path write_run_report(const fs::path& dump, const std::string& title,
                          const std::string& schedule_svg, const ReportOptions& options) {
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
  atomic_write_file(out, run_report_html(records, title, svg, options));
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
    const std::string svg =
        pipeline::timeline_svg(plan.lowered, plan.simulation, pipeline::timeline_title(plan));
    atomic_write_file(dump / "schedule.svg", svg);
    const auto path =
        write_run_report(dump, title, svg, ReportOptions{job.metrics.loss_spike_factor});
    log::info("run report: ", path.string());
  } catch (const std::exception& e) {
    log::warn("cannot write the run report: ", e.what());
  }
}

}  // namespace viaduct
