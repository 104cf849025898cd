// The schema's numeric ranges and where a value came from, in process.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "config/config.h"
#include "core/check.h"

namespace viaduct {
namespace {

std::string error_of(const std::string& toml, const std::vector<std::string>& overrides = {}) {
  try {
    Config::parse(toml, "job.toml", overrides);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

void expect_has(const std::string& msg, const std::string& part) {
  EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' not in: " << msg;
}

TEST(ConfigRanges, OutOfRangeValuesAreRefusedNamingKeyValueRangeAndSource) {
  struct Case {
    std::string toml;
    std::string key, value, range;
  };
  const std::vector<Case> cases = {
      {"[lr_scheduler]\nmin_lr_factor = -1.0\n", "lr_scheduler.min_lr_factor", "-1.0", "[0, 1]"},
      {"[lr_scheduler]\nmin_lr_factor = 5.0\n", "lr_scheduler.min_lr_factor", "5.0", "[0, 1]"},
      {"[optimizer]\nweight_decay = -1.0\n", "optimizer.weight_decay", "-1.0", ">= 0"},
      {"[optimizer]\neps = -1.0\n", "optimizer.eps", "-1.0", "> 0"},
      {"[optimizer]\neps = 0.0\n", "optimizer.eps", "0.0", "> 0"},
      {"[optimizer]\nbeta1 = -0.5\n", "optimizer.beta1", "-0.5", "[0, 1)"},
      {"[optimizer]\nbeta2 = 1.5\n", "optimizer.beta2", "1.5", "[0, 1)"},
      {"[optimizer]\nbeta2 = 1.0\n", "optimizer.beta2", "1.0", "[0, 1)"},
      {"[optimizer]\nlr = -0.001\n", "optimizer.lr", "-0.001", ">= 0"},
      {"[training]\nsteps = 0\n", "training.steps", "0", "> 0"},
      {"[model]\nn_layers = 0\n", "model.n_layers", "0", "> 0"},
      {"[parallelism]\npipeline_parallel_degree = 0\n", "parallelism.pipeline_parallel_degree",
       "0", "> 0"},
      {"[parallelism]\npipeline_parallel_microbatches = -2\n",
       "parallelism.pipeline_parallel_microbatches", "-2", "> 0"},
      {"[data]\neval_batches = -1\n", "data.eval_batches", "-1", ">= 0"},
  };
  for (const auto& c : cases) {
    const auto msg = error_of(c.toml);
    expect_has(msg, c.key + " = " + c.value);
    expect_has(msg, c.range);
    expect_has(msg, "job.toml");
  }
  // nan and inf are no number at all, whatever the key's range.
  expect_has(error_of("", {"optimizer.lr=nan"}),
             "key 'optimizer.lr' in the command line must be a finite number, got nan");
  expect_has(error_of("", {"optimizer.lr=inf"}),
             "key 'optimizer.lr' in the command line must be a finite number, got inf");
  expect_has(error_of("", {"training.max_norm=nan"}),
             "key 'training.max_norm' in the command line must be a finite number, got nan");
}

TEST(ConfigRanges, BoundsThemselvesAreAccepted) {
  EXPECT_NO_THROW(Config::parse(
      "[optimizer]\nbeta1 = 0.0\nbeta2 = 0.0\nweight_decay = 0.0\nlr = 0.0\n"
      "[lr_scheduler]\nmin_lr_factor = 1.0\n",
      "job.toml"));
  EXPECT_NO_THROW(Config::parse("[lr_scheduler]\nmin_lr_factor = 0.0\n", "job.toml"));
}

TEST(ConfigRanges, CommandLineValueIsNamedAsComingFromTheCommandLine) {
  const auto msg = error_of("[optimizer]\nbeta2 = 0.95\n", {"optimizer.beta2=1.5"});
  expect_has(msg, "optimizer.beta2 = 1.5");
  expect_has(msg, "from the command line");
  EXPECT_EQ(msg.find("job.toml"), std::string::npos) << msg;
  // A value from the file keeps the file as its source next to a CLI one.
  const auto cfg = Config::parse("[training]\nsteps = 7\n", "job.toml", {"training.seed=3"});
  EXPECT_EQ(cfg.source("training.steps"), "job.toml");
  EXPECT_EQ(cfg.source("training.seed"), "the command line");
  EXPECT_EQ(cfg.source("training.seq_len"), "the default");
}

TEST(ConfigRanges, AFolderAsConfigIsRefused) {
  try {
    Config::load("configs");
    FAIL() << "a folder loaded as a config";
  } catch (const ConfigError& e) {
    expect_has(e.what(), "'configs' is a folder");
    expect_has(e.what(), "llama_debug.toml");
  }
}

}  // namespace
}  // namespace viaduct
