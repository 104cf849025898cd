// Save and exit on a signal: SIGTERM (a scheduler's preemption), SIGINT
// (Ctrl-C) and SIGUSR1 ask the trainer to stop at the next step boundary.
//
// Note [Save and exit on a signal]
// The handler only records the signal. Every rank reads its record at the
// step's loss all-reduce, which sums the requests over the whole mesh, so
// all ranks see a request in the same step even when the signal reached
// them at different moments. They finish that step, save a checkpoint
// together (checkpoint.enable = true) and exit with kExitSavedOnSignal. A
// second signal while that happens ends the process at once with
// 128 + the signal number; the last complete checkpoint stays the one to
// resume from (see Note [Atomic checkpoint save]).
#pragma once

namespace viaduct {

// The exit status of a run that stopped on a signal after saving
// (EX_TEMPFAIL: "try again", i.e. resume).
inline constexpr int kExitSavedOnSignal = 75;

// Installs the handlers for SIGTERM, SIGINT and SIGUSR1 (once per process;
// `viaduct train` does it before it builds the trainer). `saves`: whether
// the run saves a checkpoint on the way out (checkpoint.enable), which the
// handler's first line says.
void install_stop_signal_handlers(bool saves);
// The first signal received, or 0.
int stop_signal();
// "SIGTERM" etc.
const char* stop_signal_name(int sig);

}  // namespace viaduct
