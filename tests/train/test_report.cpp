// The run report: the page holds every curve as inline SVG with no script
// and nothing fetched, a run writes it, and a real browser (Debian's
// chromium, headless) loads it and draws the curves.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/process_runs.h"
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
  // loss, eval loss, lr, grad norm, tokens/s, MFU.
  EXPECT_EQ(count(html, "<polyline"), 6u);
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

TEST(Report, EmptyCurvesSayNoData) {
  const auto html = run_report_html({}, "empty", "");
  EXPECT_EQ(count(html, "<polyline"), 0u);
  EXPECT_GE(count(html, ">no data<"), 5u);
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

TEST(Report, ChromiumLoadsThePageAndDrawsTheCurves) {
  std::string chromium;
  for (const char* c : {"chromium", "chromium-browser"}) {
    if (shell(std::string("command -v ") + c).exit_code == 0) chromium = c;
  }
  if (chromium.empty()) GTEST_SKIP() << "chromium (Debian package chromium) is not installed";
  TempDir dir;
  const fs::path page = dir.path() / "report.html";
  std::ofstream(page) << run_report_html(pipeline_records(), "a run", "");
  // --disable-dev-shm-usage: containers often have a tiny /dev/shm.
  const std::string flags =
      " --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --hide-scrollbars"
      " --window-size=1200,1400 --user-data-dir=" + dir.file("profile");
  // Loaded: the DOM after the load holds the whole page.
  const auto dom = shell("timeout 120 " + chromium + flags + " --dump-dom file://" +
                         page.string() + " 2>/dev/null");
  ASSERT_EQ(dom.exit_code, 0) << dom.output;
  EXPECT_EQ(count(dom.output, "<polyline"), 6u) << dom.output.substr(0, 2000);
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

}  // namespace
}  // namespace viaduct
