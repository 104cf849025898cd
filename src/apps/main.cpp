// `viaduct <command> [args]`: dispatch to the registered subcommands and turn
// every viaduct::Error into a clear message and a non-zero exit.
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>

#include "apps/command.h"
#include "core/check.h"
#include "core/fatal_signal.h"
#include "core/torch_compat.h"

namespace viaduct::apps {
namespace {
struct Entry {
  std::string summary;
  CommandFn fn;
};
std::map<std::string, Entry>& registry() {
  static std::map<std::string, Entry> r;
  return r;
}
// The command list: on stdout when asked for (--help), on stderr after a
// mistake.
void usage(std::FILE* out) {
  std::fprintf(out, "usage: viaduct <command> [options]\n\ncommands:\n");
  for (const auto& [name, e] : registry()) {
    std::fprintf(out, "  %-14s %s\n", name.c_str(), e.summary.c_str());
  }
  std::fprintf(out, "\n`viaduct <command> --help` describes a command.\n");
}

}  // namespace

CommandRegistrar::CommandRegistrar(const std::string& name,
                                   const std::string& summary, CommandFn fn) {
  registry()[name] = Entry{summary, std::move(fn)};
}

}  // namespace viaduct::apps

int main(int argc, char** argv) {
  using namespace viaduct::apps;
  viaduct::install_fatal_signal_handlers("viaduct");
  viaduct::compat::default_cuda_allocator_settings();
  if (argc < 2 || std::string(argv[1]) == "--help" ||
      std::string(argv[1]) == "-h" || std::string(argv[1]) == "help") {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  auto it = registry().find(argv[1]);
  if (it == registry().end()) {
    std::fprintf(stderr, "viaduct: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
  }
  try {
    return it->second.fn(argc - 1, argv + 1);
  } catch (const viaduct::ConfigError& e) {
    std::fprintf(stderr, "viaduct %s: config error: %s\n", argv[1], e.what());
    return 2;
  } catch (const std::exception& e) {
    // LibTorch's errors carry their C++ backtrace after the message; the
    // message is what a user needs.
    std::string message = e.what();
    message = message.substr(0, message.find("\nException raised from"));
    if (message.find("out of memory") != std::string::npos) {
      message += "\n(the run does not fit: lower training.local_batch_size or "
                 "training.seq_len, raise parallelism.pipeline_parallel_microbatches, or "
                 "spread the model over more pipeline ranks)";
    }
    std::fprintf(stderr, "viaduct %s: error: %s\n", argv[1], message.c_str());
    return 1;
  }
}
