// A Hugging Face tokenizer.json with a byte-level BPE model: GPT-2's,
// llama-3's and the many tokenizers built the same way. It encodes as the
// `tokenizers` library does:
//
//   1. added tokens (special or not) written in the text are found first,
//      leftmost-longest, and become their ids;
//   2. each stretch between them goes through the pre-tokenizer: `Split`
//      with a regex (Isolated: matches and the gaps between them are pieces),
//      `ByteLevel` (GPT-2's regex when use_regex; add_prefix_space), `Digits`,
//      or a `Sequence` of them; the regexes run on PCRE2 with Unicode
//      properties, which handles their lookaheads and \p{L} / \p{N} classes;
//   3. each piece's bytes become the byte-level symbols and are merged by the
//      lowest-ranked pair, leftmost first (a whole piece that is itself in the
//      vocab is one token when the model sets ignore_merges, as llama-3's
//      does);
//   4. the post-processor (`TemplateProcessing`, or a `Sequence` holding one)
//      adds its special tokens around the ids when asked.
//
// What the file asks for and viaduct does not do (a normalizer, a WordPiece
// or Unigram model, byte_fallback, BPE dropout, added tokens with lstrip /
// rstrip / single_word, a Split that removes or merges its matches) is
// refused when the file is loaded, naming the field.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "data/text_tokenizer.h"

namespace viaduct::data {

class HfBpeTokenizer final : public TextTokenizer {
 public:
  // `path`: a tokenizer.json, or a folder holding one.
  explicit HfBpeTokenizer(const std::string& path);
  ~HfBpeTokenizer() override;
  // A tiktoken rank file (`<base64 bytes> <rank>` lines, rank = id), named
  // after its encoding (r50k_base, p50k_base, cl100k_base, o200k_base
  // `.tiktoken`), which gives its regex and special tokens. Its BPE merges
  // the lowest-ranked adjacent pair whose bytes form a token, which is this
  // class's BPE with every split of every token as a merge.
  static std::unique_ptr<HfBpeTokenizer> from_tiktoken(const std::string& path);

  std::string name() const override { return name_; }
  int64_t vocab_size() const override { return vocab_size_; }
  std::unique_ptr<EncodeState> new_state() const override;
  void encode_into(std::string_view text, bool add_special_tokens,
                   std::vector<int64_t>& out,
                   EncodeState& state) const override;
  std::string decode(const std::vector<int64_t>& ids) const override;
  DocumentMarker document_marker() const override;
  void encode_document(std::string_view text, std::vector<int64_t>& out,
                       EncodeState& state) const override;

  // The id of a vocab or added token given by its text, or -1.
  int64_t token_id(const std::string& token) const;
  // The post-processor's ids before and after a sequence.
  const std::vector<int64_t>& bos_ids() const { return prefix_ids_; }
  const std::vector<int64_t>& eos_ids() const { return suffix_ids_; }
  // The token put before each document when the post-processor adds none;
  // -1 when the post-processor adds some.
  int64_t document_separator() const { return separator_id_; }

  struct Step;  // one pre-tokenizer step (hf_tokenizer.cpp)

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  struct AddedToken {
    std::string content;
    int32_t id;
  };
  class State;

  HfBpeTokenizer() = default;
  void compile_steps();
  // Sorts the added tokens, picks the document separator, sets the name.
  void finish(const std::string& name);
  const Merge* find_merge(int32_t left, int32_t right) const;
  void encode_segment(std::string_view text, std::vector<int64_t>& out,
                      State& state) const;
  void encode_piece(std::string_view piece, std::vector<int64_t>& out,
                    State& state) const;

  std::string path_;
  std::string name_;
  int64_t vocab_size_ = 0;
  bool ignore_merges_ = false;
  std::array<int32_t, 256> byte_ids_{};
  std::unordered_map<uint64_t, Merge> merges_;
  std::unordered_map<std::string, int32_t> bytes_to_id_;  // raw bytes -> id
  std::vector<std::string> id_to_bytes_;  // decode; "" for a hole in the ids
  std::vector<AddedToken> added_;
  // added_ indices by the token's first byte, longest content first; [0]
  // the tokens matched on the raw text (normalized: false), [1] the rest,
  // matched afterwards in what [0] left (the library's two passes).
  std::array<std::array<std::vector<int32_t>, 256>, 2> added_by_first_byte_;
  std::vector<std::unique_ptr<Step>> steps_;
  std::vector<int64_t> prefix_ids_;
  std::vector<int64_t> suffix_ids_;
  int64_t separator_id_ = -1;
};

}  // namespace viaduct::data
