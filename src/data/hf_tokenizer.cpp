// HfBpeTokenizer: loading a tokenizer.json and encoding as the `tokenizers`
// library does (see hf_tokenizer.h for the steps).
#include "data/hf_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>

#include "core/check.h"

namespace viaduct::data {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// GPT-2's pre-tokenizer regex, used by the ByteLevel pre-tokenizer when
// use_regex is set.
constexpr const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|"
    "\\s+(?!\\S)|\\s+";

// GPT-2's bytes_to_unicode: byte b is written in a byte-level vocab as the
// code point byte_char(b): printable Latin-1 bytes as themselves, the other
// 68 as 256, 257, ... in byte order.
std::array<uint32_t, 256> byte_chars() {
  std::array<uint32_t, 256> out{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    bool printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) ||
                     (b >= 0xae && b <= 0xff);
    out[b] = printable ? b : next++;
  }
  return out;
}

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xc0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xe0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out.push_back(static_cast<char>(0xf0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

// The code points of valid UTF-8 `s` (vocab keys come from JSON, so they are
// valid).
std::vector<uint32_t> code_points(std::string_view s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    auto c = static_cast<unsigned char>(s[i]);
    int len = c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4;
    uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1f : len == 3 ? c & 0x0f : c & 0x07;
    for (int k = 1; k < len && i + k < s.size(); ++k) {
      cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
    }
    out.push_back(cp);
    i += len;
  }
  return out;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof(buf));
  return reinterpret_cast<const char*>(buf);
}

struct StringViewHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const {
    return std::hash<std::string_view>{}(s);
  }
};

}  // namespace

// One pre-tokenizer step: a regex split (Isolated) or ByteLevel's prefix
// space.
struct HfBpeTokenizer::Step {
  enum class Kind { kSplit, kPrefixSpace };
  Kind kind = Kind::kSplit;
  std::string pattern;
  pcre2_code* code = nullptr;
  bool jit = false;

  Step() = default;
  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;
  ~Step() {
    if (code != nullptr) pcre2_code_free(code);
  }
};

class HfBpeTokenizer::State final : public EncodeState {
 public:
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    int32_t len;  // 0 once merged into its left neighbour
  };
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };

  explicit State(const std::vector<std::unique_ptr<Step>>& steps) {
    jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    match_context = pcre2_match_context_create(nullptr);
    VIADUCT_CHECK(jit_stack != nullptr && match_context != nullptr,
                  "tokenizer: out of memory for the regex state");
    pcre2_jit_stack_assign(match_context, nullptr, jit_stack);
    for (const auto& step : steps) {
      match_data.push_back(
          step->code != nullptr
              ? pcre2_match_data_create_from_pattern(step->code, nullptr)
              : nullptr);
    }
  }
  ~State() override {
    for (auto* md : match_data) {
      if (md != nullptr) pcre2_match_data_free(md);
    }
    pcre2_match_context_free(match_context);
    pcre2_jit_stack_free(jit_stack);
  }

  pcre2_jit_stack* jit_stack = nullptr;
  pcre2_match_context* match_context = nullptr;
  std::vector<pcre2_match_data*> match_data;
  std::string utf8_storage;
  std::vector<std::string_view> pieces;
  std::vector<std::string_view> next_pieces;
  std::deque<std::string> owned;  // prefixed pieces (stable addresses)
  std::vector<std::pair<std::string_view, int32_t>> segments;  // id -1: text
  std::vector<std::pair<std::string_view, int32_t>> next_segments;
  std::unordered_map<std::string, std::vector<int32_t>, StringViewHash,
                     std::equal_to<>>
      cache;
  std::vector<Symbol> symbols;
  std::vector<Candidate> heap;
};

namespace {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  VIADUCT_CHECK_T(FileError, in.good(), "tokenizer: cannot open '", path, "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  VIADUCT_CHECK_T(FileError, !in.bad(), "tokenizer: cannot read '", path, "'");
  return ss.str();
}

}  // namespace

HfBpeTokenizer::HfBpeTokenizer(const std::string& spec) {
  path_ = spec;
  std::error_code ec;
  if (fs::is_directory(spec, ec)) path_ = (fs::path(spec) / "tokenizer.json").string();
  VIADUCT_CHECK_T(FileError, fs::is_regular_file(path_, ec), "tokenizer: '",
                  path_, "' does not exist");
  json j;
  try {
    j = json::parse(read_text_file(path_));
  } catch (const json::exception& e) {
    throw FileError(str("tokenizer: '", path_, "' is not valid JSON: ", e.what()));
  }
  auto fail = [&](const std::string& what) -> FileError {
    return FileError(str("tokenizer: '", path_, "': ", what));
  };
  try {
    VIADUCT_CHECK(j.is_object() && j.contains("model"),
                  "tokenizer: '", path_, "': no \"model\" (not a tokenizer.json)");
    const json& model = j.at("model");
    std::string type = model.value("type", std::string("BPE"));
    if (type != "BPE") {
      throw fail(str("model type '", type,
                     "' is not supported (viaduct reads byte-level BPE)"));
    }
    if (model.contains("byte_fallback") && model["byte_fallback"].is_boolean() &&
        model["byte_fallback"].get<bool>()) {
      throw fail("model.byte_fallback is set: a SentencePiece-style BPE, not "
                 "byte-level");
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (model.contains(key) && !model[key].is_null() &&
          !(model[key].is_string() && model[key].get<std::string>().empty())) {
        throw fail(str("model.", key, " is set, which viaduct does not support"));
      }
    }
    if (model.contains("dropout") && !model["dropout"].is_null() &&
        model["dropout"].get<double>() > 0.0) {
      throw fail("model.dropout (BPE dropout) is not supported");
    }
    ignore_merges_ = model.value("ignore_merges", false);
    if (j.contains("normalizer") && !j["normalizer"].is_null()) {
      throw fail(str("normalizer '", j["normalizer"].value("type", std::string("?")),
                     "' is not supported (viaduct reads tokenizers without a "
                     "normalizer)"));
    }

    // Vocab: byte-level keys -> raw bytes.
    const std::array<uint32_t, 256> chars = byte_chars();
    std::unordered_map<uint32_t, uint8_t> char_to_byte;
    for (int b = 0; b < 256; ++b) char_to_byte[chars[b]] = static_cast<uint8_t>(b);
    std::unordered_map<std::string, int32_t> key_to_id;
    const json& vocab = model.at("vocab");
    VIADUCT_CHECK(vocab.is_object(), "tokenizer: '", path_,
                  "': model.vocab is not an object");
    int64_t max_id = -1;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      int64_t id = it.value().get<int64_t>();
      if (id < 0 || id > INT32_MAX) throw fail(str("vocab id ", id, " is out of range"));
      key_to_id.emplace(it.key(), static_cast<int32_t>(id));
      max_id = std::max(max_id, id);
    }
    id_to_bytes_.assign(static_cast<size_t>(max_id + 1), std::string());
    for (const auto& [key, id] : key_to_id) {
      std::string raw;
      bool byte_level = true;
      for (uint32_t cp : code_points(key)) {
        auto f = char_to_byte.find(cp);
        if (f == char_to_byte.end()) {
          byte_level = false;
          break;
        }
        raw.push_back(static_cast<char>(f->second));
      }
      if (!byte_level) raw = key;  // unreachable by BPE; decoded as written
      id_to_bytes_[id] = raw;
      if (byte_level) bytes_to_id_.emplace(raw, id);
    }
    for (int b = 0; b < 256; ++b) {
      std::string key;
      append_utf8(chars[b], key);
      auto f = key_to_id.find(key);
      if (f == key_to_id.end()) {
        throw fail(str("the vocab has no token for byte ", b,
                       ": not a byte-level BPE"));
      }
      byte_ids_[b] = f->second;
    }

    // Merges: "a b" strings or [a, b] pairs, ranked in order.
    const json& merges = model.at("merges");
    merges_.reserve(merges.size());
    int32_t rank = 0;
    for (const json& m : merges) {
      std::string a, b;
      if (m.is_string()) {
        const std::string& s = m.get_ref<const std::string&>();
        size_t sp = s.find(' ', 1);
        if (sp == std::string::npos) throw fail(str("merge '", s, "' has no space"));
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (m.is_array() && m.size() == 2) {
        a = m[0].get<std::string>();
        b = m[1].get<std::string>();
      } else {
        throw fail(str("merge ", rank, " is neither \"a b\" nor [a, b]"));
      }
      auto fa = key_to_id.find(a), fb = key_to_id.find(b),
           fm = key_to_id.find(a + b);
      if (fa == key_to_id.end() || fb == key_to_id.end() || fm == key_to_id.end()) {
        throw fail(str("merge ", rank, " ('", a, "' '", b,
                       "') names a token missing from the vocab"));
      }
      uint64_t key = (static_cast<uint64_t>(fa->second) << 32) |
                     static_cast<uint32_t>(fb->second);
      merges_.emplace(key, Merge{rank, fm->second});
      ++rank;
    }

    // Added tokens.
    if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
      for (const json& t : j["added_tokens"]) {
        AddedToken tok{t.at("content").get<std::string>(),
                       static_cast<int32_t>(t.at("id").get<int64_t>())};
        for (const char* flag : {"lstrip", "rstrip", "single_word"}) {
          if (t.value(flag, false)) {
            throw fail(str("added token '", tok.content, "' sets ", flag,
                           ", which viaduct does not support"));
          }
        }
        if (tok.content.empty()) throw fail("an added token is empty");
        if (tok.id < 0) throw fail(str("added token '", tok.content, "' has id ", tok.id));
        const bool normalized = t.value("normalized", false);
        max_id = std::max<int64_t>(max_id, tok.id);
        if (static_cast<size_t>(tok.id) >= id_to_bytes_.size()) {
          id_to_bytes_.resize(static_cast<size_t>(tok.id) + 1);
        }
        id_to_bytes_[tok.id] = tok.content;
        added_.push_back(tok);
        added_by_first_byte_[normalized ? 1 : 0]
                            [static_cast<unsigned char>(tok.content[0])]
                                .push_back(static_cast<int32_t>(added_.size() - 1));
      }
    }
    vocab_size_ = max_id + 1;

    // Pre-tokenizer.
    bool byte_level = false;
    std::function<void(const json&)> add_pre = [&](const json& p) {
      std::string t = p.value("type", std::string());
      if (t == "Sequence") {
        for (const json& q : p.at("pretokenizers")) add_pre(q);
      } else if (t == "ByteLevel") {
        byte_level = true;
        if (p.value("add_prefix_space", false)) {
          auto s = std::make_unique<Step>();
          s->kind = Step::Kind::kPrefixSpace;
          steps_.push_back(std::move(s));
        }
        if (p.value("use_regex", true)) {
          auto s = std::make_unique<Step>();
          s->pattern = kGpt2Pattern;
          steps_.push_back(std::move(s));
        }
      } else if (t == "Split") {
        std::string behavior = p.value("behavior", std::string());
        if (behavior != "Isolated") {
          throw fail(str("pre-tokenizer Split with behavior '", behavior,
                         "' is not supported (only Isolated)"));
        }
        if (p.value("invert", false)) {
          throw fail("pre-tokenizer Split with invert is not supported");
        }
        const json& pat = p.at("pattern");
        auto s = std::make_unique<Step>();
        if (pat.contains("Regex")) {
          s->pattern = pat["Regex"].get<std::string>();
        } else if (pat.contains("String")) {
          // A literal: quoted for PCRE2.
          s->pattern = "\\Q" + pat["String"].get<std::string>() + "\\E";
        } else {
          throw fail("pre-tokenizer Split has neither a Regex nor a String pattern");
        }
        steps_.push_back(std::move(s));
      } else if (t == "Digits") {
        auto s = std::make_unique<Step>();
        s->pattern = p.value("individual_digits", false) ? "\\p{N}" : "\\p{N}+";
        steps_.push_back(std::move(s));
      } else {
        throw fail(str("pre-tokenizer '", t, "' is not supported"));
      }
    };
    if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) {
      add_pre(j["pre_tokenizer"]);
    }
    if (!byte_level) {
      throw fail("the pre-tokenizer has no ByteLevel step: not a byte-level BPE");
    }
    compile_steps();

    // Decoder: byte-level ids decode through the byte table.
    if (j.contains("decoder") && !j["decoder"].is_null()) {
      std::string t = j["decoder"].value("type", std::string());
      if (t != "ByteLevel") {
        throw fail(str("decoder '", t, "' is not supported (only ByteLevel)"));
      }
    }

    // Post-processor.
    std::function<void(const json&)> add_post = [&](const json& p) {
      std::string t = p.value("type", std::string());
      if (t == "Sequence") {
        for (const json& q : p.at("processors")) add_post(q);
      } else if (t == "ByteLevel") {
        // Offsets only.
      } else if (t == "TemplateProcessing") {
        const json& specials = p.at("special_tokens");
        bool after = false;
        for (const json& item : p.at("single")) {
          if (item.contains("Sequence")) {
            after = true;
            continue;
          }
          std::string name = item.at("SpecialToken").at("id").get<std::string>();
          if (!specials.contains(name)) {
            throw fail(str("post-processor names special token '", name,
                           "' missing from its special_tokens"));
          }
          for (const json& id : specials[name].at("ids")) {
            (after ? suffix_ids_ : prefix_ids_).push_back(id.get<int64_t>());
          }
        }
      } else {
        throw fail(str("post-processor '", t, "' is not supported"));
      }
    };
    if (j.contains("post_processor") && !j["post_processor"].is_null()) {
      add_post(j["post_processor"]);
    }
  } catch (const json::exception& e) {
    throw fail(str("unexpected layout: ", e.what()));
  }

  fs::path p(path_);
  std::string stem = p.filename() == "tokenizer.json" && p.has_parent_path()
                         ? fs::absolute(p).parent_path().filename().string()
                         : p.stem().string();
  finish("hf:" + stem);
}

HfBpeTokenizer::~HfBpeTokenizer() = default;

void HfBpeTokenizer::compile_steps() {
  for (auto& s : steps_) {
    if (s->kind != Step::Kind::kSplit) continue;
    int err = 0;
    PCRE2_SIZE offset = 0;
    s->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(s->pattern.data()),
                            s->pattern.size(), PCRE2_UTF | PCRE2_UCP, &err,
                            &offset, nullptr);
    VIADUCT_CHECK_T(FileError, s->code != nullptr, "tokenizer: '", path_,
                    "': pre-tokenizer regex '", s->pattern,
                    "' does not compile at offset ", offset, ": ",
                    pcre2_message(err));
    s->jit = pcre2_jit_compile(s->code, PCRE2_JIT_COMPLETE) == 0;
  }
}

void HfBpeTokenizer::finish(const std::string& name) {
  for (auto& pass : added_by_first_byte_) {
    for (auto& list : pass) {
      std::stable_sort(list.begin(), list.end(), [&](int32_t x, int32_t y) {
        return added_[x].content.size() > added_[y].content.size();
      });
    }
  }
  if (prefix_ids_.empty() && suffix_ids_.empty()) {
    for (const char* token : {"<|endoftext|>", "<|end_of_text|>", "</s>"}) {
      int64_t id = token_id(token);
      if (id >= 0) {
        separator_id_ = id;
        break;
      }
    }
  }
  name_ = name.substr(0, 63);
}

namespace {

// tiktoken's encodings: the pre-tokenizer regex and the special tokens its
// openai_public.py gives each (a .tiktoken file holds only the ranks).
struct TiktokenEncoding {
  const char* name;
  const char* pattern;
  std::vector<std::pair<const char*, int32_t>> specials;
};

const std::vector<TiktokenEncoding>& tiktoken_encodings() {
  static const char* kR50k = kGpt2Pattern;
  static const char* kCl100k =
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
      "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
  static const char* kO200k =
      "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}"
      "\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}"
      "\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|"
      "'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|"
      "\\s+";
  static const std::vector<TiktokenEncoding> kAll = {
      {"r50k_base", kR50k, {{"<|endoftext|>", 50256}}},
      {"gpt2", kR50k, {{"<|endoftext|>", 50256}}},
      {"p50k_base", kR50k, {{"<|endoftext|>", 50256}}},
      {"cl100k_base", kCl100k,
       {{"<|endoftext|>", 100257}, {"<|fim_prefix|>", 100258},
        {"<|fim_middle|>", 100259}, {"<|fim_suffix|>", 100260},
        {"<|endofprompt|>", 100276}}},
      {"o200k_base", kO200k, {{"<|endoftext|>", 199999}, {"<|endofprompt|>", 200018}}},
  };
  return kAll;
}

int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

bool base64_decode(std::string_view in, std::string& out) {
  out.clear();
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    int v = base64_value(c);
    if (v < 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  return true;
}

}  // namespace

std::unique_ptr<HfBpeTokenizer> HfBpeTokenizer::from_tiktoken(const std::string& path) {
  std::unique_ptr<HfBpeTokenizer> t(new HfBpeTokenizer());
  t->path_ = path;
  const std::string stem = fs::path(path).stem().string();
  const TiktokenEncoding* enc = nullptr;
  std::string names;
  for (const auto& e : tiktoken_encodings()) {
    if (stem == e.name) enc = &e;
    names += (names.empty() ? "" : ", ") + std::string(e.name);
  }
  VIADUCT_CHECK_T(FileError, enc != nullptr, "tokenizer: '", path,
                  "': the file name does not say which tiktoken encoding it is (",
                  names, ".tiktoken): its regex and special tokens go by name");
  const std::string text = read_text_file(path);
  int64_t max_id = -1;
  std::string bytes;
  int64_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (line.empty()) continue;
    size_t sp = line.find(' ');
    char* stop = nullptr;
    std::string rank_text(sp == std::string_view::npos ? "" : line.substr(sp + 1));
    long long rank = std::strtoll(rank_text.c_str(), &stop, 10);
    VIADUCT_CHECK_T(FileError,
                    sp != std::string_view::npos && !rank_text.empty() && *stop == '\0' &&
                        rank >= 0 && rank < INT32_MAX &&
                        base64_decode(line.substr(0, sp), bytes) && !bytes.empty(),
                    "tokenizer: '", path, "' line ", line_no,
                    " is not '<base64 token> <rank>'");
    VIADUCT_CHECK_T(FileError, t->bytes_to_id_.emplace(bytes, static_cast<int32_t>(rank)).second,
                    "tokenizer: '", path, "' line ", line_no, " repeats a token");
    if (rank >= static_cast<long long>(t->id_to_bytes_.size())) {
      t->id_to_bytes_.resize(static_cast<size_t>(rank) + 1);
    }
    t->id_to_bytes_[rank] = bytes;
    max_id = std::max<int64_t>(max_id, rank);
  }
  for (int b = 0; b < 256; ++b) {
    auto f = t->bytes_to_id_.find(std::string(1, static_cast<char>(b)));
    VIADUCT_CHECK_T(FileError, f != t->bytes_to_id_.end(), "tokenizer: '", path,
                    "' has no token for byte ", b, ": not a byte-level BPE");
    t->byte_ids_[b] = f->second;
  }
  // tiktoken merges any two adjacent parts whose bytes together are a token,
  // lowest rank first: the merge table holds every split of every token.
  for (const auto& [tok, id] : t->bytes_to_id_) {
    for (size_t k = 1; k < tok.size(); ++k) {
      auto l = t->bytes_to_id_.find(tok.substr(0, k));
      if (l == t->bytes_to_id_.end()) continue;
      auto r = t->bytes_to_id_.find(tok.substr(k));
      if (r == t->bytes_to_id_.end()) continue;
      uint64_t key = (static_cast<uint64_t>(l->second) << 32) | static_cast<uint32_t>(r->second);
      t->merges_.emplace(key, Merge{id, id});
    }
  }
  t->ignore_merges_ = true;
  for (const auto& [content, id] : enc->specials) {
    t->added_.push_back({content, id});
    t->added_by_first_byte_[0][static_cast<unsigned char>(content[0])].push_back(
        static_cast<int32_t>(t->added_.size() - 1));
    if (id >= static_cast<int32_t>(t->id_to_bytes_.size())) t->id_to_bytes_.resize(id + 1);
    t->id_to_bytes_[id] = content;
    max_id = std::max<int64_t>(max_id, id);
  }
  t->vocab_size_ = max_id + 1;
  auto step = std::make_unique<Step>();
  step->pattern = enc->pattern;
  t->steps_.push_back(std::move(step));
  t->compile_steps();
  t->finish(std::string("tiktoken:") + enc->name);
  return t;
}

int64_t HfBpeTokenizer::token_id(const std::string& token) const {
  for (const auto& a : added_) {
    if (a.content == token) return a.id;
  }
  auto f = bytes_to_id_.find(token);
  return f == bytes_to_id_.end() ? -1 : f->second;
}

std::unique_ptr<EncodeState> HfBpeTokenizer::new_state() const {
  return std::make_unique<State>(steps_);
}

const HfBpeTokenizer::Merge* HfBpeTokenizer::find_merge(int32_t left,
                                                        int32_t right) const {
  uint64_t key =
      (static_cast<uint64_t>(left) << 32) | static_cast<uint32_t>(right);
  auto f = merges_.find(key);
  return f == merges_.end() ? nullptr : &f->second;
}

void HfBpeTokenizer::encode_piece(std::string_view piece,
                                  std::vector<int64_t>& out,
                                  State& st) const {
  if (piece.empty()) return;
  if (auto c = st.cache.find(piece); c != st.cache.end()) {
    out.insert(out.end(), c->second.begin(), c->second.end());
    return;
  }
  std::vector<int32_t> ids;
  auto whole = ignore_merges_ ? bytes_to_id_.find(std::string(piece))
                              : bytes_to_id_.end();
  if (whole != bytes_to_id_.end()) {
    ids.push_back(whole->second);
  } else {
    // Word::merge_all: the lowest-ranked pair first, leftmost on ties.
    auto& sym = st.symbols;
    auto& heap = st.heap;
    const int32_t n = static_cast<int32_t>(piece.size());
    sym.resize(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) {
      sym[i] = {byte_ids_[static_cast<unsigned char>(piece[i])], i - 1,
                i + 1 < n ? i + 1 : -1, 1};
    }
    heap.clear();
    const std::greater<State::Candidate> cmp;
    for (int32_t i = 0; i + 1 < n; ++i) {
      if (const Merge* m = find_merge(sym[i].id, sym[i + 1].id)) {
        heap.push_back({m->rank, i, m->new_id});
      }
    }
    std::make_heap(heap.begin(), heap.end(), cmp);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), cmp);
      State::Candidate top = heap.back();
      heap.pop_back();
      State::Symbol& s = sym[top.pos];
      if (s.len == 0 || s.next == -1) continue;
      State::Symbol& right = sym[s.next];
      const Merge* m = find_merge(s.id, right.id);
      if (m == nullptr || m->new_id != top.new_id) continue;
      s.id = top.new_id;
      s.len += right.len;
      right.len = 0;
      s.next = right.next;
      if (s.next != -1) sym[s.next].prev = top.pos;
      if (s.prev != -1) {
        if (const Merge* l = find_merge(sym[s.prev].id, s.id)) {
          heap.push_back({l->rank, s.prev, l->new_id});
          std::push_heap(heap.begin(), heap.end(), cmp);
        }
      }
      if (s.next != -1) {
        if (const Merge* r = find_merge(s.id, sym[s.next].id)) {
          heap.push_back({r->rank, top.pos, r->new_id});
          std::push_heap(heap.begin(), heap.end(), cmp);
        }
      }
    }
    for (int32_t i = 0; i != -1; i = sym[i].next) ids.push_back(sym[i].id);
  }
  out.insert(out.end(), ids.begin(), ids.end());
  if (st.cache.size() >= (1u << 18)) st.cache.clear();
  st.cache.emplace(std::string(piece), std::move(ids));
}

void HfBpeTokenizer::encode_segment(std::string_view text,
                                    std::vector<int64_t>& out,
                                    State& st) const {
  st.pieces.assign(1, text);
  for (size_t k = 0; k < steps_.size(); ++k) {
    const Step& step = *steps_[k];
    if (step.kind == Step::Kind::kPrefixSpace) {
      for (auto& p : st.pieces) {
        if (p.empty() || p[0] != ' ') {
          std::string& prefixed = st.owned.emplace_back(1, ' ');
          prefixed.append(p.data(), p.size());
          p = prefixed;
        }
      }
      continue;
    }
    st.next_pieces.clear();
    pcre2_match_data* md = st.match_data[k];
    for (std::string_view p : st.pieces) {
      const auto* subject = reinterpret_cast<PCRE2_SPTR>(p.data());
      size_t pos = 0;   // where the next match search starts
      size_t last = 0;  // end of the last piece emitted
      while (pos <= p.size()) {
        int rc = step.jit ? pcre2_jit_match(step.code, subject, p.size(), pos, 0,
                                            md, st.match_context)
                          : pcre2_match(step.code, subject, p.size(), pos,
                                        PCRE2_NO_UTF_CHECK, md, st.match_context);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        VIADUCT_CHECK(rc >= 0, "tokenizer '", path_, "': regex '", step.pattern,
                      "' failed: ", pcre2_message(rc));
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
        size_t s = ov[0], e = ov[1];
        if (e == s) {  // an empty match splits nothing; step one character
          pos = s + 1;
          while (pos < p.size() &&
                 (static_cast<unsigned char>(p[pos]) & 0xc0) == 0x80) {
            ++pos;
          }
          continue;
        }
        if (s > last) st.next_pieces.push_back(p.substr(last, s - last));
        st.next_pieces.push_back(p.substr(s, e - s));
        last = pos = e;
      }
      if (last < p.size()) st.next_pieces.push_back(p.substr(last));
    }
    std::swap(st.pieces, st.next_pieces);
  }
  for (std::string_view p : st.pieces) encode_piece(p, out, st);
  st.owned.clear();
}

void HfBpeTokenizer::encode_into(std::string_view text, bool add_special_tokens,
                                 std::vector<int64_t>& out,
                                 EncodeState& state) const {
  auto& st = static_cast<State&>(state);
  text = to_valid_utf8(text, st.utf8_storage);
  if (add_special_tokens) out.insert(out.end(), prefix_ids_.begin(), prefix_ids_.end());
  // Added tokens: two passes (see added_by_first_byte_), each leftmost-longest.
  st.segments.assign(1, {text, -1});
  for (const auto& table : added_by_first_byte_) {
    st.next_segments.clear();
    for (const auto& [seg, id] : st.segments) {
      if (id >= 0) {
        st.next_segments.emplace_back(seg, id);
        continue;
      }
      size_t last = 0;
      for (size_t i = 0; i < seg.size(); ++i) {
        const auto& cands = table[static_cast<unsigned char>(seg[i])];
        if (cands.empty()) continue;
        for (int32_t c : cands) {
          const std::string& content = added_[c].content;
          if (seg.compare(i, content.size(), content) == 0) {
            if (i > last) st.next_segments.emplace_back(seg.substr(last, i - last), -1);
            st.next_segments.emplace_back(seg.substr(i, content.size()), added_[c].id);
            last = i + content.size();
            i = last - 1;
            break;
          }
        }
      }
      if (last < seg.size()) st.next_segments.emplace_back(seg.substr(last), -1);
    }
    std::swap(st.segments, st.next_segments);
  }
  for (const auto& [seg, id] : st.segments) {
    if (id >= 0) {
      out.push_back(id);
    } else {
      encode_segment(seg, out, st);
    }
  }
  if (add_special_tokens) out.insert(out.end(), suffix_ids_.begin(), suffix_ids_.end());
}

DocumentMarker HfBpeTokenizer::document_marker() const {
  // As encode_document: the separator first, else the post-processor's
  // first prefix token, else its last suffix token closes the document.
  if (separator_id_ >= 0) return {separator_id_, DocumentMarker::Kind::kStarts};
  if (!prefix_ids_.empty()) return {prefix_ids_.front(), DocumentMarker::Kind::kStarts};
  VIADUCT_CHECK(!suffix_ids_.empty(), "tokenizer '", path_,
                "': its post-processor adds no special token and it has none "
                "of <|endoftext|>, <|end_of_text|>, </s> to put between "
                "documents");
  return {suffix_ids_.back(), DocumentMarker::Kind::kEnds};
}

void HfBpeTokenizer::encode_document(std::string_view text,
                                     std::vector<int64_t>& out,
                                     EncodeState& state) const {
  if (separator_id_ >= 0) {
    out.push_back(separator_id_);
    encode_into(text, false, out, state);
    return;
  }
  VIADUCT_CHECK(!prefix_ids_.empty() || !suffix_ids_.empty(), "tokenizer '",
                path_,
                "': its post-processor adds no special token and it has none "
                "of <|endoftext|>, <|end_of_text|>, </s> to put between "
                "documents");
  encode_into(text, true, out, state);
}

std::string HfBpeTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    int64_t id = ids[i];
    VIADUCT_CHECK(id >= 0 && id < static_cast<int64_t>(id_to_bytes_.size()) &&
                      !id_to_bytes_[id].empty(),
                  "tokenizer '", path_, "': token ", id, " at position ", i,
                  " is not in the vocab");
    out += id_to_bytes_[id];
  }
  return out;
}

}  // namespace viaduct::data
