// `viaduct checkpoint inspect DIR` and `viaduct checkpoint compare A B`:
// look inside a checkpoint and compare two bitwise (tensor by tensor, by FQN,
// whatever layout wrote them). DIR is a step folder or a checkpoint folder
// (its latest step is taken).
#include <cstdio>
#include <filesystem>

#include "apps/command.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/manager.h"
#include "core/check.h"

namespace viaduct::apps {
namespace {
namespace fs = std::filesystem;
namespace ck = checkpoint;

fs::path step_dir(const std::string& arg) {
  fs::path p(arg);
  if (fs::exists(p / ck::kMetadataFileName)) return p;
  auto latest = ck::find_latest_checkpoint(p);
  VIADUCT_CHECK_T(FileError, latest.has_value(), "no complete checkpoint in '", arg, "'");
  return ck::checkpoint_dir(p, *latest);
}

int inspect(const std::string& arg) {
  auto c = ck::open_checkpoint(step_dir(arg));
  std::printf("%s: step %lld, %lld tokens seen, layout %s\n", c.dir.c_str(),
              static_cast<long long>(c.metadata.step),
              static_cast<long long>(c.metadata.tokens_seen),
              c.metadata.layout.dump().c_str());
  for (const auto& f : c.metadata.files) {
    std::printf("  file %s (%llu bytes)\n", f.name.c_str(),
                static_cast<unsigned long long>(f.bytes));
  }
  for (const auto& name : c.tensors.names()) {
    const auto e = c.tensors.info(name);
    std::string shape;
    for (auto d : e.shape) {
      if (!shape.empty()) shape += 'x';
      shape += std::to_string(d);
    }
    const std::string pieces =
        e.pieces > 0 ? " in " + std::to_string(e.pieces) + (e.pieces == 1 ? " piece" : " pieces") : "";
    std::printf("  %-60s %-5s [%s]%s\n", name.c_str(), ck::dtype_name(e.dtype).c_str(),
                shape.c_str(), pieces.c_str());
  }
  return 0;
}

int compare(const std::string& a, const std::string& b) {
  auto ca = ck::open_checkpoint(step_dir(a));
  auto cb = ck::open_checkpoint(step_dir(b));
  const auto na = ca.tensors.names(), nb = cb.tensors.names();
  int differ = 0;
  if (na != nb) {
    std::printf("tensor names differ: %zu vs %zu\n", na.size(), nb.size());
    return 1;
  }
  for (const auto& n : na) {
    auto ta = ca.tensors.load(n), tb = cb.tensors.load(n);
    if (ta.sizes() != tb.sizes() || ta.scalar_type() != tb.scalar_type()) {
      std::printf("%s: shape or dtype differs\n", n.c_str());
      ++differ;
    } else if (!at::equal(ta, tb)) {
      const double d = (ta.to(at::kDouble) - tb.to(at::kDouble)).abs().max().item<double>();
      std::printf("%s: differs (max abs diff %.3g)\n", n.c_str(), d);
      ++differ;
    }
  }
  std::printf("%zu tensors compared, %d differ\n", na.size(), differ);
  return differ == 0 ? 0 : 1;
}

int run_checkpoint(int argc, char** argv) {
  const std::string usage =
      "usage: viaduct checkpoint inspect DIR\n"
      "       viaduct checkpoint compare DIR_A DIR_B   (exit 0 when bitwise equal)\n";
  const std::string sub = argc >= 2 ? argv[1] : "";
  if (sub == "--help" || sub == "-h") {
    std::fputs(usage.c_str(), stdout);
    return 0;
  }
  const int wanted = sub == "inspect" ? 1 : sub == "compare" ? 2 : -1;
  // What is wrong, by name, before the usage.
  std::string problem;
  if (sub.empty()) {
    problem = "a subcommand is required (inspect or compare)";
  } else if (wanted < 0) {
    problem = "unknown subcommand '" + sub + "' (inspect or compare)";
  } else if (argc - 2 != wanted) {
    problem = str(sub, " takes ", wanted == 1 ? "one folder" : "two folders", ", got ", argc - 2,
                  " argument", argc - 2 == 1 ? "" : "s");
  }
  if (!problem.empty()) {
    std::fprintf(stderr, "viaduct checkpoint: %s\n\n%s", problem.c_str(), usage.c_str());
    return 2;
  }
  return wanted == 1 ? inspect(argv[2]) : compare(argv[2], argv[3]);
}

}  // namespace

VIADUCT_COMMAND("checkpoint", "inspect a checkpoint, or compare two bitwise",
                run_checkpoint);

}  // namespace viaduct::apps
