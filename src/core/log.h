// Logging to stderr with a rank prefix set once per process.
#pragma once

#include <string>

#include "core/check.h"

namespace viaduct::log {

enum class Level { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void set_level(Level level);
Level level();
// A prefix such as "[rank 3] " put before every line; empty by default.
void set_prefix(const std::string& prefix);
void write(Level level, const std::string& msg);

template <typename... Args>
void info(const Args&... args) {
  write(Level::kInfo, str(args...));
}
template <typename... Args>
void warn(const Args&... args) {
  write(Level::kWarn, str(args...));
}
template <typename... Args>
void error(const Args&... args) {
  write(Level::kError, str(args...));
}
template <typename... Args>
void debug(const Args&... args) {
  if (level() <= Level::kDebug) write(Level::kDebug, str(args...));
}

}  // namespace viaduct::log
