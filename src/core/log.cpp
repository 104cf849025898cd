#include "core/log.h"

#include <cstdio>
#include <mutex>

namespace viaduct::log {
namespace {
Level g_level = Level::kInfo;
std::string g_prefix;
std::mutex g_mutex;
}  // namespace

void set_level(Level l) { g_level = l; }
Level level() { return g_level; }
void set_prefix(const std::string& p) { g_prefix = p; }

void write(Level l, const std::string& msg) {
  if (l < g_level) return;
  static const char* kTags[] = {"debug", "info", "warning", "error"};
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stderr, "%s%s: %s\n", g_prefix.c_str(),
               kTags[static_cast<int>(l)], msg.c_str());
  std::fflush(stderr);
}

}  // namespace viaduct::log
