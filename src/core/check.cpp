#include "core/check.h"

namespace viaduct {

void throw_internal(const char* file, int line, const char* cond,
                    const std::string& msg) {
  throw Error(str("internal error at ", file, ":", line, ": ", cond,
                  msg.empty() ? "" : " — ", msg,
                  " (this is a viaduct bug; please report it)"));
}

}  // namespace viaduct
