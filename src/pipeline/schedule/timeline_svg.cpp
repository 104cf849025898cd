// SVG timeline of a simulated schedule (see timeline_svg.h).
#include "pipeline/schedule/timeline_svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/check.h"
#include "core/strings.h"

namespace viaduct::pipeline {
namespace {

constexpr double kLeft = 70, kTop = 56, kRowH = 30, kRowGap = 8;

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else if (c == '"') out += "&quot;";
    else out += c;
  }
  return out;
}

// A generous width of `text` at `font_size` px: wider than Helvetica's and
// DejaVu Sans's average glyph, so a picture sized by it never clips its text.
double text_width(const std::string& text, double font_size, bool bold = false) {
  return static_cast<double>(text.size()) * font_size * (bold ? 0.68 : 0.62);
}

// Micro-batch hue: golden-angle steps keep neighbours apart.
double hue(int64_t mb) { return std::fmod(static_cast<double>(mb) * 137.508, 360.0); }

std::string hsl(double h, int s, int l) {
  return str("hsl(", num(h), ",", s, "%,", l, "%)");
}

struct Style {
  std::string fill, stroke, dash, text;
};

Style style_of(ActionKind k, int64_t mb) {
  const double h = hue(mb);
  switch (k) {
    case ActionKind::kForward: return {hsl(h, 70, 68), hsl(h, 60, 35), "", "#111"};
    case ActionKind::kBackward: return {hsl(h, 60, 36), hsl(h, 60, 22), "", "#fff"};
    case ActionKind::kBackwardInput: return {hsl(h, 60, 46), hsl(h, 60, 20), "3,2", "#fff"};
    default: return {hsl(h, 50, 88), hsl(h, 60, 35), "1,2", "#222"};  // W
  }
}

}  // namespace

std::string timeline_svg(const Schedule& sch, const SimulationResult& sim,
                         const std::string& title) {
  const double span = std::max(sim.makespan, 1e-9);
  const double scale = std::clamp(1100.0 / span, 4.0, 60.0);  // px per unit
  const double plot_w = span * scale;
  const std::string caption =
      str(count_of(sch.pp, "rank"), ", ", count_of(sch.num_stages, "stage"), ", ",
          count_of(sch.microbatches, "micro-batch", "micro-batches"), "; makespan ",
          num(sim.makespan), ", bubble ", num(100.0 * sim.bubble_fraction), "% (hatched)");
  const std::pair<ActionKind, const char*> kinds[] = {
      {ActionKind::kForward, "F forward"},
      {ActionKind::kBackward, "B backward"},
      {ActionKind::kBackwardInput, "I input grad"},
      {ActionKind::kBackwardWeight, "W weight grad"}};
  const char* const kIdle = "idle (bubble)";
  const char* const kKey =
      "colour = micro-batch; label = stage, kind, micro-batch (torch's text form)";
  // The legend's entries side by side: a swatch, its name, a gap.
  auto entry_width = [](const std::string& name) { return 24 + text_width(name, 11) + 16; };
  double legend_w = entry_width(kIdle);
  for (const auto& [k, name] : kinds) legend_w += entry_width(name);
  // Wide enough for the plot and for every line of text.
  const double width =
      kLeft + 24 +
      std::max({plot_w, text_width(title, 16, /*bold=*/true), text_width(caption, 12),
                legend_w, text_width(kKey, 11)});
  const int64_t rows = sch.pp;
  const double plot_h = rows * (kRowH + kRowGap);
  const double height = kTop + plot_h + 80;
  std::string o;
  o += str("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"", num(width),
           "\" height=\"", num(height), "\" viewBox=\"0 0 ", num(width), " ",
           num(height), "\" font-family=\"Helvetica,Arial,sans-serif\">\n");
  o += "<defs><pattern id=\"idle\" width=\"6\" height=\"6\" "
       "patternUnits=\"userSpaceOnUse\" patternTransform=\"rotate(45)\">"
       "<rect width=\"6\" height=\"6\" fill=\"#f2f2f2\"/>"
       "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#c8c8c8\" "
       "stroke-width=\"2\"/></pattern></defs>\n";
  o += "<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n";
  o += str("<text x=\"", num(kLeft), "\" y=\"22\" font-size=\"16\" "
           "font-weight=\"bold\">", escape(title), "</text>\n");
  o += str("<text x=\"", num(kLeft), "\" y=\"42\" font-size=\"12\" fill=\"#444\">",
           escape(caption), "</text>\n");
  for (int64_t r = 0; r < rows; ++r) {
    const double y = kTop + r * (kRowH + kRowGap);
    o += str("<text x=\"", num(kLeft - 8), "\" y=\"", num(y + kRowH / 2 + 4),
             "\" font-size=\"12\" text-anchor=\"end\">rank ", r, "</text>\n");
    o += str("<rect x=\"", num(kLeft), "\" y=\"", num(y), "\" width=\"",
             num(plot_w), "\" height=\"", num(kRowH), "\" fill=\"url(#idle)\"/>\n");
    if (r >= static_cast<int64_t>(sim.timeline.size())) continue;
    for (const auto& t : sim.timeline[r]) {
      const auto st = style_of(t.action.kind, t.action.microbatch);
      const double x = kLeft + t.start * scale;
      const double w = std::max(1.0, (t.end - t.start) * scale);
      const std::string label = to_string(t.action);
      o += str("<g><title>", escape(label), " [", num(t.start), ", ", num(t.end),
               "]</title><rect x=\"", num(x), "\" y=\"", num(y), "\" width=\"",
               num(w), "\" height=\"", num(kRowH), "\" fill=\"", st.fill,
               "\" stroke=\"", st.stroke, "\" stroke-width=\"1\"",
               st.dash.empty() ? "" : str(" stroke-dasharray=\"", st.dash, "\""),
               "/>");
      const double fs = std::min(11.0, w / (0.62 * label.size()));
      if (fs >= 6) {
        o += str("<text x=\"", num(x + w / 2), "\" y=\"", num(y + kRowH / 2 + fs / 3),
                 "\" font-size=\"", num(fs), "\" text-anchor=\"middle\" fill=\"",
                 st.text, "\">", escape(label), "</text>");
      }
      o += "</g>\n";
    }
  }
  // Time axis.
  const double axis_y = kTop + plot_h;
  o += str("<line x1=\"", num(kLeft), "\" y1=\"", num(axis_y), "\" x2=\"",
           num(kLeft + plot_w), "\" y2=\"", num(axis_y), "\" stroke=\"#888\"/>\n");
  const double step = std::max(1.0, std::pow(10.0, std::floor(std::log10(span / 5))));
  for (double t = 0; t <= span + 1e-9; t += step) {
    const double x = kLeft + t * scale;
    o += str("<line x1=\"", num(x), "\" y1=\"", num(axis_y), "\" x2=\"", num(x),
             "\" y2=\"", num(axis_y + 4), "\" stroke=\"#888\"/><text x=\"", num(x),
             "\" y=\"", num(axis_y + 15), "\" font-size=\"10\" text-anchor=\"middle\" "
             "fill=\"#666\">", num(t), "</text>\n");
  }
  // Legend: kinds in one neutral hue; colour = micro-batch.
  const double ly = axis_y + 34;
  double lx = kLeft;
  for (const auto& [k, name] : kinds) {
    const auto st = style_of(k, 1);
    o += str("<rect x=\"", num(lx), "\" y=\"", num(ly), "\" width=\"18\" height=\"12\" fill=\"",
             st.fill, "\" stroke=\"", st.stroke, "\"",
             st.dash.empty() ? "" : str(" stroke-dasharray=\"", st.dash, "\""),
             "/><text x=\"", num(lx + 24), "\" y=\"", num(ly + 10),
             "\" font-size=\"11\">", name, "</text>\n");
    lx += entry_width(name);
  }
  o += str("<rect x=\"", num(lx), "\" y=\"", num(ly), "\" width=\"18\" height=\"12\" "
           "fill=\"url(#idle)\" stroke=\"#bbb\"/><text x=\"", num(lx + 24), "\" y=\"",
           num(ly + 10), "\" font-size=\"11\">", kIdle, "</text>\n");
  o += str("<text x=\"", num(kLeft), "\" y=\"", num(ly + 30),
           "\" font-size=\"11\" fill=\"#444\">", escape(kKey), "</text>\n");
  o += "</svg>\n";
  return o;
}

}  // namespace viaduct::pipeline
