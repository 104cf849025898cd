// The local launcher: fork/exec of this node's ranks, one poll loop over their
// stdout/stderr pipes and a self-pipe fed by the signal handlers, and the
// termination policy (first failure wins; SIGTERM to every other rank's
// process group, SIGKILL after the grace period).
#include "distributed/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>

#include "core/check.h"
#include "core/strings.h"
#include "core/file_io.h"
#include "distributed/job_store.h"

extern char** environ;

namespace viaduct::distributed {
namespace {

using Clock = std::chrono::steady_clock;

std::pair<UniqueFd, UniqueFd> make_pipe() {
  int fds[2];
  VIADUCT_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "launch: pipe2: ", errno_text());
  return {UniqueFd(fds[0]), UniqueFd(fds[1])};
}

void set_nonblocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL);
  VIADUCT_CHECK(flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0,
                "launch: fcntl: ", errno_text());
}

// Writes all of `data`; gives up silently on a closed stream (our own
// stdout went away).
void write_all(int fd, const std::string& data) {
  (void)write_fully(fd, data.data(), data.size());
}

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev != nullptr ? str("SIG", abbrev) : str("signal ", sig);
}

// ------------------------------------------------------------ signals

std::atomic<int> g_signal_fd{-1};
std::atomic<pid_t> g_launcher_pid{-1};
std::atomic<bool> g_launch_active{false};

extern "C" void on_signal(int sig) {
  int saved = errno;
  int fd = g_signal_fd.load();
  // A forked child runs this handler until it resets it; only the launcher
  // itself may feed the pipe.
  if (fd >= 0 && ::getpid() == g_launcher_pid.load()) {
    unsigned char byte = static_cast<unsigned char>(sig);
    (void)!::write(fd, &byte, 1);
  }
  errno = saved;
}

// Routes SIGINT, SIGTERM, SIGUSR1 and SIGCHLD into a self-pipe for the launch's
// lifetime and restores the previous handlers after.
class SignalRoute {
 public:
  SignalRoute() {
    bool expected = false;
    VIADUCT_CHECK(g_launch_active.compare_exchange_strong(expected, true),
                  "launch: another launch is running in this process");
    auto [read_end, write_end] = make_pipe();
    read_ = std::move(read_end);
    write_ = std::move(write_end);
    set_nonblocking(read_.get());
    set_nonblocking(write_.get());
    g_launcher_pid.store(::getpid());
    g_signal_fd.store(write_.get());
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    for (size_t i = 0; i < kSignals.size(); ++i) {
      if (::sigaction(kSignals[i], &action, &previous_[i]) != 0) {
        std::string err = errno_text();
        restore(i);
        VIADUCT_CHECK(false, "launch: sigaction: ", err);
      }
    }
  }
  ~SignalRoute() { restore(kSignals.size()); }
  SignalRoute(const SignalRoute&) = delete;
  SignalRoute& operator=(const SignalRoute&) = delete;

  int fd() const { return read_.get(); }

  // Every signal that arrived since the last call.
  std::vector<int> drain() {
    std::vector<int> signals;
    unsigned char buffer[64];
    for (;;) {
      ssize_t n = ::read(read_.get(), buffer, sizeof(buffer));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      for (ssize_t i = 0; i < n; ++i) signals.push_back(buffer[i]);
    }
    return signals;
  }

 private:
  static constexpr std::array<int, 4> kSignals = {SIGINT, SIGTERM, SIGUSR1, SIGCHLD};

  void restore(size_t count) {
    for (size_t i = 0; i < count; ++i)
      ::sigaction(kSignals[i], &previous_[i], nullptr);
    g_signal_fd.store(-1);
    g_launch_active.store(false);
  }

  UniqueFd read_;
  UniqueFd write_;
  std::array<struct sigaction, 4> previous_{};
};

// ------------------------------------------------------------ children

// One rank's output stream, split into lines.
struct OutputStream {
  UniqueFd fd;
  bool is_stderr = false;
  std::string pending;
};

constexpr size_t kMaxLine = 1 << 16;

// One rank: its process (leader of its own process group, so that ending it
// ends whatever it started) and its two output pipes. The destructor kills
// and reaps a child that is still running.
struct RankProcess {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  OutputStream out;
  OutputStream err;
  // The last error line the rank printed on stderr and when it arrived
  // (the launcher's count of error lines so far): see Note [The first rank to
  // fail].
  std::string error_line;
  int64_t error_seq = -1;

  RankProcess() = default;
  RankProcess(const RankProcess&) = delete;
  RankProcess& operator=(const RankProcess&) = delete;
  ~RankProcess() {
    if (running && pid > 0) {
      ::kill(-pid, SIGKILL);
      int ignored = 0;
      while (::waitpid(pid, &ignored, 0) < 0 && errno == EINTR) {
      }
    }
  }

  void signal_group(int sig) const {
    if (pid > 0 && (running || out.fd.valid() || err.fd.valid())) {
      ::kill(-pid, sig);
    }
  }
};

std::string describe_status(int rank, int status) {
  if (WIFEXITED(status)) {
    return str("rank ", rank, " exited with status ", WEXITSTATUS(status));
  }
  if (WIFSIGNALED(status)) {
    return str("rank ", rank, " was killed by ", signal_name(WTERMSIG(status)));
  }
  return str("rank ", rank, " ended with wait status ", status);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// The environment of a rank: ours, minus the variables we set, plus them.
std::vector<std::string> rank_environment(
    const std::vector<std::pair<std::string, std::string>>& vars) {
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string entry = *e;
    bool replaced = false;
    for (const auto& [key, value] : vars) {
      if (entry.compare(0, key.size() + 1, key + "=") == 0) replaced = true;
    }
    if (!replaced) env.push_back(std::move(entry));
  }
  for (const auto& [key, value] : vars) env.push_back(key + "=" + value);
  return env;
}

void spawn(RankProcess& proc, const std::vector<std::string>& command,
           const std::vector<std::string>& env) {
  auto [out_read, out_write] = make_pipe();
  auto [err_read, err_write] = make_pipe();
  std::vector<char*> argv;
  for (const auto& arg : command)
    argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (const auto& entry : env)
    envp.push_back(const_cast<char*>(entry.c_str()));
  envp.push_back(nullptr);
  std::string exec_failed =
      str("viaduct launch: cannot execute '", command[0], "': ");

  // Signals stay blocked across fork: a SIGTERM meant for a child that has
  // not reset our handlers yet waits until it has, then ends it.
  sigset_t routed;
  sigemptyset(&routed);
  sigaddset(&routed, SIGINT);
  sigaddset(&routed, SIGTERM);
  sigaddset(&routed, SIGUSR1);
  sigaddset(&routed, SIGCHLD);
  sigset_t previous_mask;
  int rc = ::pthread_sigmask(SIG_BLOCK, &routed, &previous_mask);
  VIADUCT_CHECK(rc == 0, "launch: pthread_sigmask: ", std::strerror(rc));
  pid_t pid = ::fork();
  if (pid != 0) {
    int fork_errno = errno;
    rc = ::pthread_sigmask(SIG_SETMASK, &previous_mask, nullptr);
    VIADUCT_CHECK(rc == 0, "launch: pthread_sigmask: ", std::strerror(rc));
    errno = fork_errno;
  }
  VIADUCT_CHECK(pid >= 0, "launch: fork for rank ", proc.rank, ": ",
                errno_text());
  if (pid == 0) {
    // Child: only async-signal-safe calls from here to exec.
    ::setpgid(0, 0);
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    ::sigaction(SIGINT, &dfl, nullptr);
    ::sigaction(SIGTERM, &dfl, nullptr);
    ::sigaction(SIGUSR1, &dfl, nullptr);
    ::sigaction(SIGCHLD, &dfl, nullptr);
    sigset_t none;
    sigemptyset(&none);
    ::pthread_sigmask(SIG_SETMASK, &none, nullptr);
    if (::dup2(out_write.get(), STDOUT_FILENO) < 0 ||
        ::dup2(err_write.get(), STDERR_FILENO) < 0) {
      ::_exit(127);
    }
    ::execvpe(argv[0], argv.data(), envp.data());
    int saved = errno;
    (void)!::write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
    const char* reason = ::strerror(saved);
    (void)!::write(STDERR_FILENO, reason, std::strlen(reason));
    (void)!::write(STDERR_FILENO, "\n", 1);
    ::_exit(127);
  }
  // Parent. setpgid here too closes the race with a signal sent before the
  // child ran; EACCES (the child already exec'd) is fine.
  if (::setpgid(pid, pid) != 0 && errno != EACCES && errno != ESRCH) {
    std::string err = errno_text();
    ::kill(pid, SIGKILL);
    VIADUCT_CHECK(false, "launch: setpgid for rank ", proc.rank, ": ", err);
  }
  proc.pid = pid;
  proc.running = true;
  proc.out.fd = std::move(out_read);
  proc.err.fd = std::move(err_read);
  proc.err.is_stderr = true;
  set_nonblocking(proc.out.fd.get());
  set_nonblocking(proc.err.fd.get());
}

// Reads what is available; emits complete lines (and over-long partial ones);
// at EOF emits the rest and closes.
void pump(int rank, OutputStream& stream, const LineSink& sink) {
  char buffer[8192];
  for (;;) {
    ssize_t n = ::read(stream.fd.get(), buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      if (!stream.pending.empty()) sink(rank, stream.is_stderr, stream.pending);
      stream.pending.clear();
      stream.fd.reset();
      return;
    }
    stream.pending.append(buffer, static_cast<size_t>(n));
    size_t start = 0;
    for (size_t nl;
         (nl = stream.pending.find('\n', start)) != std::string::npos;
         start = nl + 1) {
      sink(rank, stream.is_stderr, stream.pending.substr(start, nl - start));
    }
    stream.pending.erase(0, start);
    if (stream.pending.size() > kMaxLine) {
      sink(rank, stream.is_stderr, stream.pending);
      stream.pending.clear();
    }
  }
}

void default_sink(int rank, bool is_stderr, const std::string& line) {
  write_all(is_stderr ? STDERR_FILENO : STDOUT_FILENO,
            str("[rank ", rank, "] ", line, "\n"));
}

void note(const std::string& message) {
  write_all(STDERR_FILENO, "viaduct launch: " + message + "\n");
}

}  // namespace

int find_free_port() {
  UniqueFd sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  VIADUCT_CHECK(sock.valid(), "launch: socket: ", errno_text());
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  VIADUCT_CHECK(
      ::bind(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0,
      "launch: bind to a free port: ", errno_text());
  socklen_t len = sizeof(addr);
  VIADUCT_CHECK(
      ::getsockname(sock.get(), reinterpret_cast<sockaddr*>(&addr), &len) == 0,
      "launch: getsockname: ", errno_text());
  return ntohs(addr.sin_port);
}

namespace {

int parse_flag_int(const std::string& flag, const std::string& value, int lo,
                   int hi) {
  size_t used = 0;
  long v = 0;
  try {
    v = std::stol(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  VIADUCT_CHECK_T(ConfigError, used == value.size() && !value.empty(), "launch: ", flag,
                " expects an integer, got '", value, "'");
  VIADUCT_CHECK_T(ConfigError, v >= lo && v <= hi, "launch: ", flag, " must be in [", lo, ", ",
                hi, "], got ", v);
  return static_cast<int>(v);
}

std::chrono::milliseconds parse_flag_seconds(const std::string& flag,
                                             const std::string& value) {
  // Up to a year: a bigger figure overflows the milliseconds.
  const auto v = parse_finite_number(value);
  VIADUCT_CHECK_T(ConfigError, v && *v >= 0 && *v <= 365.0 * 24 * 3600, "launch: ", flag,
                " expects seconds (a finite number >= 0), got '", value, "'");
  return std::chrono::milliseconds(static_cast<long long>(*v * 1000.0));
}

}  // namespace

std::string launch_usage() {
  return "usage: viaduct launch --nproc-per-node N [--nnodes M --node-rank R\n"
         "       --master-addr ADDR --master-port PORT] [--timeout SECONDS]\n"
         "       [--grace SECONDS] [--max-restarts N] -- COMMAND ARGS...\n"
         "Starts N local ranks of COMMAND with RANK, WORLD_SIZE, LOCAL_RANK,\n"
         "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT set;\n"
         "prefixes their output with [rank N]; when one fails, ends the\n"
         "others and exits non-zero. --timeout: a wall-clock limit for the\n"
         "whole job (default none); --grace: SIGTERM-to-SIGKILL delay\n"
         "(default 5); --max-restarts: when a rank fails, end every rank and\n"
         "start them all again, up to N times (default 0), with\n"
         "VIADUCT_RESTART_COUNT set (a trainer resumes from its latest\n"
         "checkpoint). SIGINT, SIGTERM and SIGUSR1 are forwarded to every\n"
         "rank; a second one also ends them after the grace period. A rank\n"
         "that exits with 75 (saved on a signal) is no failure. One node:\n"
         "MASTER_ADDR 127.0.0.1 and a free port, the rendezvous store on\n"
         "loopback and a fresh VIADUCT_JOB_TOKEN; several nodes:\n"
         "--master-addr is required, the port defaults to 29500, and every\n"
         "node exports the same VIADUCT_JOB_TOKEN (e.g. from\n"
         "`head -c16 /dev/urandom | xxd -p`), which ranks prove to the store.\n"
         "When a rank fails, the one whose error line came first is named\n"
         "with that line, and its exit status is the launcher's.\n";
}

LaunchOptions parse_launch_args(int argc, char** argv) {
  LaunchOptions options;
  bool have_nproc = false;
  bool have_addr = false;
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.rfind("--", 0) != 0) break;  // the command starts here
    std::string flag = arg;
    std::string value;
    if (auto eq = arg.find('='); eq != std::string::npos) {
      flag = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    } else {
      VIADUCT_CHECK_T(ConfigError, i + 1 < argc, "launch: ", flag, " needs a value");
      value = argv[++i];
    }
    for (char& c : flag) {
      if (c == '_') c = '-';
    }
    if (flag == "--nproc-per-node") {
      options.nproc_per_node = parse_flag_int(flag, value, 1, 4096);
      have_nproc = true;
    } else if (flag == "--nnodes") {
      options.nnodes = parse_flag_int(flag, value, 1, 1 << 20);
    } else if (flag == "--node-rank") {
      options.node_rank = parse_flag_int(flag, value, 0, 1 << 20);
    } else if (flag == "--master-addr") {
      VIADUCT_CHECK_T(ConfigError, !value.empty(), "launch: --master-addr is empty");
      options.master_addr = value;
      have_addr = true;
    } else if (flag == "--master-port") {
      options.master_port = parse_flag_int(flag, value, 1, 65535);
    } else if (flag == "--timeout") {
      options.timeout = parse_flag_seconds(flag, value);
    } else if (flag == "--grace") {
      options.grace = parse_flag_seconds(flag, value);
    } else if (flag == "--max-restarts") {
      options.max_restarts = parse_flag_int(flag, value, 0, 1 << 20);
    } else {
      VIADUCT_CHECK_T(ConfigError, false, "launch: unknown flag ", flag, "\n", launch_usage());
    }
  }
  for (; i < argc; ++i) options.command.emplace_back(argv[i]);
  VIADUCT_CHECK_T(ConfigError, have_nproc, "launch: --nproc-per-node is required\n",
                launch_usage());
  VIADUCT_CHECK_T(ConfigError, !options.command.empty(),
                "launch: no command to run (give it after --)\n",
                launch_usage());
  VIADUCT_CHECK_T(ConfigError, options.node_rank < options.nnodes, "launch: --node-rank ",
                options.node_rank, " is not in [0, --nnodes=", options.nnodes,
                ")");
  VIADUCT_CHECK_T(ConfigError, options.nnodes == 1 || have_addr,
                "launch: --master-addr is required with --nnodes ",
                options.nnodes, " (the address of node 0)");
  return options;
}

namespace {

// The exit status of a rank that saved and stopped on a signal
// (train/preemption.h): deliberate, so neither a failure nor restarted.
constexpr int kExitSavedOnSignal = 75;

// The token every rank proves to the rendezvous store (see Note [Job store],
// dist/job_store.h): the user's VIADUCT_JOB_TOKEN, else on one node one made
// for this launch and kept across restarts. Several nodes without one get
// none: launchers started apart cannot agree on one, and the ranks refuse to
// start, saying how to export one.
std::string launch_job_token(const LaunchOptions& options) {
  const char* user = std::getenv("VIADUCT_JOB_TOKEN");
  if (user != nullptr && *user != '\0') return user;
  if (options.nnodes > 1) return "";
  static const std::string made = new_job_token();
  return made;
}

// One attempt: starts every local rank and supervises them to the end.
// `interrupted` is set when the launcher itself got a signal.
LaunchResult run_ranks(const LaunchOptions& options, const LineSink& sink,
                       SignalRoute& signals, int master_port, int attempt,
                       bool& interrupted) {
  const int world_size = options.nnodes * options.nproc_per_node;

  std::vector<std::unique_ptr<RankProcess>> procs;
  for (int local = 0; local < options.nproc_per_node; ++local) {
    auto proc = std::make_unique<RankProcess>();
    proc->rank = options.node_rank * options.nproc_per_node + local;
    std::vector<std::pair<std::string, std::string>> vars = {
        {"RANK", std::to_string(proc->rank)},
        {"WORLD_SIZE", std::to_string(world_size)},
        {"LOCAL_RANK", std::to_string(local)},
        {"LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node)},
        {"GROUP_RANK", std::to_string(options.node_rank)},
        {"MASTER_ADDR", options.master_addr},
        {"MASTER_PORT", std::to_string(master_port)},
        {"VIADUCT_RESTART_COUNT", std::to_string(attempt)},
    };
    if (const std::string token = launch_job_token(options); !token.empty()) {
      vars.emplace_back("VIADUCT_JOB_TOKEN", token);
    }
    spawn(*proc, options.command, rank_environment(vars));
    procs.push_back(std::move(proc));
  }

  // Note [The first rank to fail]
  // When one rank fails, the others fail after it: a peer's closed socket,
  // a collective that times out. Neither the order the launcher reaps the
  // exits in nor the order of the error lines tells which came first (a
  // failing rank tears its connections down while its error unwinds, before
  // it prints it), but the followers say what they died of: a peer or the
  // store gone. So after the first failed exit the launcher waits a moment
  // for every rank's lines, and names the first rank whose error is its own
  // (else the first error line at all) with that line and its exit status,
  // and only then ends the rest.
  int64_t error_lines = 0;
  auto is_error_line = [](const std::string& line) {
    return line.rfind("viaduct", 0) == 0 &&
           (line.find(" error: ") != std::string::npos ||
            line.find("fatal signal") != std::string::npos);
  };
  auto follows_a_peer = [](const std::string& line) {
    for (const char* mark : {"Connection closed by peer", "Connection reset by peer",
                             "Broken pipe", "lost the connection to the rendezvous store"}) {
      if (line.find(mark) != std::string::npos) return true;
    }
    return false;
  };
  const LineSink observe = [&](int rank, bool is_stderr, const std::string& line) {
    sink(rank, is_stderr, line);
    if (!is_stderr || !is_error_line(line)) return;
    for (auto& p : procs) {
      if (p->rank == rank) {
        p->error_line = line;
        p->error_seq = error_lines++;
      }
    }
  };
  constexpr auto kSettle = std::chrono::milliseconds(1000);
  std::optional<Clock::time_point> failure_at;  // the first failed exit
  std::vector<const RankProcess*> failed;       // in the order reaped

  LaunchResult result;
  const auto started = Clock::now();
  // The SIGKILL deadline, once armed.
  bool kill_armed = false;
  Clock::time_point kill_at{};
  std::optional<Clock::time_point> drain_until;  // after the last rank ended
  bool ending = false;                           // SIGTERM sent to every rank
  int interrupt_signal = 0;                      // the launcher's first signal
  auto end_all = [&](int sig) {
    for (auto& p : procs) p->signal_group(sig);
    if (!ending) {
      ending = true;
      kill_at = Clock::now() + options.grace;
      kill_armed = true;
    }
  };

  for (;;) {
    bool any_running = false;
    bool any_open = false;
    for (auto& p : procs) {
      any_running |= p->running;
      any_open |= p->out.fd.valid() || p->err.fd.valid();
    }
    if (!any_running && !any_open) break;
    auto now = Clock::now();
    if (!any_running) {
      // A rank ended but something it started still holds its pipes.
      if (!drain_until) drain_until = now + std::chrono::seconds(1);
      if (now >= *drain_until) break;
    }

    std::vector<pollfd> fds;
    std::vector<OutputStream*> streams;
    std::vector<int> stream_rank;
    fds.push_back({signals.fd(), POLLIN, 0});
    for (auto& p : procs) {
      for (OutputStream* s : {&p->out, &p->err}) {
        if (s->fd.valid()) {
          fds.push_back({s->fd.get(), POLLIN, 0});
          streams.push_back(s);
          stream_rank.push_back(p->rank);
        }
      }
    }
    int ready = ::poll(fds.data(), fds.size(), 100);
    VIADUCT_CHECK(ready >= 0 || errno == EINTR, "launch: poll: ", errno_text());
    if (ready > 0) {
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents != 0)
          pump(stream_rank[i - 1], *streams[i - 1], observe);
      }
    }

    for (int sig : signals.drain()) {
      if (sig != SIGINT && sig != SIGTERM && sig != SIGUSR1) continue;
      // The first signal lets the ranks finish (a trainer saves first); a
      // second one also starts the grace period.
      note(str("got ", signal_name(sig), ", forwarding it to every rank",
               interrupted ? "; ending them after the grace period" : ""));
      for (auto& p : procs) p->signal_group(sig);
      if (interrupted && !kill_armed) {
        kill_at = Clock::now() + options.grace;
        kill_armed = true;
      }
      if (!interrupted) {
        interrupted = true;
        interrupt_signal = sig;
      }
    }

    for (auto& p : procs) {
      if (!p->running) continue;
      int status = 0;
      pid_t r = ::waitpid(p->pid, &status, WNOHANG);
      if (r == 0 || (r < 0 && errno == EINTR)) continue;
      VIADUCT_CHECK(r == p->pid, "launch: waitpid for rank ", p->rank, ": ",
                    errno_text());
      p->running = false;
      p->status = status;
      bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (WIFEXITED(status) && WEXITSTATUS(status) == kExitSavedOnSignal) {
        // Stopped on purpose after saving: the others stop at the same step.
        if (result.exit_code == 0) {
          result.exit_code = kExitSavedOnSignal;
          result.message = str("rank ", p->rank, " saved a checkpoint and stopped on a signal");
        }
        continue;
      }
      if (!ok && !ending) {
        failed.push_back(p.get());
        if (!failure_at) failure_at = Clock::now();
      }
    }
    bool still_running = false;
    for (auto& p : procs) still_running |= p->running;
    if (failure_at && !ending && (!still_running || Clock::now() - *failure_at >= kSettle)) {
      // See Note [The first rank to fail]: its error line came first; without
      // one, the first exit reaped.
      auto rank_key = [&](const RankProcess* p) {
        // Its own error before a follower's, then the earlier line.
        const int64_t seq = p->error_seq < 0 ? std::numeric_limits<int64_t>::max() : p->error_seq;
        return std::pair<bool, int64_t>(p->error_seq < 0 || follows_a_peer(p->error_line), seq);
      };
      const RankProcess* first = failed.front();
      for (const RankProcess* p : failed) {
        if (rank_key(p) < rank_key(first)) first = p;
      }
      if (result.exit_code == 0 || result.exit_code == kExitSavedOnSignal) {
        result.exit_code = exit_code_of(first->status);
        if (result.exit_code == 0) result.exit_code = 1;
        result.failed_rank = first->rank;
        result.message = describe_status(first->rank, first->status);
        if (!first->error_line.empty()) result.message += ": " + first->error_line;
        if (failed.size() > 1) {
          result.message += str(" (then ", failed.size() - 1, " other rank",
                                failed.size() > 2 ? "s" : "", " failed after it)");
        }
        note(result.message + (still_running ? "; ending the other ranks" : ""));
      }
      end_all(SIGTERM);
    }

    now = Clock::now();
    if (options.timeout.count() > 0 && !ending &&
        now - started >= options.timeout) {
      result.exit_code = 124;
      result.message = str("the job ran past --timeout (",
                           options.timeout.count() / 1000.0, " s)");
      note(result.message + "; ending every rank");
      end_all(SIGTERM);
    }
    if (kill_armed && now >= kill_at) {
      for (auto& p : procs) {
        if (p->running) {
          note(str("rank ", p->rank, " still running after the ",
                   options.grace.count() / 1000.0, " s grace period; SIGKILL"));
        }
        p->signal_group(SIGKILL);
      }
      kill_armed = false;
    }
  }

  if (result.exit_code == 0 && interrupted) {
    // Every rank ended cleanly after the signal (a command without a save).
    result.exit_code = 128 + interrupt_signal;
    result.message = str("interrupted by ", signal_name(interrupt_signal));
  }
  if (result.exit_code == 0)
    result.message = str("all ", procs.size(), " ranks succeeded");
  return result;
}

}  // namespace

LaunchResult launch(const LaunchOptions& options, const LineSink& sink_in) {
  VIADUCT_CHECK(!options.command.empty(),
                "launch: no command to run (give it after --)");
  VIADUCT_CHECK(options.nproc_per_node >= 1,
                "launch: --nproc-per-node must be at least 1, got ",
                options.nproc_per_node);
  VIADUCT_CHECK(options.nnodes >= 1,
                "launch: --nnodes must be at least 1, got ", options.nnodes);
  VIADUCT_CHECK(options.node_rank >= 0 && options.node_rank < options.nnodes,
                "launch: --node-rank ", options.node_rank, " is not in [0, ",
                options.nnodes, ")");
  VIADUCT_CHECK(options.max_restarts >= 0, "launch: --max-restarts must be >= 0, got ",
                options.max_restarts);
  const LineSink& sink = sink_in ? sink_in : LineSink(default_sink);
  SignalRoute signals;
  for (int attempt = 0;; ++attempt) {
    int master_port = options.master_port;
    if (master_port == 0) {
      // A fresh port per attempt: the last one's store may linger.
      master_port = options.nnodes == 1 ? find_free_port() : 29500;
    }
    bool interrupted = false;
    LaunchResult result =
        run_ranks(options, sink, signals, master_port, attempt, interrupted);
    result.restarts = attempt;
    const bool failed = result.exit_code != 0 && result.exit_code != kExitSavedOnSignal &&
                        result.exit_code != 124;
    if (!failed || interrupted || attempt >= options.max_restarts) return result;
    note(str("restart ", attempt + 1, " of ", options.max_restarts, " after: ",
             result.message, "; every rank starts again (a trainer resumes from its "
             "latest checkpoint)"));
  }
}

}  // namespace viaduct::distributed
