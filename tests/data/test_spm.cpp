// SentencePiece .model files through viaduct-spm against Debian's own
// `spm_encode`, id for id: models trained by `spm_train` (BPE and unigram) on
// a slice of the fortunes corpus, every fortunes line and hard cases
// encoded both ways; documents get BOS (or EOS) as spm_tokenizer.h says;
// prepare-data with several threads writes what one thread writes; decode
// inverts encode; a corrupt model and a missing worker are refused naming
// them.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "data/prepare.h"
#include "data/spm_tokenizer.h"
#include "data/temp_dir.h"
#include "data/text_tokenizer.h"
#include "data/token_file.h"

namespace viaduct::data {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;
using testing::write_text;

const std::string kFortunesFolder = "/usr/share/games/fortunes";

// Every non-empty line of the fortunes files (spm_encode reads lines).
std::vector<std::string> fortune_lines() {
  std::vector<std::string> lines;
  for (const auto& path : list_text_files({kFortunesFolder})) {
    std::ifstream in(path, std::ios::binary);
    for (std::string l; std::getline(in, l);) {
      if (!l.empty() && l != "%") lines.push_back(l);
    }
  }
  return lines;
}

const std::vector<std::string> kHardCases = {
    "Hello, world!",
    "  leading, and   runs   of spaces  ",
    "emoji \xf0\x9f\xa4\x97 and \xc3\xbc" "n" "\xc3\xaf" "c" "\xc3\xb6" "d" "\xc3\xa9",
    "numbers 1234567 and 3.14159, 2024-12-02",
    "tabs\tinside\tthe line",
    "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae\xe3\x83\x86\xe3\x82\xad\xe3\x82\xb9\xe3\x83\x88",
    "don't can't won't y'all'd've",
    "<s> and </s> written as text",
};

int run(const std::string& cmd) { return std::system(cmd.c_str()); }

// spm_encode's ids for each line of `lines`.
std::vector<std::vector<int64_t>> reference_ids(const std::string& model_file,
                                                   const std::vector<std::string>& lines) {
  TempDir dir;
  std::string text;
  for (const auto& l : lines) text += l + "\n";
  write_text(dir.file("in.txt"), text);
  const std::string cmd = "spm_encode --model=" + model_file +
                          " --output_format=id --input=" + dir.file("in.txt") +
                          " --output=" + dir.file("out.txt");
  EXPECT_EQ(run(cmd), 0) << cmd;
  std::vector<std::vector<int64_t>> ids;
  std::ifstream in(dir.file("out.txt"));
  for (std::string l; std::getline(in, l);) {
    std::istringstream row(l);
    std::vector<int64_t> r;
    for (int64_t id; row >> id;) r.push_back(id);
    ids.push_back(r);
  }
  return ids;
}


// Models trained once for the binary: BPE and unigram, vocabulary 1000, on
// the first 20,000 fortunes lines.
class Spm : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ::setenv("VIADUCT_SPM_WORKER", VIADUCT_SPM_WORKER_PATH, 1);
    dir_ = new TempDir();
    const auto lines = fortune_lines();
    std::string text;
    for (size_t i = 0; i < lines.size() && i < 20000; ++i) text += lines[i] + "\n";
    write_text(dir_->file("train.txt"), text);
    for (const char* type : {"bpe", "unigram"}) {
      const std::string cmd = "spm_train --minloglevel=2 --input=" + dir_->file("train.txt") +
                              " --model_prefix=" + dir_->file(type) +
                              " --vocab_size=1000 --model_type=" + type + " > " +
                              dir_->file(std::string(type) + ".log") + " 2>&1";
      ASSERT_EQ(run(cmd), 0) << cmd << " (Debian's sentencepiece package is needed)";
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string model(const std::string& type) { return dir_->file(type + ".model"); }

  static TempDir* dir_;
};
TempDir* Spm::dir_ = nullptr;

void expect_same_ids(const std::string& model_file, const std::vector<std::string>& lines) {
  SpmTokenizer tok(model_file);
  auto state = tok.new_state();
  const auto reference = reference_ids(model_file, lines);
  ASSERT_EQ(reference.size(), lines.size());
  int shown = 0;
  size_t differ = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    std::vector<int64_t> got;
    tok.encode_into(lines[i], /*add_special_tokens=*/false, got, *state);
    if (got != reference[i]) {
      ++differ;
      if (shown++ < 3) ADD_FAILURE() << model_file << " line " << i << ": '" << lines[i] << "'";
    }
  }
  EXPECT_EQ(differ, 0u) << "of " << lines.size() << " lines";
}

TEST_F(Spm, BpeMatchesSpmEncodeOnEveryFortunesLineAndHardCases) {
  auto lines = fortune_lines();
  ASSERT_GT(lines.size(), 10000u);
  lines.insert(lines.end(), kHardCases.begin(), kHardCases.end());
  expect_same_ids(model("bpe"), lines);
}

TEST_F(Spm, UnigramMatchesSpmEncodeOnEveryFortunesLineAndHardCases) {
  auto lines = fortune_lines();
  lines.insert(lines.end(), kHardCases.begin(), kHardCases.end());
  expect_same_ids(model("unigram"), lines);
}

TEST_F(Spm, DocumentsStartWithBosAndHeaderFactsComeFromTheModel) {
  SpmTokenizer tok(model("bpe"));
  // spm_train's defaults: unk 0, bos 1, eos 2.
  EXPECT_EQ(tok.vocab_size(), 1000);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_EQ(tok.name(), "spm:bpe");
  auto state = tok.new_state();
  std::vector<int64_t> doc, special, plain;
  tok.encode_document("Two lines\nof one document.", doc, *state);
  tok.encode_into("Two lines\nof one document.", true, special, *state);
  tok.encode_into("Two lines\nof one document.", false, plain, *state);
  ASSERT_FALSE(plain.empty());
  std::vector<int64_t> reference{1};
  reference.insert(reference.end(), plain.begin(), plain.end());
  EXPECT_EQ(doc, reference);
  EXPECT_EQ(special, reference);
  EXPECT_EQ(tok.document_marker(), (DocumentMarker{doc.front(), DocumentMarker::Kind::kStarts}));
  // A model trained without BOS puts EOS before each document.
  const std::string cmd = "spm_train --minloglevel=2 --input=" + dir_->file("train.txt") +
                          " --model_prefix=" + dir_->file("nobos") +
                          " --vocab_size=500 --model_type=bpe --bos_id=-1 > /dev/null 2>&1";
  ASSERT_EQ(run(cmd), 0) << cmd;
  SpmTokenizer nobos(dir_->file("nobos.model"));
  EXPECT_EQ(nobos.bos_id(), -1);
  auto s2 = nobos.new_state();
  std::vector<int64_t> d2, p2;
  nobos.encode_document("a document", d2, *s2);
  nobos.encode_into("a document", false, p2, *s2);
  ASSERT_FALSE(d2.empty());
  EXPECT_EQ(d2.front(), nobos.eos_id());
  EXPECT_EQ(nobos.document_marker(), (DocumentMarker{d2.front(), DocumentMarker::Kind::kStarts}));
  EXPECT_EQ(std::vector<int64_t>(d2.begin() + 1, d2.end()), p2);
}

TEST_F(Spm, DecodeInvertsEncode) {
  auto tok = load_tokenizer(model("unigram"));
  for (const std::string text : {"The quick brown fox.", "don't panic: 42 is the answer"}) {
    EXPECT_EQ(tok->decode(tok->encode(text, false)), text);
  }
  EXPECT_THROW(tok->decode({1000}), Error);
}

TEST_F(Spm, PrepareDataOnSeveralThreadsWritesWhatOneThreadWrites) {
  TempDir dir;
  const auto lines = fortune_lines();
  std::string jsonl;
  std::vector<std::string> docs;
  for (size_t i = 0; i < lines.size() && i < 3000; i += 3) {
    std::string doc = lines[i] + "\n" + lines[i + 1];
    docs.push_back(doc);
    std::string escaped;
    for (char c : doc) {
      if (c == '"' || c == '\\') escaped.push_back('\\');
      if (c == '\n') {
        escaped += "\\n";
      } else if (c == '\t') {
        escaped += "\\t";
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char u[8];
        std::snprintf(u, sizeof u, "\\u%04x", static_cast<unsigned>(c));
        escaped += u;
      } else {
        escaped.push_back(c);
      }
    }
    jsonl += "{\"text\": \"" + escaped + "\"}\n";
  }
  write_text(dir.file("docs.jsonl"), jsonl);
  std::vector<std::vector<int64_t>> outs;
  for (int threads : {1, 2}) {
    PrepareOptions o;
    o.tokenizer = model("bpe");
    o.jsonl_field = "text";
    o.threads = threads;
    const std::string out = dir.file("t" + std::to_string(threads) + ".tok");
    prepare_text_data({dir.file("docs.jsonl")}, out, o);
    TokenFile f = open_token_file(out, "auto");
    std::vector<int64_t> got(static_cast<size_t>(f.size()));
    f.read(0, f.size(), got.data());
    outs.push_back(got);
  }
  EXPECT_EQ(outs[0], outs[1]);
  // And both are BOS + the tokenizer's ids of each document, in order.
  SpmTokenizer tok(model("bpe"));
  auto state = tok.new_state();
  std::vector<int64_t> reference;
  for (const auto& d : docs) tok.encode_document(d, reference, *state);
  EXPECT_EQ(outs[0], reference);
}

TEST_F(Spm, ACorruptModelAndAMissingWorkerAreRefusedNamingThem) {
  TempDir dir;
  write_text(dir.file("broken.model"), "this is not a protobuf");
  try {
    SpmTokenizer tok(dir.file("broken.model"));
    ADD_FAILURE() << "a corrupt model was accepted";
  } catch (const FileError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(dir.file("broken.model")), std::string::npos) << m;
    EXPECT_NE(m.find("is not a SentencePiece model"), std::string::npos) << m;
  }
  ::setenv("VIADUCT_SPM_WORKER", "/nonexistent/viaduct-spm", 1);
  try {
    SpmTokenizer tok(model("bpe"));
    ADD_FAILURE() << "a missing worker was accepted";
  } catch (const FileError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("/nonexistent/viaduct-spm"), std::string::npos) << m;
    EXPECT_NE(m.find("libsentencepiece-dev"), std::string::npos) << m;
  }
  ::setenv("VIADUCT_SPM_WORKER", VIADUCT_SPM_WORKER_PATH, 1);
}

}  // namespace
}  // namespace viaduct::data
