// The byte tokenizer and prepare_text_data on a small temporary corpus shaped
// like Debian's fortunes folder (fortune files, `.dat` indexes, `.u8` links).
#include <gtest/gtest.h>

#include <zlib.h>

#include <filesystem>

#include "core/check.h"
#include "data/prepare.h"
#include "data/token_file.h"
#include "data/tokenizer.h"
#include "temp_dir.h"

namespace viaduct::data {
namespace {

using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;
using testing::write_text;

std::vector<int64_t> read_all(const std::string& path) {
  TokenFile f = open_token_file(path, "auto");
  std::vector<int64_t> out(static_cast<size_t>(f.size()));
  f.read(0, f.size(), out.data());
  return out;
}

// The reference stream: <|endoftext|> + bytes, per document.
std::vector<int64_t> stream_of(const std::vector<std::string>& docs) {
  std::vector<int64_t> out;
  for (const auto& d : docs) {
    out.push_back(256);
    for (unsigned char c : d) out.push_back(c);
  }
  return out;
}

TEST(ByteTokenizer, RoundTripsEveryByte) {
  std::string text;
  for (int b = 0; b < 256; ++b) text.push_back(static_cast<char>(b));
  text += "h\xc3\xa9llo <|endoftext|>";  // UTF-8 and the special text
  std::vector<int64_t> ids = ByteTokenizer::encode(text);
  ASSERT_EQ(ids.size(), text.size());
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);
  EXPECT_EQ(ids[257], 0xc3);
  EXPECT_EQ(ByteTokenizer::decode(ids), text);
  EXPECT_EQ(ByteTokenizer::vocab_size(), 257);
  EXPECT_EQ(ByteTokenizer::decode({104, 256, 105}), "h<|endoftext|>i");
  EXPECT_THROW(ByteTokenizer::decode({1, 257}), Error);
  EXPECT_THROW(ByteTokenizer::decode({-1}), Error);
}

TEST(SplitDocuments, FortuneWholeAndAuto) {
  const std::string fortune = "one\nline\n%\ntwo\n%\n  \n%\r\nthree\n%\n";
  auto docs = split_documents(fortune, DocumentSplit::kAuto);
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(docs[0], "one\nline\n");
  EXPECT_EQ(docs[1], "two\n");
  EXPECT_EQ(docs[2], "three\n");
  // "%" inside a line is text, and a file without a "%" line is one document.
  const std::string plain = "100% sure\nno separator here\n";
  auto whole = split_documents(plain, DocumentSplit::kAuto);
  ASSERT_EQ(whole.size(), 1u);
  EXPECT_EQ(whole[0], plain);
  EXPECT_EQ(split_documents(fortune, DocumentSplit::kWholeFile).size(), 1u);
  EXPECT_EQ(split_documents("a\n%\nb", DocumentSplit::kFortune).size(), 2u);
  EXPECT_TRUE(split_documents(" \n\n", DocumentSplit::kAuto).empty());
}

class PrepareTest : public ::testing::Test {
 protected:
  void SetUp() override {
    corpus_ = dir_.file("corpus");
    std::filesystem::create_directories(corpus_ + "/sub");
    write_text(corpus_ + "/b_fortunes",
               "Alpha.\n%\nBeta\n  -- B\n%\nGamma.\n%\n");
    write_text(corpus_ + "/a_plain.txt", "A plain file.\n");
    write_text(corpus_ + "/sub/c", "Delta.\n%\nEpsilon.\n");
    const char dat[] = {0, 0, 0, 2, 0, 0, 0, 3};  // like strfile's index
    write_bytes(corpus_ + "/b_fortunes.dat", dat, sizeof(dat));
    std::filesystem::create_symlink("b_fortunes", corpus_ + "/b_fortunes.u8");
    write_text(corpus_ + "/.hidden", "never read\n");
    // Sorted by path: a_plain.txt, b_fortunes, sub/c.
    docs_ = {"A plain file.\n", "Alpha.\n", "Beta\n  -- B\n",
             "Gamma.\n",        "Delta.\n", "Epsilon.\n"};
  }

  TempDir dir_;
  std::string corpus_;
  std::vector<std::string> docs_;
};

TEST_F(PrepareTest, ListsTextFilesInOrderOnce) {
  std::vector<std::string> files = list_text_files({corpus_});
  EXPECT_EQ(files, (std::vector<std::string>{corpus_ + "/a_plain.txt",
                                             corpus_ + "/b_fortunes",
                                             corpus_ + "/sub/c"}));
}

TEST_F(PrepareTest, WritesTheReferenceStream) {
  const std::string out = dir_.file("out/corpus.tok");
  PrepareStats s = prepare_text_data({corpus_}, out);
  EXPECT_EQ(s.files, 3);
  EXPECT_EQ(s.documents, 6);
  EXPECT_EQ(s.val_documents, 0);
  EXPECT_EQ(s.val_path, "");
  std::vector<int64_t> expect = stream_of(docs_);
  EXPECT_EQ(read_all(out), expect);
  EXPECT_EQ(s.train_tokens, static_cast<int64_t>(expect.size()));
  EXPECT_EQ(s.bytes_written, 128 + 2 * s.train_tokens);
  TokenFile f = open_token_file(out, "viaduct");
  EXPECT_EQ(f.vocab_size(), 257);
  EXPECT_EQ(f.tokenizer(), "byte");
  // Every document starts with the byte tokenizer's <|endoftext|>, and the
  // file says so.
  EXPECT_EQ(f.document_marker(),
            (DocumentMarker{ByteTokenizer::kEndOfText, DocumentMarker::Kind::kStarts}));
  EXPECT_EQ(read_all(out).front(), ByteTokenizer::kEndOfText);
  EXPECT_FALSE(std::filesystem::exists(out + ".tmp"));
  EXPECT_FALSE(std::filesystem::exists(dir_.file("out/corpus.val.tok")));
}

TEST_F(PrepareTest, HeldOutSplitIsEveryNthDocument) {
  const std::string out = dir_.file("c.tok");
  PrepareStats s = prepare_text_data({corpus_}, out, {.val_fraction = 0.5});
  EXPECT_EQ(s.val_path, dir_.file("c.val.tok"));
  EXPECT_EQ(s.train_documents, 3);
  EXPECT_EQ(s.val_documents, 3);
  // f = 1/2: documents 1, 3, 5 are held out.
  EXPECT_EQ(read_all(out), stream_of({docs_[0], docs_[2], docs_[4]}));
  EXPECT_EQ(read_all(s.val_path), stream_of({docs_[1], docs_[3], docs_[5]}));

  PrepareStats third =
      prepare_text_data({corpus_}, out, {.val_fraction = 0.34});
  EXPECT_EQ(third.val_documents, 2);  // documents 2 and 5
  EXPECT_EQ(read_all(third.val_path), stream_of({docs_[2], docs_[5]}));

  // Without a split, a val file from an earlier run is removed.
  prepare_text_data({corpus_}, out);
  EXPECT_FALSE(std::filesystem::exists(dir_.file("c.val.tok")));
}

TEST_F(PrepareTest, IsDeterministicAndTakesFilesAndFolders) {
  prepare_text_data({corpus_}, dir_.file("1.tok"), {.val_fraction = 0.25});
  prepare_text_data({corpus_}, dir_.file("2.tok"), {.val_fraction = 0.25});
  EXPECT_EQ(read_bytes(dir_.file("1.tok")), read_bytes(dir_.file("2.tok")));
  EXPECT_EQ(read_bytes(dir_.file("1.val.tok")),
            read_bytes(dir_.file("2.val.tok")));
  // Explicit files in the given order, then a folder; duplicates once.
  prepare_text_data({corpus_ + "/sub/c", corpus_ + "/a_plain.txt", corpus_},
                    dir_.file("3.tok"));
  EXPECT_EQ(
      read_all(dir_.file("3.tok")),
      stream_of({docs_[4], docs_[5], docs_[0], docs_[1], docs_[2], docs_[3]}));
}

TEST_F(PrepareTest, RefusesBadInputs) {
  EXPECT_THROW(prepare_text_data({}, dir_.file("x.tok")), Error);
  try {
    prepare_text_data({dir_.file("missing")}, dir_.file("x.tok"));
    ADD_FAILURE() << "expected a FileError";
  } catch (const FileError& e) {
    EXPECT_NE(std::string(e.what()).find(dir_.file("missing")),
              std::string::npos);
  }
  EXPECT_THROW(
      prepare_text_data({corpus_}, dir_.file("x.tok"), {.val_fraction = 1.0}),
      Error);
  std::filesystem::create_directories(dir_.file("empty"));
  EXPECT_THROW(prepare_text_data({dir_.file("empty")}, dir_.file("x.tok")),
               FileError);
  EXPECT_FALSE(std::filesystem::exists(dir_.file("x.tok")));
  // 1 document, and a val fraction that holds none out.
  EXPECT_THROW(prepare_text_data({corpus_ + "/a_plain.txt"}, dir_.file("x.tok"),
                                 {.val_fraction = 0.5}),
               Error);
  EXPECT_FALSE(std::filesystem::exists(dir_.file("x.tok")));
  EXPECT_FALSE(std::filesystem::exists(dir_.file("x.tok.tmp")));
}

TEST_F(PrepareTest, ReadsJsonLinesAndGzip) {
  const std::string lines =
      "{\"text\": \"Doc one\\n\", \"id\": 1}\n"
      "\n"
      "{\"text\": \"  \"}\n"
      "{\"text\": \"Two \\u00fc \\ud83e\\udd17\", \"body\": \"b\"}\n";
  const std::vector<std::string> docs = {"Doc one\n", "Two \xc3\xbc \xf0\x9f\xa4\x97"};
  write_text(dir_.file("c.jsonl"), lines);
  prepare_text_data({dir_.file("c.jsonl")}, dir_.file("j.tok"));
  EXPECT_EQ(read_all(dir_.file("j.tok")), stream_of(docs));

  gzFile gz = gzopen(dir_.file("c.jsonl.gz").c_str(), "wb");
  ASSERT_NE(gz, nullptr);
  ASSERT_EQ(gzwrite(gz, lines.data(), static_cast<unsigned>(lines.size())),
            static_cast<int>(lines.size()));
  ASSERT_EQ(gzclose(gz), Z_OK);
  // Found in a folder walk although gzip data is binary.
  std::filesystem::create_directories(dir_.file("gz"));
  std::filesystem::rename(dir_.file("c.jsonl.gz"), dir_.file("gz/c.jsonl.gz"));
  prepare_text_data({dir_.file("gz")}, dir_.file("g.tok"));
  EXPECT_EQ(read_all(dir_.file("g.tok")), stream_of(docs));

  write_text(dir_.file("b.jsonl"), "{\"body\": \"B\"}\n");
  prepare_text_data({dir_.file("b.jsonl")}, dir_.file("b.tok"),
                    {.jsonl_field = "body"});
  EXPECT_EQ(read_all(dir_.file("b.tok")), stream_of({"B"}));
}

TEST_F(PrepareTest, RefusesBadJsonLinesNamingTheLine) {
  auto message = [&](const std::string& text, const std::string& field) {
    write_text(dir_.file("bad.jsonl"), text);
    try {
      PrepareOptions o;
      o.jsonl_field = field;
      prepare_text_data({dir_.file("bad.jsonl")}, dir_.file("x.tok"), o);
    } catch (const FileError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message("{\"text\": \"a\"}\nnot json\n", "text").find("line 2 is not valid JSON"),
            std::string::npos);
  EXPECT_NE(message("{\"txt\": \"a\"}\n", "text").find("string field 'text'"),
            std::string::npos);
  EXPECT_NE(message("{\"text\": 3}\n", "text").find("line 1"), std::string::npos);
  write_text(dir_.file("broken.jsonl.gz"), "not gzip at all");
  EXPECT_THROW(prepare_text_data({dir_.file("broken.jsonl.gz")}, dir_.file("x.tok")),
               FileError);
  EXPECT_FALSE(std::filesystem::exists(dir_.file("x.tok")));
}

TEST_F(PrepareTest, ThreadCountDoesNotChangeTheOutput) {
  std::string many;
  for (int i = 0; i < 3000; ++i) many += "document " + std::to_string(i * 7919) + "\n%\n";
  write_text(corpus_ + "/many", many);
  prepare_text_data({corpus_}, dir_.file("t1.tok"), {.val_fraction = 0.1, .threads = 1});
  prepare_text_data({corpus_}, dir_.file("t3.tok"), {.val_fraction = 0.1, .threads = 3});
  EXPECT_EQ(read_bytes(dir_.file("t1.tok")), read_bytes(dir_.file("t3.tok")));
  EXPECT_EQ(read_bytes(dir_.file("t1.val.tok")), read_bytes(dir_.file("t3.val.tok")));
  EXPECT_EQ(read_all(dir_.file("t1.tok")).size() + read_all(dir_.file("t1.val.tok")).size(),
            stream_of(docs_).size() + [&] {
              size_t n = 0;
              for (int i = 0; i < 3000; ++i)
                n += 1 + ("document " + std::to_string(i * 7919) + "\n").size();
              return n;
            }());
}

}  // namespace
}  // namespace viaduct::data
