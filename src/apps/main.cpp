// `viaduct <command> [args]`: dispatch to the registered subcommands and turn
// every viaduct::Error into a clear message and a non-zero exit.
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <map>

#include "apps/command.h"
#include "core/check.h"
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

// A crash (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) prints the signal and
// the native stack to stderr before the process dies of the same signal, so
// a rank that dies under `viaduct launch` leaves a trace in its log. Only
// async-signal-safe calls: write(2) and backtrace_symbols_fd.
void on_fatal_signal(int sig) {
  const char* name = sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS"
                   : sig == SIGFPE ? "SIGFPE" : sig == SIGILL ? "SIGILL" : "SIGABRT";
  const char* head = "viaduct: fatal signal ";
  const char* tail = "; native stack:\n";
  ssize_t ignored = ::write(STDERR_FILENO, head, std::strlen(head));
  ignored = ::write(STDERR_FILENO, name, std::strlen(name));
  ignored = ::write(STDERR_FILENO, tail, std::strlen(tail));
  (void)ignored;
  void* frames[64];
  const int n = ::backtrace(frames, 64);
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void install_fatal_signal_handlers() {
  // backtrace() loads libgcc on its first call, which is not safe inside a
  // handler: make that call now.
  void* warm[1];
  (void)::backtrace(warm, 1);
  struct sigaction sa {};
  sa.sa_handler = on_fatal_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND;
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) ::sigaction(sig, &sa, nullptr);
}
}  // namespace

CommandRegistrar::CommandRegistrar(const std::string& name,
                                   const std::string& summary, CommandFn fn) {
  registry()[name] = Entry{summary, std::move(fn)};
}

}  // namespace viaduct::apps

int main(int argc, char** argv) {
  using namespace viaduct::apps;
  install_fatal_signal_handlers();
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
