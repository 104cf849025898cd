// Linked into every test binary: a crash prints its native stack before the
// process dies of the signal (core/fatal_signal.h).
#include "core/fatal_signal.h"

namespace {

const bool crash_trace_installed = [] {
  viaduct::install_fatal_signal_handlers("test");
  return true;
}();

}  // namespace
