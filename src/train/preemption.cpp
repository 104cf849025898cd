// Save and exit on a signal (see preemption.h).
#include "train/preemption.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "core/check.h"

namespace viaduct {
namespace {

std::atomic<int> g_stop_signal{0};
std::atomic<bool> g_saves{true};

void write_stderr(const char* s) { (void)!::write(STDERR_FILENO, s, std::strlen(s)); }

extern "C" void on_stop_signal(int sig) {
  int expected = 0;
  if (g_stop_signal.compare_exchange_strong(expected, sig)) {
    write_stderr("viaduct: got ");
    write_stderr(stop_signal_name(sig));
    write_stderr(g_saves.load() ? ": finishing this step, saving a checkpoint and exiting (a "
                                  "second signal aborts at once)\n"
                                : ": finishing this step and exiting without saving "
                                  "(checkpoint.enable = false; a second signal aborts at "
                                  "once)\n");
    return;
  }
  write_stderr("viaduct: second signal: aborting without saving\n");
  ::_exit(128 + sig);
}

}  // namespace

const char* stop_signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGUSR1: return "SIGUSR1";
    default: return "a signal";
  }
}

void install_stop_signal_handlers(bool saves) {
  g_saves.store(saves);
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int sig : {SIGTERM, SIGINT, SIGUSR1}) {
    VIADUCT_CHECK(::sigaction(sig, &action, nullptr) == 0, "cannot install the handler of ",
                  stop_signal_name(sig), ": ", std::strerror(errno));
  }
}

int stop_signal() { return g_stop_signal.load(); }

}  // namespace viaduct
