// `viaduct report DUMP_FOLDER`: writes the run report (train/report.h) of a
// run's folder again, from its metrics.jsonl and schedule.svg.
#include <cstdio>
#include <string>

#include "apps/command.h"
#include "core/check.h"
#include "core/strings.h"
#include "train/report.h"

namespace viaduct::apps {
namespace {

constexpr const char* kUsage =
    "usage: viaduct report DUMP_FOLDER [--loss-spike-factor=F]\n\n"
    "Writes DUMP_FOLDER/report.html: one self-contained page (inline SVG, no\n"
    "script, no network) with loss and eval loss, LR, gradient norm, tokens/s\n"
    "and MFU over the steps, peak memory and the measured against the\n"
    "simulated bubble per rank, and the schedule's timeline. `viaduct train`\n"
    "writes it at the end of every run.\n\n"
    "  --loss-spike-factor=F  mark a step whose loss is above F times its\n"
    "                         running mean as a spike (metrics.loss_spike_factor;\n"
    "                         default 1.35)\n";

int run_report(int argc, char** argv) {
  std::string folder;
  ReportOptions options;
  const std::string spike_flag = "--loss-spike-factor=";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (a.rfind(spike_flag, 0) == 0) {
      const auto f = parse_finite_number(a.substr(spike_flag.size()));
      VIADUCT_CHECK_T(ConfigError, f && *f > 1, "report: --loss-spike-factor takes a number > 1, got '",
                      a.substr(spike_flag.size()), "'");
      options.loss_spike_factor = *f;
      continue;
    }
    VIADUCT_CHECK_T(ConfigError, a.rfind("--", 0) != 0, "report: unknown option ", a, "\n",
                    kUsage);
    VIADUCT_CHECK_T(ConfigError, folder.empty(), "report: one folder, got '", folder, "' and '",
                    a, "'\n", kUsage);
    folder = a;
  }
  VIADUCT_CHECK_T(ConfigError, !folder.empty(), "report: which folder?\n", kUsage);
  const auto path = write_run_report(folder, folder, "", options);
  std::printf("wrote %s\n", path.string().c_str());
  return 0;
}

}  // namespace

VIADUCT_COMMAND("report", "write a run's report.html (curves, memory, bubble, schedule)",
                run_report);

}  // namespace viaduct::apps
