// Shared fixtures of the data and trainer tests: sampler options in one
// call, and a small token corpus with structure to learn.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/sampler.h"
#include "data/token_file.h"

namespace viaduct::data::testing {

inline SamplerOptions opts(int64_t B, int64_t T, int64_t rank = 0, int64_t dp = 1,
                           bool shuffle = false, uint64_t seed = 0) {
  SamplerOptions o;
  o.batch_size = B;
  o.seq_len = T;
  o.dp_rank = rank;
  o.dp_size = dp;
  o.shuffle = shuffle;
  o.seed = seed;
  return o;
}

// n byte tokens (vocabulary 257) of one repeated phrase.
inline void write_phrase_corpus(const std::string& path, int64_t n) {
  TokenFileWriter w(path, 257, "byte");
  const std::string text = "the quick brown fox jumps over the lazy dog. ";
  std::vector<int64_t> toks;
  for (int64_t i = 0; i < n; ++i) toks.push_back(static_cast<unsigned char>(text[i % text.size()]));
  w.append(toks);
  w.finish();
}

}  // namespace viaduct::data::testing
