// The [data] section of the job config: where the token files are and how
// the sampler reads them (see data/token_file.h, data/sampler.h).
#include <string>
#include <vector>

#include "config/config.h"

namespace viaduct {

void add_data_keys(std::vector<ConfigKey>& keys) {
  keys.push_back({"data", "path", ConfigType::kString,
                  std::string("data/fortunes.tok"),
                  "training tokens: a token file or a glob of shards, read "
                  "as one stream (prepare it with `viaduct prepare-data`)"});
  keys.push_back({"data", "val_path", ConfigType::kString, std::string(""),
                  "held-out tokens for eval; empty = <stem>.val<.ext> next "
                  "to data.path when that file exists, else no eval"});
  keys.push_back({"data", "format", ConfigType::kString, std::string("auto"),
                  "token file format: auto (sniff the magic, then .u16/.u32), "
                  "viaduct, llmc, uint16 or uint32"});
  keys.push_back({"data", "shuffle", ConfigType::kBool, false,
                  "visit the windows of each epoch in a permutation drawn "
                  "from (training.seed, epoch); false = in file order"});
  keys.push_back(ConfigKey{"data", "eval_batches", ConfigType::kInt, int64_t{4},
                          "batches per eval, always the first ones of the val "
                          "tokens"}
                    .in(at_least(0)));
}

}  // namespace viaduct
