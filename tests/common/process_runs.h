// Helpers for the tests that run `viaduct` as processes: a shell runner that
// captures output and exit status, a random token corpus, and (for targets
// that define VIADUCT_BINARY) running jobs and comparing two of them bit for
// bit. (`viaduct launch` picks a free loopback port itself.)
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
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

// Documents of 1 to 12 tokens (<|endoftext|> = 256 first, then
// write_random_corpus's bytes), `n` tokens in all, in a viaduct token file
// at `path` that records the byte tokenizer's document marker.
inline void write_random_documents(const std::string& path, uint64_t seed, int n = 20000) {
  data::TokenFileWriter w(path, 257, "byte", {256, data::DocumentMarker::Kind::kStarts});
  std::vector<int64_t> toks;
  uint64_t x = seed;
  int left = 0;
  for (int i = 0; i < n; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    if (left == 0) {
      toks.push_back(256);
      left = static_cast<int>((x >> 40) % 12);
    } else {
      toks.push_back(static_cast<int64_t>((x >> 33) % 97) + 32);
      --left;
    }
  }
  w.append(toks);
  w.finish();
}

#ifdef VIADUCT_BINARY
// Runs `viaduct <args>` (through `viaduct launch --nproc-per-node N --` when
// nproc > 1; `env` goes first, e.g. "VAR=1") and expects it to succeed.
inline ShellRun run_viaduct_ok(int nproc, const std::string& args, const std::string& env = "") {
  std::string cmd = env + (env.empty() ? "" : " ") + VIADUCT_BINARY;
  if (nproc > 1) cmd += " launch --nproc-per-node " + std::to_string(nproc) + " -- " + VIADUCT_BINARY;
  cmd += args;
  auto r = shell(cmd);
  EXPECT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
  return r;
}

// The step lines (those with a "loss") of <dump>/metrics.jsonl.
inline std::vector<nlohmann::json> step_metrics(const std::string& dump) {
  std::vector<nlohmann::json> out;
  std::ifstream in(std::filesystem::path(dump) / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j);
  }
  return out;
}

// Each step's loss as written (the text, so equality is bitwise).
inline std::vector<std::string> step_losses(const std::string& dump) {
  std::vector<std::string> out;
  for (const auto& j : step_metrics(dump)) out.push_back(j["loss"].dump());
  return out;
}

// `viaduct checkpoint compare` of the newest checkpoints of two dump folders.
inline ShellRun checkpoint_compare(const std::string& a, const std::string& b) {
  return shell(std::string(VIADUCT_BINARY) + " checkpoint compare " + a + "/checkpoint " + b +
               "/checkpoint");
}

// Two runs with the same losses, `steps` of them, and checkpoints that
// compare equal; returns the compare run for further checks of its report.
inline ShellRun expect_same_bits(const std::string& a, const std::string& b, size_t steps) {
  EXPECT_EQ(step_losses(a), step_losses(b));
  EXPECT_EQ(step_losses(a).size(), steps);
  auto r = checkpoint_compare(a, b);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r;
}
#endif  // VIADUCT_BINARY

}  // namespace viaduct::testing
