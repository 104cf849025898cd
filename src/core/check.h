// Error types and checks. A user-facing check (VIADUCT_CHECK) throws
// viaduct::Error with the context the user needs to act: the config key, the
// file, the rank/stage/micro-batch. VIADUCT_ASSERT guards internal invariants.
// This header does not include LibTorch, so the pure libraries can use it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace viaduct {

// Concatenate anything streamable: str("stage ", 3, " of ", 8).
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A bad job config: unknown key, wrong type, impossible shape.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A missing, truncated or corrupt data / checkpoint file.
class FileError : public Error {
 public:
  using Error::Error;
};

[[noreturn]] void throw_internal(const char* file, int line, const char* cond,
                                 const std::string& msg);

}  // namespace viaduct

#define VIADUCT_CHECK(cond, ...)                           \
  do {                                                     \
    if (!(cond)) {                                         \
      throw ::viaduct::Error(::viaduct::str(__VA_ARGS__)); \
    }                                                      \
  } while (0)

#define VIADUCT_CHECK_T(ErrorType, cond, ...)              \
  do {                                                     \
    if (!(cond)) {                                         \
      throw ::viaduct::ErrorType(::viaduct::str(__VA_ARGS__)); \
    }                                                      \
  } while (0)

#define VIADUCT_ASSERT(cond, ...)                                      \
  do {                                                                 \
    if (!(cond)) {                                                     \
      ::viaduct::throw_internal(__FILE__, __LINE__, #cond,             \
                                ::viaduct::str("" __VA_OPT__(, ) __VA_ARGS__)); \
    }                                                                  \
  } while (0)
