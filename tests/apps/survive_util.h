// What the tests of runs that survive share: a small job, reading files, a
// `viaduct` process in the background, polling, and a folder's snapshot to
// show that a refused command changed nothing on disk.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/process_runs.h"
#include "data/temp_dir.h"

extern char** environ;

namespace viaduct::testing {
namespace fs = std::filesystem;
using data::testing::TempDir;

inline const std::string kBin = VIADUCT_BINARY;

// A small, fast job: two layers, short sequences, no eval.
inline std::string job(const TempDir& dir, const std::string& dump, int steps, int layers = 2) {
  return " train --data.path=" + dir.file("corpus.tok") + " --job.dump_folder=" + dir.file(dump) +
         " --training.steps=" + std::to_string(steps) +
         " --training.eval_interval=0 --training.local_batch_size=2 --training.seq_len=32"
         " --model.n_layers=" + std::to_string(layers) + " --metrics.progress_bar=false";
}

inline std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::vector<std::string> lines_of(const fs::path& p) {
  std::vector<std::string> out;
  std::istringstream in(read_file(p));
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

inline std::vector<std::string> tmp_folders(const fs::path& ckpt) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(ckpt, ec)) {
    if (de.path().filename().string().find(".tmp-") != std::string::npos) {
      out.push_back(de.path().string());
    }
  }
  return out;
}

inline void expect_has(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in:\n" << text;
}

// A `viaduct` process in the background, its output in a file.
class Background {
 public:
  Background(const std::string& args, const fs::path& log,
             const std::vector<std::string>& env_extra = {}) : log_(log) {
    std::vector<std::string> argv{"/bin/sh", "-c", "exec " + kBin + args};
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    for (const auto& e : env_extra) env.push_back(e);
    std::vector<char*> cenv;
    for (auto& e : env) cenv.push_back(e.data());
    cenv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    EXPECT_EQ(posix_spawn(&pid_, "/bin/sh", &fa, nullptr, cargv.data(), cenv.data()), 0);
    posix_spawn_file_actions_destroy(&fa);
  }
  ~Background() {
    if (pid_ > 0) {
      if (!ended_) ::kill(pid_, SIGKILL);
      wait();
    }
  }
  pid_t pid() const { return pid_; }
  void signal(int sig) const { ::kill(pid_, sig); }
  // To the main thread alone (its thread id is the process id): a signal
  // sent to the process may be handled on any of its threads.
  void signal_main_thread(int sig) const { ::syscall(SYS_tgkill, pid_, pid_, sig); }
  // Whether it still runs; once it has ended, wait() returns at once.
  bool running() {
    if (pid_ <= 0 || ended_) return false;
    ended_ = ::waitpid(pid_, &status_, WNOHANG) == pid_;
    return !ended_;
  }
  // The exit code (128 + signal when killed).
  int wait() {
    while (!ended_ && ::waitpid(pid_, &status_, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : 128 + WTERMSIG(status_);
  }
  std::string output() const { return read_file(log_); }

 private:
  fs::path log_;
  pid_t pid_ = -1;
  bool ended_ = false;
  int status_ = 0;
};

// Polls `done` every 50 ms for up to `seconds`.
template <typename F>
bool wait_until(F done, double seconds = 60) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// Every file under `folder` (relative path -> contents) and every folder
// (relative path -> "<dir>"): equal snapshots mean nothing was written,
// moved or removed.
inline std::map<std::string, std::string> snapshot(const fs::path& folder) {
  std::map<std::string, std::string> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(folder, ec);
       it != fs::recursive_directory_iterator(); it.increment(ec)) {
    const auto rel = fs::relative(it->path(), folder).string();
    out[rel] = it->is_directory() ? std::string("<dir>") : read_file(it->path());
  }
  return out;
}

}  // namespace viaduct::testing
