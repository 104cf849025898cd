// `viaduct prepare-data`: text files -> a viaduct token file (byte tokenizer),
// with an optional held-out split. The README's demo prepares Debian's
// fortunes: --input /usr/share/games/fortunes --output data/fortunes.tok.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "apps/command.h"
#include "core/check.h"
#include "core/log.h"
#include "data/prepare.h"

namespace viaduct::apps {
namespace {

constexpr const char* kUsage =
    "usage: viaduct prepare-data --input PATH [--input PATH ...] --output "
    "FILE\n"
    "                            [--val-fraction X] [--split "
    "auto|whole|fortune]\n"
    "\n"
    "Tokenizes text with the built-in byte tokenizer (vocab 257: bytes +\n"
    "<|endoftext|> = 256 before each document) into a viaduct token file.\n"
    "  --input PATH       a text file or a folder (walked recursively, "
    "sorted,\n"
    "                     binary files skipped); repeatable\n"
    "  --output FILE      the token file, written atomically\n"
    "  --val-fraction X   hold out this share of documents (spread evenly)\n"
    "                     in <stem>.val<.ext>; default 0\n"
    "  --split MODE       auto (default: fortune files split at '%' lines,\n"
    "                     other files are one document), whole, fortune\n";

double parse_fraction(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  VIADUCT_CHECK_T(ConfigError, !s.empty() && end != nullptr && *end == '\0',
                  "--val-fraction: '", s, "' is not a number");
  return v;
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
    std::string name = arg;
    std::string value;
    bool has_value = false;
    if (auto eq = arg.find('=');
        arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      has_value = true;
    }
    if (name != "--input" && name != "--output" && name != "--val-fraction" &&
        name != "--split") {
      std::fprintf(stderr, "viaduct prepare-data: unknown argument '%s'\n\n%s",
                   arg.c_str(), kUsage);
      return 2;
    }
    if (!has_value) {
      VIADUCT_CHECK_T(ConfigError, i + 1 < argc, name, " needs a value");
      value = argv[++i];
    }
    if (name == "--input") {
      inputs.push_back(value);
    } else if (name == "--output") {
      output = value;
    } else if (name == "--val-fraction") {
      options.val_fraction = parse_fraction(value);
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
  data::PrepareStats s = data::prepare_text_data(inputs, output, options);
  log::info("prepare-data: ", s.files, " files, ", s.documents, " documents, ",
            s.bytes_read, " text bytes");
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
                "text files -> token file (byte tokenizer, optional val split)",
                prepare_data_main);

}  // namespace viaduct::apps
