// `viaduct prepare-data`: text files and JSON Lines corpora -> a viaduct token
// file (the byte tokenizer or a real one), with an optional held-out split.
// The README's demo prepares Debian's fortunes: --input
// /usr/share/games/fortunes --output data/fortunes.tok.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "apps/command.h"
#include "core/check.h"
#include "core/strings.h"
#include "core/log.h"
#include "data/prepare.h"

namespace viaduct::apps {
namespace {

constexpr const char* kUsage =
    "usage: viaduct prepare-data --input PATH [--input PATH ...] --output "
    "FILE\n"
    "                            [--val-fraction X] [--split "
    "auto|whole|fortune]\n"
    "                            [--tokenizer FILE] [--jsonl-field NAME] "
    "[--threads N]\n"
    "\n"
    "Tokenizes text into a viaduct token file (uint32 tokens when the vocab\n"
    "passes 65,535), on every core.\n"
    "  --tokenizer FILE   'byte' (default: bytes + <|endoftext|> = 256 before\n"
    "                     each document) or a Hugging Face tokenizer.json (or\n"
    "                     a folder holding one): byte-level BPE such as GPT-2's\n"
    "                     and llama-3's, or a tiktoken file named after its\n"
    "                     encoding (cl100k_base.tiktoken, o200k_base, ...),\n"
    "                     or a SentencePiece model file (.model, BPE or\n"
    "                     unigram, as llama-2 and Mistral ship it);\n"
    "                     documents get the post-processor's BOS/EOS, or the\n"
    "                     end-of-text token before each\n"
    "  --jsonl-field NAME the field of each .jsonl / .jsonl.gz line that holds\n"
    "                     the document; default text\n"
    "  --threads N        encoding threads; default every core\n"
    "  --input PATH       a text file or a folder (walked recursively, "
    "sorted,\n"
    "                     binary files skipped); repeatable\n"
    "  --output FILE      the token file, written atomically\n"
    "  --val-fraction X   hold out this share of documents (spread evenly)\n"
    "                     in <stem>.val<.ext>; default 0\n"
    "  --split MODE       auto (default: fortune files split at '%' lines,\n"
    "                     other files are one document), whole, fortune\n";

double parse_fraction(const std::string& s) {
  const auto v = parse_finite_number(s);
  VIADUCT_CHECK_T(ConfigError, v.has_value(), "--val-fraction: '", s, "' is not a finite number");
  return *v;
}

data::DocumentSplit parse_split(const std::string& s) {
  if (s == "auto") return data::DocumentSplit::kAuto;
  if (s == "whole") return data::DocumentSplit::kWholeFile;
  if (s == "fortune") return data::DocumentSplit::kFortune;
  throw ConfigError(
      str("--split: unknown mode '", s, "' (expected auto, whole or fortune)"));
}

int prepare_data_main(int argc, char** argv) {
  std::vector<std::string> inputs;
  std::string output;
  data::PrepareOptions options;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    static const std::vector<std::string> kValued{"--input",     "--output",      "--val-fraction",
                                                  "--split",     "--tokenizer",   "--jsonl-field",
                                                  "--threads"};
    const auto opt = valued_option(argc, argv, i, kValued, "prepare-data", kUsage);
    if (!opt) return 2;
    const std::string &name = opt->name, &value = opt->value;
    if (name == "--input") {
      inputs.push_back(value);
    } else if (name == "--output") {
      output = value;
    } else if (name == "--val-fraction") {
      options.val_fraction = parse_fraction(value);
    } else if (name == "--tokenizer") {
      options.tokenizer = value;
    } else if (name == "--jsonl-field") {
      options.jsonl_field = value;
    } else if (name == "--threads") {
      char* end = nullptr;
      long v = std::strtol(value.c_str(), &end, 10);
      VIADUCT_CHECK_T(ConfigError,
                      !value.empty() && *end == '\0' && v >= 1 && v <= 4096,
                      "--threads: '", value, "' is not a count in [1, 4096]");
      options.threads = static_cast<int>(v);
    } else {
      options.split = parse_split(value);
    }
  }
  if (inputs.empty() || output.empty()) {
    std::fprintf(stderr,
                 "viaduct prepare-data: --input and --output are "
                 "required\n\n%s",
                 kUsage);
    return 2;
  }

  log::info("prepare-data: reading ", inputs.size(), " input(s) into ", output);
  options.progress = true;
  data::PrepareStats s = data::prepare_text_data(inputs, output, options);
  const int64_t tokens = s.train_tokens + s.val_tokens;
  const double seconds = std::max(s.seconds, 1e-9);
  log::info("prepare-data: tokenizer ", s.tokenizer, " (vocab ", s.vocab_size,
            "): ", s.files, " files, ", s.documents, " documents, ",
            s.bytes_read, " text bytes, ", tokens, " tokens, ",
            static_cast<double>(tokens) /
                static_cast<double>(std::max<int64_t>(s.bytes_read, 1)),
            " tokens per byte");
  log::info("prepare-data: ", seconds, " s, ",
            static_cast<double>(s.bytes_read) / 1e6 / seconds, " MB/s, ",
            static_cast<int64_t>(static_cast<double>(s.documents) / seconds),
            " documents/s");
  log::info("prepare-data: train: ", s.train_documents, " documents, ",
            s.train_tokens, " tokens -> ", s.train_path);
  if (!s.val_path.empty()) {
    log::info("prepare-data: val:   ", s.val_documents, " documents, ",
              s.val_tokens, " tokens -> ", s.val_path);
  }
  log::info("prepare-data: ", s.bytes_written, " bytes written");
  return 0;
}

}  // namespace

VIADUCT_COMMAND("prepare-data",
                "text / JSONL -> token file (byte or HF tokenizer, val split)",
                prepare_data_main);

}  // namespace viaduct::apps
