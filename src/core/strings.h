// Small string helpers shared by the "did you mean" messages and the
// command lines' numbers. Torch-free,
// header-only, so the pure libraries (split, schedule) use it too.
#pragma once

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace viaduct {

// Levenshtein distance; `ignore_case` compares letters case-insensitively.
inline size_t edit_distance(const std::string& a, const std::string& b,
                            bool ignore_case = false) {
  auto eq = [&](char x, char y) {
    if (!ignore_case) return x == y;
    return std::tolower(static_cast<unsigned char>(x)) ==
           std::tolower(static_cast<unsigned char>(y));
  };
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1,
                         prev[j - 1] + (eq(a[i - 1], b[j - 1]) ? 0 : 1)});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// The whole of `text` as a finite number; nullopt for anything else (empty,
// trailing characters, nan, inf, out of double's range).
// The pieces of `s` between `sep`s, empty pieces kept ("a,,b" -> a, "", b;
// "" -> one empty piece).
inline std::vector<std::string> split_on(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t at = s.find(sep, start);
    out.push_back(s.substr(start, at - start));
    if (at == std::string::npos) break;
    start = at + 1;
  }
  return out;
}

inline std::optional<double> parse_finite_number(const std::string& text) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text.front()))) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == nullptr || *end != '\0' || !std::isfinite(v)) return std::nullopt;
  return v;
}

// `n` and the noun in its number: "1 rank", "2 ranks"; `plural` for a noun
// that takes more than an s ("micro-batches").
inline std::string count_of(long long n, const std::string& singular,
                            const std::string& plural = "") {
  return std::to_string(n) + " " +
         (n == 1 ? singular : plural.empty() ? singular + "s" : plural);
}

}  // namespace viaduct
