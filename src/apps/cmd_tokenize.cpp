// `viaduct tokenize`: prints the ids of a text under a tokenizer, for
// checking a tokenizer by hand against another encoder.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "apps/command.h"
#include "core/check.h"
#include "data/text_tokenizer.h"

namespace viaduct::apps {
namespace {

constexpr const char* kUsage =
    "usage: viaduct tokenize --tokenizer FILE [--no-special] [--decode] "
    "[TEXT | -]\n"
    "\n"
    "Prints the token ids of TEXT (or of standard input with '-' or no TEXT),\n"
    "space-separated on one line.\n"
    "  --tokenizer FILE  'byte', a Hugging Face tokenizer.json (or a folder\n"
    "                    holding one), a tiktoken file such as\n"
    "                    cl100k_base.tiktoken, or a SentencePiece model file\n"
    "                    (.model, BPE or unigram)\n"
    "  --no-special      without the post-processor's BOS / EOS tokens\n"
    "  --decode          TEXT is ids (space-separated); print their text\n";

int tokenize_main(int argc, char** argv) {
  std::string tokenizer;
  bool special = true;
  bool decode = false;
  std::vector<std::string> texts;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (arg == "--no-special") {
      special = false;
    } else if (arg == "--decode") {
      decode = true;
    } else if (arg == "--tokenizer") {
      VIADUCT_CHECK_T(ConfigError, i + 1 < argc, "--tokenizer needs a value");
      tokenizer = argv[++i];
    } else if (arg.rfind("--tokenizer=", 0) == 0) {
      tokenizer = arg.substr(12);
    } else if (arg.rfind("--", 0) == 0) {
      std::fprintf(stderr, "viaduct tokenize: unknown argument '%s'\n\n%s",
                   arg.c_str(), kUsage);
      return 2;
    } else {
      texts.push_back(arg);
    }
  }
  if (tokenizer.empty() || texts.size() > 1) {
    std::fprintf(stderr, "viaduct tokenize: %s\n\n%s",
                 tokenizer.empty() ? "--tokenizer is required"
                                   : "give one TEXT (quote it)",
                 kUsage);
    return 2;
  }
  std::string text;
  if (texts.empty() || texts[0] == "-") {
    text.assign(std::istreambuf_iterator<char>(std::cin),
                std::istreambuf_iterator<char>());
  } else {
    text = texts[0];
  }
  auto tok = data::load_tokenizer(tokenizer);
  if (decode) {
    std::vector<int64_t> ids;
    size_t pos = 0;
    while (pos < text.size()) {
      size_t start = text.find_first_not_of(" \t\r\n,", pos);
      if (start == std::string::npos) break;
      size_t end = text.find_first_of(" \t\r\n,", start);
      std::string word = text.substr(start, end - start);
      char* stop = nullptr;
      long long v = std::strtoll(word.c_str(), &stop, 10);
      VIADUCT_CHECK_T(ConfigError, stop != nullptr && *stop == '\0',
                      "tokenize --decode: '", word, "' is not an id");
      ids.push_back(v);
      pos = end;
    }
    std::string out = tok->decode(ids);
    std::fwrite(out.data(), 1, out.size(), stdout);
    std::fputc('\n', stdout);
    return 0;
  }
  std::vector<int64_t> ids = tok->encode(text, special);
  std::string line;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) line += ' ';
    line += std::to_string(ids[i]);
  }
  std::puts(line.c_str());
  return 0;
}

}  // namespace

VIADUCT_COMMAND("tokenize",
                "prints the token ids of a text (byte, tokenizer.json, tiktoken)",
                tokenize_main);

}  // namespace viaduct::apps
