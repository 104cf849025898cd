// The [data] section of the job config: where the token files are, how the
// sampler reads and blends them (see data/token_file.h, data/sampler.h), and
// the tokenizer they were made with.
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "config/config.h"
#include "config/schema_parts.h"
#include "core/check.h"

namespace viaduct {

void add_data_keys(std::vector<ConfigKey>& keys) {
  keys.push_back(ConfigKey{"data", "path", ConfigType::kString,
                           std::string("data/fortunes.tok"),
                           "training tokens: a token file or a glob of shards, "
                           "read as one stream (prepare it with `viaduct "
                           "prepare-data`); not with data.paths"}
                     .replaced_when_set("data.paths"));
  keys.push_back({"data", "paths", ConfigType::kStringList, StringList{},
                  "a blend of several token sources instead of data.path: "
                  "each entry a token file or a glob (one stream), mixed "
                  "window by window in the shares of data.weights; a source "
                  "that runs out starts its next epoch (it repeats)"});
  keys.push_back({"data", "weights", ConfigType::kFloatList, FloatList{},
                  "one weight > 0 per data.paths entry, normalised to the "
                  "share of training windows each source gives (may be "
                  "omitted for a single entry)"});
  keys.push_back({"data", "val_path", ConfigType::kString, std::string(""),
                  "held-out tokens for eval; empty = <stem>.val<.ext> next "
                  "to data.path when that file exists (for data.paths: those "
                  "of its file entries, read as one stream), else no eval"});
  keys.push_back({"data", "format", ConfigType::kString, std::string("auto"),
                  "token file format: auto (sniff the magic, then .u16/.u32), "
                  "viaduct, llmc, uint16 or uint32"});
  keys.push_back({"data", "shuffle", ConfigType::kBool, false,
                  "visit the windows of each epoch in a permutation drawn "
                  "from (training.seed, source, epoch); false = in file "
                  "order"});
  keys.push_back(ConfigKey{"data", "eval_batches", ConfigType::kInt, int64_t{4},
                          "batches per eval, always the first ones of the val "
                          "tokens"}
                    .in(at_least(0)));
  keys.push_back({"data", "tokenizer", ConfigType::kString, std::string(""),
                  "the tokenizer the token files were made with (the "
                  "tokenizer.json, or a folder holding one, or the .tiktoken "
                  "file given to prepare-data --tokenizer); "
                  "checkpoint.last_save_in_hf copies it, with the "
                  "tokenizer_config.json and special_tokens_map.json beside "
                  "it, into the Hugging Face folder; empty = none"});
}

void validate_data(const Config& c) {
  // The tokenizer file is read at the end of a run (checkpoint.last_save_in_hf)
  // or by the tools; a missing one stops every command at load, not hours in.
  if (const std::string tok = c.get_string("data.tokenizer"); !tok.empty()) {
    namespace fs = std::filesystem;
    std::error_code ec;
    const std::string key = "data.tokenizer (from " + c.source("data.tokenizer") + ")";
    VIADUCT_CHECK_T(ConfigError, fs::exists(tok, ec), key, ": the tokenizer '", tok,
                    "' does not exist");
    if (fs::is_directory(tok, ec)) {
      VIADUCT_CHECK_T(ConfigError, fs::is_regular_file(fs::path(tok) / "tokenizer.json", ec),
                      key, ": the folder '", tok, "' holds no tokenizer.json");
    } else {
      VIADUCT_CHECK_T(ConfigError, fs::is_regular_file(tok, ec), key, ": the tokenizer '", tok,
                      "' is not a file");
    }
  }
  // data.path against data.paths: Config::validate (ConfigKey::replaced_by).
  const auto paths = c.get_string_list("data.paths");
  const auto weights = c.get_float_list("data.weights");
  VIADUCT_CHECK_T(ConfigError, !paths.empty() || weights.empty(),
                  "data.weights (from ", c.source("data.weights"),
                  ") needs data.paths: the weights are the shares of its "
                  "sources");
  for (size_t i = 0; i < paths.size(); ++i) {
    VIADUCT_CHECK_T(ConfigError, !paths[i].empty(), "data.paths[", i,
                    "] (from ", c.source("data.paths"), ") is empty");
  }
  const auto list = [](const auto& values, bool quote) {
    std::string s = "[";
    for (size_t i = 0; i < values.size(); ++i) {
      s += str(i ? ", " : "", quote ? "\"" : "", values[i], quote ? "\"" : "");
    }
    return s + "]";
  };
  VIADUCT_CHECK_T(
      ConfigError,
      weights.size() == paths.size() || (weights.empty() && paths.size() == 1),
      "data.weights = ", list(weights, false), " (from ",
      c.source("data.weights"), ") has ", weights.size(),
      " entries but data.paths = ", list(paths, true), " has ", paths.size(),
      ": give one weight per source (e.g. [", [&] {
        std::string s;
        for (size_t i = 0; i < paths.size(); ++i) s += i ? ", 1" : "1";
        return s;
      }(), "] for equal shares)");
  for (size_t i = 0; i < weights.size(); ++i) {
    VIADUCT_CHECK_T(ConfigError, std::isfinite(weights[i]) && weights[i] > 0,
                    "data.weights[", i, "] = ", weights[i], " (from ",
                    c.source("data.weights"), ", for data.paths[", i, "] '",
                    paths[i], "') must be a number > 0");
  }
  // The shares are the weights over their sum: a sum past double's range
  // would make every share 0.
  double sum = 0;
  for (double w : weights) sum += w;
  VIADUCT_CHECK_T(ConfigError, std::isfinite(sum), "data.weights = ", list(weights, false),
                  " (from ", c.source("data.weights"),
                  ") sum past the largest number: scale them down (only their ratios "
                  "matter)");
}

}  // namespace viaduct
