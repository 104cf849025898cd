// Helpers for the tests that run `viaduct` as processes: a shell runner that
// captures output and exit status, and a random token corpus. (`viaduct
// launch` picks a free loopback port itself.)
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "data/token_file.h"

namespace viaduct::testing {

struct ShellRun {
  int exit_code = 0;
  std::string output;  // stdout and stderr together
};

inline ShellRun shell(const std::string& cmd) {
  ShellRun r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {127, "popen failed: " + cmd};
  char buf[4096];
  while (fgets(buf, sizeof buf, p)) r.output += buf;
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// `n` pseudo-random printable byte tokens (an LCG seeded by `seed`) in a
// viaduct token file at `path`.
inline void write_random_corpus(const std::string& path, uint64_t seed, int n = 20000) {
  data::TokenFileWriter w(path, 257, "byte");
  std::vector<int64_t> toks;
  uint64_t x = seed;
  for (int i = 0; i < n; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    toks.push_back(static_cast<int64_t>((x >> 33) % 97) + 32);
  }
  w.append(toks);
  w.finish();
}

}  // namespace viaduct::testing
