// load_tokenizer, the byte tokenizer behind TextTokenizer, and the UTF-8
// repair every real tokenizer needs before its regexes run.
#include "data/text_tokenizer.h"

#include <filesystem>

#include "core/check.h"
#include "data/hf_tokenizer.h"
#include "data/spm_tokenizer.h"
#include "data/tokenizer.h"

namespace viaduct::data {

namespace {

class ByteTextTokenizer final : public TextTokenizer {
 public:
  std::string name() const override { return ByteTokenizer::kName; }
  int64_t vocab_size() const override { return ByteTokenizer::kVocabSize; }
  std::unique_ptr<EncodeState> new_state() const override {
    return std::make_unique<EncodeState>();
  }
  void encode_into(std::string_view text, bool /*add_special_tokens*/,
                   std::vector<int64_t>& out, EncodeState&) const override {
    ByteTokenizer::encode_into(text, out);
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    return ByteTokenizer::decode(ids);
  }
  void encode_document(std::string_view text, std::vector<int64_t>& out,
                       EncodeState&) const override {
    out.push_back(ByteTokenizer::kEndOfText);
    ByteTokenizer::encode_into(text, out);
  }
  DocumentMarker document_marker() const override {
    return {ByteTokenizer::kEndOfText, DocumentMarker::Kind::kStarts};
  }
};

// Length of the valid UTF-8 sequence at s[i], or the length of its maximal
// invalid subpart (at least 1) negated.
int utf8_sequence(std::string_view s, size_t i) {
  auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  unsigned char c = b(i);
  if (c < 0x80) return 1;
  int len;
  unsigned char lo = 0x80, hi = 0xbf;
  if (c >= 0xc2 && c <= 0xdf) {
    len = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    len = 3;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    len = 4;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
  } else {
    return -1;
  }
  for (int k = 1; k < len; ++k) {
    if (i + k >= s.size()) return -k;
    unsigned char x = b(i + k);
    bool ok = k == 1 ? (x >= lo && x <= hi) : (x >= 0x80 && x <= 0xbf);
    if (!ok) return -k;
  }
  return len;
}

}  // namespace

std::vector<int64_t> TextTokenizer::encode(std::string_view text,
                                           bool add_special_tokens) const {
  std::vector<int64_t> out;
  auto state = new_state();
  encode_into(text, add_special_tokens, out, *state);
  return out;
}

std::string_view to_valid_utf8(std::string_view text, std::string& storage) {
  size_t i = 0;
  while (i < text.size()) {
    int n = utf8_sequence(text, i);
    if (n < 0) break;
    i += static_cast<size_t>(n);
  }
  if (i == text.size()) return text;
  storage.assign(text.substr(0, i));
  while (i < text.size()) {
    int n = utf8_sequence(text, i);
    if (n > 0) {
      storage.append(text.substr(i, static_cast<size_t>(n)));
      i += static_cast<size_t>(n);
    } else {
      storage += "\xef\xbf\xbd";
      i += static_cast<size_t>(-n);
    }
  }
  return storage;
}

std::unique_ptr<TextTokenizer> load_tokenizer(const std::string& spec) {
  if (spec.empty() || spec == ByteTokenizer::kName) {
    return std::make_unique<ByteTextTokenizer>();
  }
  std::error_code ec;
  VIADUCT_CHECK_T(FileError, std::filesystem::exists(spec, ec),
                  "tokenizer: '", spec,
                  "' does not exist (expected 'byte', a tokenizer.json, a "
                  "folder holding one, a tiktoken .tiktoken file or a SentencePiece "
                  ".model file)");
  const std::string ext = std::filesystem::path(spec).extension().string();
  if (ext == ".tiktoken") return HfBpeTokenizer::from_tiktoken(spec);
  if (ext == ".model") return std::make_unique<SpmTokenizer>(spec);
  return std::make_unique<HfBpeTokenizer>(spec);
}

}  // namespace viaduct::data
