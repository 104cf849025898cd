// The run report: the page holds every curve as inline SVG with no script
// and nothing fetched, a run writes it, and a real browser (Debian's
// chromium, headless) loads it and draws the curves.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/process_runs.h"
#include "core/check.h"
#include "data/temp_dir.h"
#include "train/report.h"

namespace viaduct {
namespace {
namespace fs = std::filesystem;
using data::testing::TempDir;
using testing::shell;

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// Ten steps of a two-rank pipeline with evals at 5 and 10.
std::vector<nlohmann::json> pipeline_records() {
  std::vector<nlohmann::json> out;
  for (int s = 1; s <= 10; ++s) {
    out.push_back({{"step", s},
                   {"loss", 6.0 - 0.3 * s},
                   {"grad_norm", 2.0 / s},
                   {"lr", 1e-3 * s / 10},
                   {"tokens_per_sec", 1000.0 + 10 * s},
                   {"mfu", 0.3 + 0.001 * s},
                   {"peak_memory_bytes", 2.0e9},
                   {"peak_memory_bytes_per_rank", {2.0e9, 1.5e9}},
                   {"bubble_measured_per_rank", {0.30, 0.25}},
                   {"bubble_simulated", 0.2}});
    if (s % 5 == 0) out.push_back({{"step", s}, {"eval_loss", 6.1 - 0.3 * s}});
  }
  return out;
}

TEST(Report, PageHoldsEveryCurveAndNeitherScriptNorNetwork) {
  const auto html = run_report_html(pipeline_records(), "a run", "<svg id=\"timeline\"></svg>");
  // loss, lr, grad norm, tokens/s, MFU; eval loss as points on its steps.
  EXPECT_EQ(count(html, "<polyline"), 5u);
  EXPECT_EQ(count(html, "<title>eval loss at step"), 2u);
  EXPECT_NE(html.find("<title>eval loss at step 10: 3.1</title>"), std::string::npos) << html;
  // Memory: 2 ranks; bubble: measured and simulated for 2 ranks.
  EXPECT_EQ(count(html, "<title>peak, rank"), 2u);
  EXPECT_EQ(count(html, "<title>measured, rank"), 2u);
  EXPECT_EQ(count(html, "<title>simulated, rank"), 2u);
  EXPECT_NE(html.find("measured, rank 0: 30%"), std::string::npos) << html;
  EXPECT_NE(html.find("peak, rank 1: 1.397 GiB"), std::string::npos) << html;
  EXPECT_NE(html.find("<svg id=\"timeline\">"), std::string::npos);
  EXPECT_EQ(html.find("<script"), std::string::npos);
  // The only URL is the SVG namespace, which nothing fetches.
  EXPECT_EQ(count(html, "http"), count(html, "http://www.w3.org/2000/svg"));
  EXPECT_EQ(html.find(" src="), std::string::npos);
}

TEST(Report, EmptyPanelsSayWhy) {
  const auto empty = run_report_html({}, "empty", "");
  EXPECT_EQ(count(empty, "<polyline"), 0u);
  EXPECT_EQ(count(empty, ">no steps recorded<"), 7u);
  // A one-rank CPU run: no MFU (no known peak), no bubble (pp = 1).
  std::vector<nlohmann::json> cpu;
  for (int s = 1; s <= 4; ++s) {
    cpu.push_back({{"step", s}, {"loss", 5.0 - 0.5 * s}, {"grad_norm", 1.0}, {"lr", 1e-3},
                   {"tokens_per_sec", 900.0}, {"mfu", nullptr}, {"peak_memory_bytes", 3.0e8}});
  }
  const auto html = run_report_html(cpu, "cpu", "");
  EXPECT_EQ(count(html, "<polyline"), 4u);
  EXPECT_EQ(count(html, ">MFU needs a GPU with a known peak<"), 1u) << html;
  EXPECT_EQ(count(html, ">the bubble needs pp &gt; 1 and metrics.pipeline_timing<"), 1u) << html;
  EXPECT_EQ(html.find("no data"), std::string::npos);
  EXPECT_EQ(html.find("no steps recorded"), std::string::npos);
}

// Loss 2 for ten steps, then 2.8 (1.4 x the running mean 2), 2 and 2.7
// (1.303 x the mean 0.9 (0.9 2 + 0.1 2.8) + 0.1 2 = 2.072).
std::vector<nlohmann::json> records_with_a_spike() {
  std::vector<nlohmann::json> out;
  const double losses[] = {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2.8, 2, 2.7, 2};
  for (int s = 1; s <= 14; ++s) {
    out.push_back({{"step", s}, {"loss", losses[s - 1]}, {"grad_norm", 1.0}, {"lr", 1e-3}});
  }
  return out;
}

TEST(Report, LossSpikesAreMarkedAndCounted) {
  const auto records = records_with_a_spike();
  EXPECT_EQ(loss_spike_steps(records, 1.35), std::vector<int64_t>{11});
  EXPECT_EQ(loss_spike_steps(records, 1.3), (std::vector<int64_t>{11, 13}));
  EXPECT_EQ(loss_spike_steps(records, 1.5), std::vector<int64_t>{});
  const auto html = run_report_html(records, "spiky", "", ReportOptions{1.35});
  EXPECT_EQ(count(html, "class=\"mark\""), 1u);
  EXPECT_NE(html.find("<title>loss spike at step 11: 2.8</title>"), std::string::npos) << html;
  EXPECT_NE(html.find("<td class=\"spikes\">1, at step 11 (loss above 1.35 &times; its running mean)"),
            std::string::npos)
      << html;
  const auto lower = run_report_html(records, "spiky", "", ReportOptions{1.3});
  EXPECT_EQ(count(lower, "class=\"mark\""), 2u);
  EXPECT_NE(lower.find("<td class=\"spikes\">2, at steps 11, 13 ("), std::string::npos);
  const auto none = run_report_html(pipeline_records(), "smooth", "");
  EXPECT_EQ(count(none, "class=\"mark\""), 0u);
  EXPECT_NE(none.find("<td class=\"spikes\">0 ("), std::string::npos);
}

// block_causal runs: 120 window tokens per step, with 10 documents starting
// in step 1's windows, 30 in step 2's and none in step 3's: 360 tokens over
// 40 documents, 9 tokens a document.
TEST(Report, MeanDocumentLengthOverTheRun) {
  std::vector<nlohmann::json> records;
  const double starts[3] = {10, 30, 0};
  for (int s = 1; s <= 3; ++s) {
    records.push_back({{"step", s},
                       {"loss", 3.0},
                       {"documents_per_window", 2.0 + s},
                       {"mean_document_tokens", starts[s - 1] > 0 ? 120.0 / starts[s - 1] : 0.0}});
  }
  const auto html = run_report_html(records, "documents", "");
  EXPECT_NE(html.find("<td class=\"documents\">9 tokens"), std::string::npos) << html;
  EXPECT_NE(html.find("documents per window"), std::string::npos);
  EXPECT_EQ(run_report_html(pipeline_records(), "causal", "").find("mean document length"),
            std::string::npos);
}

// The labels of each chart's `axis` ("x" or "y") ticks, chart by chart.
std::vector<std::vector<std::string>> tick_labels(const std::string& html, const std::string& axis) {
  std::vector<std::vector<std::string>> out;
  const std::string chart = "<svg class=\"chart\"", tick = "class=\"tick " + axis + "\">";
  for (size_t at = html.find(chart); at != std::string::npos;) {
    const size_t next = html.find(chart, at + 1);
    const std::string svg = html.substr(at, next == std::string::npos ? std::string::npos : next - at);
    std::vector<std::string> labels;
    for (size_t t = svg.find(tick); t != std::string::npos; t = svg.find(tick, t + 1)) {
      const size_t b = t + tick.size();
      labels.push_back(svg.substr(b, svg.find('<', b) - b));
    }
    if (!labels.empty()) out.push_back(labels);
    at = next;
  }
  return out;
}

// Round ticks: evenly spaced multiples of 1, 2 or 5 times a power of ten,
// every label of an axis with the same digits after the point, and the
// last of them needed by one label at least ("0.5 1.0 1.5", never "1.00 2.00").
void expect_round_ticks(const std::vector<std::string>& labels, const std::string& where) {
  ASSERT_GE(labels.size(), 2u) << where;
  std::vector<double> v;
  for (const auto& l : labels) v.push_back(std::stod(l));
  const double step = v[1] - v[0];
  ASSERT_GT(step, 0) << where;
  const double mantissa = step / std::pow(10.0, std::floor(std::log10(step) + 1e-9));
  EXPECT_TRUE(std::fabs(mantissa - 1) < 1e-6 || std::fabs(mantissa - 2) < 1e-6 ||
              std::fabs(mantissa - 5) < 1e-6)
      << where << ": step " << step;
  for (size_t i = 1; i < v.size(); ++i) {
    EXPECT_NEAR(v[i] - v[i - 1], step, step * 1e-6) << where << ": " << labels[i];
  }
  for (double x : v) EXPECT_NEAR(x / step, std::round(x / step), 1e-6) << where << ": " << x;
  // Scientific labels: one power of ten for the axis, the same test on the
  // mantissas.
  std::vector<std::string> mantissas;
  std::set<std::string> powers;
  for (const auto& l : labels) {
    if (l == "0") continue;
    const size_t e = l.find('e');
    mantissas.push_back(l.substr(0, e));
    powers.insert(e == std::string::npos ? "" : l.substr(e));
  }
  EXPECT_EQ(powers.size(), 1u) << where << ": " << labels[0] << " .. " << labels.back();
  auto decimals = [](const std::string& l) {
    const size_t dot = l.find('.');
    return dot == std::string::npos ? size_t{0} : l.size() - dot - 1;
  };
  bool needed = decimals(mantissas.at(0)) == 0;
  for (const auto& m : mantissas) {
    EXPECT_EQ(decimals(m), decimals(mantissas[0])) << where << ": " << m;
    if (m.back() != '0') needed = true;
  }
  EXPECT_TRUE(needed) << where << ": " << labels[0] << " .. " << labels.back();
}

// Curves over awkward ranges: the fractions of the range earlier reports
// printed (0.09449, 0.2835) and values from 1e-5 to 1e5.
std::vector<nlohmann::json> awkward_records() {
  std::vector<nlohmann::json> out;
  for (int s = 3; s <= 157; ++s) {
    out.push_back({{"step", s},
                   {"loss", 0.09449 + 0.2835 * (157 - s) / 154.0},
                   {"grad_norm", 208.9 + 3.3 * s},
                   {"lr", 3.7e-5 * s / 157},
                   {"tokens_per_sec", 98000.0 + 17 * s},
                   {"mfu", 0.00123 + 0.00001 * s},
                   {"peak_memory_bytes_per_rank", {2.7e9, 1.3e9, 0.4e9}},
                   {"bubble_measured_per_rank", {0.131, 0.077, 0.02}},
                   {"bubble_simulated", 0.0833}});
  }
  return out;
}

TEST(Report, TickValuesAreRound) {
  for (const auto& [name, records] :
       {std::pair{"pipeline", pipeline_records()}, std::pair{"awkward", awkward_records()},
        std::pair{"spiky", records_with_a_spike()}}) {
    const auto html = run_report_html(records, name, "");
    const auto ys = tick_labels(html, "y"), xs = tick_labels(html, "x");
    EXPECT_GE(ys.size(), 3u) << name;
    EXPECT_GE(xs.size(), 3u) << name;
    for (size_t i = 0; i < ys.size(); ++i) expect_round_ticks(ys[i], str(name, " y axis ", i));
    for (size_t i = 0; i < xs.size(); ++i) expect_round_ticks(xs[i], str(name, " x axis ", i));
  }
  // The loss axis of the awkward curve: 0.0 to 0.4 by 0.1 (its data: 0.0945
  // to 0.378), the step axis 50, 100, 150 (data: 3 to 157).
  const auto html = run_report_html(awkward_records(), "awkward", "");
  EXPECT_EQ(tick_labels(html, "y").at(0),
            (std::vector<std::string>{"0.0", "0.1", "0.2", "0.3", "0.4"}));
  EXPECT_EQ(tick_labels(html, "x").at(0), (std::vector<std::string>{"50", "100", "150"}));
}

TEST(Report, ARunWritesItBesideTheMetrics) {
  TempDir dir;
  testing::write_random_corpus(dir.file("corpus.tok"), 3, 6000);
  const auto r = shell(std::string(VIADUCT_BINARY) + " train --data.path=" + dir.file("corpus.tok") +
                       " --job.dump_folder=" + dir.file("run") +
                       " --training.steps=3 --training.eval_interval=0 --training.seq_len=32"
                       " --training.local_batch_size=2 --model.n_layers=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path page = dir.file("run/report.html");
  ASSERT_TRUE(fs::exists(page)) << r.output;
  std::ifstream in(page);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_EQ(count(ss.str(), "<polyline"), 4u);  // loss, lr, grad norm, tokens/s (no MFU on CPU)
  EXPECT_NE(ss.str().find("<h2>Schedule</h2>"), std::string::npos);
  // And the command writes it again from the folder alone.
  fs::remove(page);
  const auto again = shell(std::string(VIADUCT_BINARY) + " report " + dir.file("run"));
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_TRUE(fs::exists(page));
}

// Counts the pixels of each "r,g,b" colour in an 8-bit RGB(A) PNG (stdlib
// only: zlib and the five PNG row filters).
constexpr const char* kCountPixels = R"PY(
import struct, sys, zlib
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
pos, idat = 8, b""
while pos < len(data):
    n, kind = struct.unpack(">I4s", data[pos:pos + 8])
    body = data[pos + 8:pos + 8 + n]
    if kind == b"IHDR":
        w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
    elif kind == b"IDAT":
        idat += body
    pos += 12 + n
assert depth == 8 and ctype in (2, 6), (depth, ctype)
bpp = 3 if ctype == 2 else 4
raw, stride = zlib.decompress(idat), w * bpp
rows, prev, i = [], bytearray(stride), 0
for _ in range(h):
    f, line = raw[i], bytearray(raw[i + 1:i + 1 + stride])
    i += 1 + stride
    for x in range(stride):
        a = line[x - bpp] if x >= bpp else 0
        b, c = prev[x], prev[x - bpp] if x >= bpp else 0
        if f == 1: line[x] = (line[x] + a) & 255
        elif f == 2: line[x] = (line[x] + b) & 255
        elif f == 3: line[x] = (line[x] + (a + b) // 2) & 255
        elif f == 4:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    rows.append(line)
    prev = line
for want in sys.argv[2:]:
    r, g, b = map(int, want.split(","))
    n = sum(1 for row in rows for x in range(0, stride, bpp)
            if abs(row[x] - r) < 12 and abs(row[x + 1] - g) < 12 and abs(row[x + 2] - b) < 12)
    print(want, n)
)PY";

std::string find_chromium() {
  for (const char* c : {"chromium", "chromium-browser"}) {
    if (shell(std::string("command -v ") + c).exit_code == 0) return c;
  }
  return "";
}

// --disable-dev-shm-usage: containers often have a tiny /dev/shm.
std::string chromium_flags(const TempDir& dir) {
  return " --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --hide-scrollbars"
         " --window-size=1200,1480 --user-data-dir=" + dir.file("profile");
}

TEST(Report, ChromiumLoadsThePageAndDrawsTheCurves) {
  const std::string chromium = find_chromium();
  if (chromium.empty()) GTEST_SKIP() << "chromium (Debian package chromium) is not installed";
  TempDir dir;
  const fs::path page = dir.path() / "report.html";
  std::ofstream(page) << run_report_html(pipeline_records(), "a run", "");
  const std::string flags = chromium_flags(dir);
  // Loaded: the DOM after the load holds the whole page.
  const auto dom = shell("timeout 120 " + chromium + flags + " --dump-dom file://" +
                         page.string() + " 2>/dev/null");
  ASSERT_EQ(dom.exit_code, 0) << dom.output;
  EXPECT_EQ(count(dom.output, "<polyline"), 5u) << dom.output.substr(0, 2000);
  EXPECT_NE(dom.output.find("</html>"), std::string::npos);
  // Drawn: the screenshot holds the curves' colours.
  const auto shot = shell("timeout 120 " + chromium + flags + " --screenshot=" +
                          dir.file("page.png") + " file://" + page.string());
  ASSERT_EQ(shot.exit_code, 0) << shot.output;
  ASSERT_TRUE(fs::exists(dir.file("page.png"))) << shot.output;
  std::ofstream(dir.file("count.py")) << kCountPixels;
  // loss (blue), eval loss (red), lr (green), the memory bars (cyan).
  const auto px = shell("python3 " + dir.file("count.py") + " " + dir.file("page.png") +
                        " 31,119,180 214,39,40 44,160,44 23,190,207");
  ASSERT_EQ(px.exit_code, 0) << px.output;
  std::istringstream lines(px.output);
  std::string colour;
  long n = 0;
  int seen = 0;
  while (lines >> colour >> n) {
    EXPECT_GT(n, 50) << colour << " is (nearly) absent from the screenshot:\n" << px.output;
    ++seen;
  }
  EXPECT_EQ(seen, 4) << px.output;
}

// Measures the drawn page in the browser: every text's box against its
// picture's (a text outside is clipped) and, within a chart, against the
// other texts (overlapping); one line per fault, then the count of texts.
constexpr const char* kMeasureTexts = R"JS(
<script>
const faults = [];
let texts = 0;
const inside = (r, b) => r.left >= b.left - 0.5 && r.right <= b.right + 0.5 &&
                         r.top >= b.top - 0.5 && r.bottom <= b.bottom + 0.5;
const overlap = (a, b) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > 1 &&
                          Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 1;
for (const svg of document.querySelectorAll("svg")) {
  const box = svg.getBoundingClientRect();
  const rects = [];
  for (const t of svg.querySelectorAll("text")) {
    ++texts;
    const r = t.getBoundingClientRect();
    if (!inside(r, box)) faults.push("clipped: " + t.textContent);
    rects.push([t.textContent, r]);
  }
  if (!svg.classList.contains("chart")) continue;
  for (let i = 0; i < rects.length; ++i)
    for (let j = i + 1; j < rects.length; ++j)
      if (overlap(rects[i][1], rects[j][1]))
        faults.push("overlapping: " + rects[i][0] + " | " + rects[j][0]);
}
const pre = document.createElement("pre");
pre.id = "measured";
pre.textContent = faults.join("\n") + "\ntexts " + texts + "\n";
document.body.appendChild(pre);
</script>
)JS";

// The faults kMeasureTexts finds in `html` drawn by chromium, and the count
// of texts it measured.
std::pair<std::vector<std::string>, long> measure_texts(const std::string& chromium,
                                                        const TempDir& dir,
                                                        const std::string& html) {
  std::string measured = html;
  measured.insert(measured.rfind("</body>"), kMeasureTexts);
  const fs::path page = dir.path() / "measured.html";
  std::ofstream(page) << measured;
  const auto dom = shell("timeout 120 " + chromium + chromium_flags(dir) +
                         " --dump-dom file://" + page.string() + " 2>/dev/null");
  EXPECT_EQ(dom.exit_code, 0) << dom.output;
  const std::string open = "<pre id=\"measured\">";
  const size_t at = dom.output.find(open);
  if (at == std::string::npos) {
    ADD_FAILURE() << "the measuring script did not run:\n" << dom.output.substr(0, 2000);
    return {{}, 0};
  }
  std::istringstream lines(dom.output.substr(at + open.size(),
                                             dom.output.find("</pre>", at) - at - open.size()));
  std::vector<std::string> faults;
  long texts = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("texts ", 0) == 0) {
      texts = std::stol(line.substr(6));
    } else if (!line.empty()) {
      faults.push_back(line);
    }
  }
  return {faults, texts};
}

// The demo's report (bash scripts/demo.sh: configs/llama_debug.toml, its
// metrics.jsonl kept as tests/train/demo_metrics.jsonl and its schedule from
// `viaduct schedule`) as a browser draws it: round ticks, no text clipped
// or overlapping, no spike. With VIADUCT_REPORT_SCREENSHOT=FILE the
// screenshot is kept there (the README's picture, docs/images/demo_report.png).
TEST(Report, ChromiumDrawsTheDemoReportWithEveryTextInItsBox) {
  const std::string chromium = find_chromium();
  if (chromium.empty()) GTEST_SKIP() << "chromium (Debian package chromium) is not installed";
  TempDir dir;
  std::vector<nlohmann::json> records;
  std::ifstream in(std::string(VIADUCT_SOURCE_DIR) + "/tests/train/demo_metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) records.push_back(nlohmann::json::parse(line));
  }
  ASSERT_GT(records.size(), 100u);
  const auto schedule = shell(std::string(VIADUCT_BINARY) + " schedule --config " +
                              VIADUCT_SOURCE_DIR + "/configs/llama_debug.toml --svg " +
                              dir.file("schedule.svg"));
  ASSERT_EQ(schedule.exit_code, 0) << schedule.output;
  std::ifstream svg_in(dir.file("schedule.svg"));
  std::stringstream svg;
  svg << svg_in.rdbuf();
  EXPECT_NE(svg.str().find("1 rank, 1 stage, 1 micro-batch;"), std::string::npos) << svg.str();
  const auto html = run_report_html(records, "llama debugmodel on fortunes (CPU)", svg.str());
  EXPECT_EQ(loss_spike_steps(records, ReportOptions{}.loss_spike_factor), std::vector<int64_t>{});
  for (const auto& axis : {"x", "y"}) {
    const auto labels = tick_labels(html, axis);
    EXPECT_GE(labels.size(), 3u) << axis;
    for (size_t i = 0; i < labels.size(); ++i) expect_round_ticks(labels[i], str("demo ", axis, i));
  }
  // The measure itself against a page with one clipped caption and two
  // overlapping texts.
  const auto [control, control_texts] = measure_texts(
      chromium, dir,
      "<html><body><svg width=\"120\" height=\"40\"><text x=\"4\" y=\"20\">a caption far "
      "wider than its picture</text></svg><svg class=\"chart\" width=\"300\" height=\"40\">"
      "<text x=\"4\" y=\"20\">title</text><text x=\"10\" y=\"22\">legend</text></svg>"
      "</body></html>");
  EXPECT_EQ(control_texts, 3);
  EXPECT_EQ(control, (std::vector<std::string>{"clipped: a caption far wider than its picture",
                                               "overlapping: title | legend"}));
  // A two-rank pipeline's page with its schedule (Interleaved 1F1B, two
  // stages per rank).
  const auto pp2 = shell(std::string(VIADUCT_BINARY) + " schedule --config " + VIADUCT_SOURCE_DIR +
                         "/configs/llama_debug.toml --parallelism.pipeline_parallel_degree=2"
                         " --parallelism.pipeline_parallel_stages_per_rank=2"
                         " --parallelism.pipeline_parallel_schedule=Interleaved1F1B --svg " +
                         dir.file("pp2.svg"));
  ASSERT_EQ(pp2.exit_code, 0) << pp2.output;
  std::ifstream pp2_in(dir.file("pp2.svg"));
  std::stringstream pp2_svg;
  pp2_svg << pp2_in.rdbuf();
  EXPECT_NE(pp2_svg.str().find(">2 ranks, 4 stages, 4 micro-batches;"), std::string::npos)
      << pp2_svg.str().substr(0, 1500);
  for (const auto& [name, page] :
       {std::pair{"demo", html},
        std::pair{"pipeline", run_report_html(pipeline_records(), "a run", pp2_svg.str())},
        std::pair{"awkward", run_report_html(awkward_records(), "awkward", "")}}) {
    const auto [faults, texts] = measure_texts(chromium, dir, page);
    EXPECT_GT(texts, 30) << name;
    EXPECT_TRUE(faults.empty()) << name << ":\n" << ::testing::PrintToString(faults);
  }
  std::ofstream(dir.file("demo.html")) << html;
  const auto shot = shell("timeout 120 " + chromium + chromium_flags(dir) + " --screenshot=" +
                          dir.file("demo.png") + " file://" + dir.file("demo.html"));
  ASSERT_EQ(shot.exit_code, 0) << shot.output;
  ASSERT_TRUE(fs::exists(dir.file("demo.png"))) << shot.output;
  if (const char* keep = std::getenv("VIADUCT_REPORT_SCREENSHOT"); keep && *keep) {
    fs::copy_file(dir.file("demo.png"), keep, fs::copy_options::overwrite_existing);
  }
}

}  // namespace
}  // namespace viaduct
