// A crash (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) prints the signal and
// the native stack to stderr before the process dies of the same signal:
// a rank that dies under `viaduct launch` leaves a trace in its log, and a
// test binary that crashes on a machine without a debugger says where (the
// frames are binary(+offset) pairs for `addr2line -C -f -e BINARY OFFSET`).
// Header-only and without LibTorch, so the pure test binaries use it too.
#pragma once

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <initializer_list>

namespace viaduct {

namespace fatal_signal_detail {

inline const char*& who() {
  static const char* name = "viaduct";
  return name;
}

inline void write_err(const char* s) {
  const auto n = ::write(STDERR_FILENO, s, std::strlen(s));
  (void)n;
}

// Only async-signal-safe calls: write(2) and backtrace_symbols_fd.
inline void on_fatal_signal(int sig) {
  const char* name = sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS"
                   : sig == SIGFPE ? "SIGFPE" : sig == SIGILL ? "SIGILL" : "SIGABRT";
  write_err(who());
  write_err(": fatal signal ");
  write_err(name);
  write_err("; native stack:\n");
  void* frames[64];
  const int n = ::backtrace(frames, 64);
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

}  // namespace fatal_signal_detail

// `process_name` (a string that outlives the process) heads the report.
inline void install_fatal_signal_handlers(const char* process_name) {
  fatal_signal_detail::who() = process_name;
  // backtrace() loads libgcc on its first call, which is not safe inside a
  // handler: make that call now.
  void* warm[1];
  (void)::backtrace(warm, 1);
  // The handler's own stack, so a stack overflow is reported too.
  static char alt_stack[1 << 16];
  stack_t ss{};
  ss.ss_sp = alt_stack;
  ss.ss_size = sizeof(alt_stack);
  ::sigaltstack(&ss, nullptr);
  struct sigaction sa {};
  sa.sa_handler = fatal_signal_detail::on_fatal_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND | SA_ONSTACK;
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) ::sigaction(sig, &sa, nullptr);
}

}  // namespace viaduct
