// The byte-level tokenizer (see tokenizer.h for the id layout).
#include "data/tokenizer.h"

#include "core/check.h"

namespace viaduct::data {

void ByteTokenizer::encode_into(std::string_view text,
                                std::vector<int64_t>& out) {
  out.reserve(out.size() + text.size());
  for (char c : text) out.push_back(static_cast<unsigned char>(c));
}

std::vector<int64_t> ByteTokenizer::encode(std::string_view text) {
  std::vector<int64_t> out;
  encode_into(text, out);
  return out;
}

std::string ByteTokenizer::decode(const int64_t* tokens, int64_t count) {
  std::string out;
  out.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    int64_t t = tokens[i];
    if (t >= 0 && t < 256) {
      out.push_back(static_cast<char>(static_cast<unsigned char>(t)));
    } else if (t == kEndOfText) {
      out += kEndOfTextText;
    } else {
      throw Error(str("byte tokenizer: token ", t, " at position ", i,
                      " is outside the vocab [0, ", kVocabSize, ")"));
    }
  }
  return out;
}

std::string ByteTokenizer::decode(const std::vector<int64_t>& tokens) {
  return decode(tokens.data(), static_cast<int64_t>(tokens.size()));
}

}  // namespace viaduct::data
