// The built-in byte-level tokenizer: token b (0..255) is the byte b, and the
// special tokens follow the bytes. Every byte string encodes losslessly, so
// no vocabulary file is needed and any text corpus can be prepared offline.
//
//   ids 0..255   the bytes
//   id  256      <|endoftext|>, put before every document by prepare-data
//   vocab size   257 (a model may pad its embedding beyond this)
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace viaduct::data {

class ByteTokenizer {
 public:
  static constexpr int64_t kEndOfText = 256;
  static constexpr int64_t kVocabSize = 257;
  static constexpr const char* kName = "byte";
  static constexpr const char* kEndOfTextText = "<|endoftext|>";

  static const char* name() { return kName; }
  static int64_t vocab_size() { return kVocabSize; }

  // One token per byte; special-token text in `text` is not special.
  static std::vector<int64_t> encode(std::string_view text);
  // Appends encode(text) to `out`.
  static void encode_into(std::string_view text, std::vector<int64_t>& out);
  // Bytes back to text; <|endoftext|> is written as its text. An id outside
  // the vocab is an Error.
  static std::string decode(const std::vector<int64_t>& tokens);
  static std::string decode(const int64_t* tokens, int64_t count);
};

}  // namespace viaduct::data
