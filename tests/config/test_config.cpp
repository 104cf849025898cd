// Config parsing, overrides, strict keys, aliases and print-back.
#include <gtest/gtest.h>

#include "config/config.h"
#include "core/check.h"

using viaduct::Config;
using viaduct::ConfigError;

namespace {
std::string error_of(const std::string& toml,
                     const std::vector<std::string>& overrides = {}) {
  try {
    Config::parse(toml, "job.toml", overrides);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Config, DefaultsAndFileValues) {
  auto c = Config::parse("[training]\nsteps = 7\nseq_len = 64\n[model]\nfamily = \"gpt2\"\n",
                         "job.toml");
  EXPECT_EQ(c.get_int("training.steps"), 7);
  EXPECT_EQ(c.get_int("training.seq_len"), 64);
  EXPECT_EQ(c.get_string("model.family"), "gpt2");
  EXPECT_EQ(c.get_int("training.local_batch_size"), 8);  // default
  EXPECT_TRUE(c.is_set("training.steps"));
  EXPECT_FALSE(c.is_set("training.local_batch_size"));
  EXPECT_FALSE(c.get_int_opt("model.dim").has_value());
}

TEST(Config, OverridesWinOverFile) {
  auto c = Config::parse("[training]\nsteps = 7\n", "job.toml",
                         {"training.steps=9", "optimizer.lr=0.5",
                          "checkpoint.enable=true", "job.dump_folder=\"x y\""});
  EXPECT_EQ(c.get_int("training.steps"), 9);
  EXPECT_DOUBLE_EQ(c.get_float("optimizer.lr"), 0.5);
  EXPECT_TRUE(c.get_bool("checkpoint.enable"));
  EXPECT_EQ(c.get_string("job.dump_folder"), "x y");
}

TEST(Config, IntegerAcceptedForFloat) {
  auto c = Config::parse("[optimizer]\nlr = 1\n", "job.toml");
  EXPECT_DOUBLE_EQ(c.get_float("optimizer.lr"), 1.0);
}

TEST(Config, UnknownKeyNamesFileAndClosestKey) {
  const auto msg = error_of("[training]\nstpes = 3\n");
  EXPECT_NE(msg.find("training.stpes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("job.toml"), std::string::npos) << msg;
  EXPECT_NE(msg.find("training.steps"), std::string::npos) << msg;
}

TEST(Config, UnknownSectionAndKeyInWrongSection) {
  auto msg = error_of("[optimizer]\nseq_len = 3\n");
  EXPECT_NE(msg.find("training.seq_len"), std::string::npos) << msg;
  msg = error_of("[trainign]\nsteps = 3\n");
  EXPECT_NE(msg.find("training.steps"), std::string::npos) << msg;
}

TEST(Config, UnknownOverrideKey) {
  const auto msg = error_of("", {"optimizer.lrr=3"});
  EXPECT_NE(msg.find("optimizer.lrr"), std::string::npos) << msg;
  EXPECT_NE(msg.find("optimizer.lr"), std::string::npos) << msg;
  EXPECT_NE(msg.find("command line"), std::string::npos) << msg;
}

TEST(Config, WrongTypeNamesKeyAndFile) {
  auto msg = error_of("[training]\nsteps = \"ten\"\n");
  EXPECT_NE(msg.find("training.steps"), std::string::npos) << msg;
  EXPECT_NE(msg.find("integer"), std::string::npos) << msg;
  EXPECT_NE(msg.find("job.toml"), std::string::npos) << msg;
  msg = error_of("", {"training.steps=3.5"});
  EXPECT_NE(msg.find("training.steps"), std::string::npos) << msg;
  msg = error_of("", {"checkpoint.enable=yes"});
  EXPECT_NE(msg.find("checkpoint.enable"), std::string::npos) << msg;
}

TEST(Config, SyntaxErrorNamesLine) {
  const auto msg = error_of("[training]\nsteps = = 3\n");
  EXPECT_NE(msg.find("job.toml"), std::string::npos) << msg;
  EXPECT_NE(msg.find("line 2"), std::string::npos) << msg;
}

TEST(Config, DeprecatedAliasMapsToNewName) {
  auto c = Config::parse("[training]\nbatch_size = 3\n", "job.toml");
  EXPECT_EQ(c.get_int("training.local_batch_size"), 3);
  auto d = Config::parse("", "job.toml", {"training.max_grad_norm=0.5"});
  EXPECT_DOUBLE_EQ(d.get_float("training.max_norm"), 0.5);
}

TEST(Config, AliasAndNewNameTogetherIsAnError) {
  auto msg = error_of("[training]\nbatch_size = 3\nlocal_batch_size = 4\n");
  EXPECT_NE(msg.find("training.batch_size"), std::string::npos) << msg;
  EXPECT_NE(msg.find("training.local_batch_size"), std::string::npos) << msg;
  msg = error_of("", {"training.batch_size=3", "training.local_batch_size=4"});
  EXPECT_NE(msg.find("training.batch_size"), std::string::npos) << msg;
}

TEST(Config, CrossFieldChecksRunAfterOverrides) {
  // A negative value is refused only once the override is applied ...
  auto msg = error_of("[lr_scheduler]\nwarmup_steps = 5\n",
                      {"lr_scheduler.warmup_steps=-1"});
  EXPECT_NE(msg.find("warmup_steps"), std::string::npos) << msg;
  // ... and an override can repair a file that alone would be refused.
  EXPECT_NO_THROW(Config::parse("[training]\ndtype = \"fp8\"\n", "job.toml",
                                {"training.dtype=float32"}));
  // A warmup longer than the run is clamped to it.
  auto c = Config::parse("[lr_scheduler]\nwarmup_steps = 50\n", "job.toml",
                         {"training.steps=10"});
  EXPECT_EQ(c.get_int("lr_scheduler.warmup_steps"), 10);
  msg = error_of("[training]\ndtype = \"fp8\"\n");
  EXPECT_NE(msg.find("training.dtype"), std::string::npos) << msg;
}

// model.attn_res = false for kimi_k3 only: the family registry checks it
// (ModelFamilies.AttnResOffIsKimiK3Only in tests/model).

// exact16 was a kimi_k3 flavor: that spelling still loads, as the exact16
// family, with a warning.
TEST(Config, DeprecatedExact16SpellingMapsToItsFamily) {
  auto c = Config::parse("[model]\nfamily = \"kimi_k3\"\n", "job.toml",
                         {"model.flavor=exact16"});
  EXPECT_EQ(c.get_string("model.family"), "exact16");
  EXPECT_EQ(c.get_string("model.flavor"), "debugmodel");
  auto d = Config::parse("[model]\nfamily = \"kimi_k3\"\nflavor = \"exact16\"\n", "job.toml");
  EXPECT_EQ(d.get_string("model.family"), "exact16");
  EXPECT_EQ(Config::parse(d.to_toml(), "printed").get_string("model.family"), "exact16");
  auto k3 = Config::parse("[model]\nfamily = \"kimi_k3\"\nflavor = \"full\"\n", "job.toml");
  EXPECT_EQ(k3.get_string("model.family"), "kimi_k3");
  EXPECT_EQ(k3.get_string("model.flavor"), "full");
}

TEST(Config, PrintConfigRoundTrips) {
  auto c = Config::parse("[training]\nsteps = 12\n[optimizer]\nlr = 0.00123\n"
                         "[job]\ndump_folder = \"out \\\"q\\\"\"\n",
                         "job.toml", {"model.dim=64"});
  const auto text = c.to_toml();
  auto d = Config::parse(text, "printed");
  EXPECT_EQ(d.to_toml().substr(d.to_toml().find('\n')),
            text.substr(text.find('\n')));
  EXPECT_EQ(d.get_int("training.steps"), 12);
  EXPECT_EQ(d.get_float("optimizer.lr"), 0.00123);
  EXPECT_EQ(d.get_int("model.dim"), 64);
  EXPECT_EQ(d.get_string("job.dump_folder"), "out \"q\"");
}

TEST(Config, CommandLineSplitsOverridesFlagsAndOptions) {
  const char* argv[] = {"train", "--config", "a.toml", "--training.steps=3",
                        "--optimizer.lr", "0.1", "--json", "--svg", "x.svg"};
  auto p = viaduct::parse_command_line(9, const_cast<char**>(argv), 1, {"--svg"});
  EXPECT_EQ(p.config_path, "a.toml");
  ASSERT_EQ(p.overrides.size(), 2u);
  EXPECT_EQ(p.overrides[0], "training.steps=3");
  EXPECT_EQ(p.overrides[1], "optimizer.lr=0.1");
  ASSERT_EQ(p.flags.size(), 1u);
  EXPECT_EQ(p.flags[0], "--json");
  EXPECT_EQ(p.options.at("--svg"), "x.svg");
}

TEST(Config, MissingFileIsAClearError) {
  try {
    Config::load("/nonexistent/job.toml");
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/job.toml"), std::string::npos);
  }
}

// parallelism.attn_res_cache_backward: two names; "deposit" given with the
// whole-stack transport is refused (no store), "whole_stack" is what that
// transport does anyway.
TEST(Config, AttnResCacheBackwardValuesAndTransport) {
  auto c = Config::parse("", "job.toml");
  EXPECT_EQ(c.get_string("parallelism.attn_res_cache_backward"), "deposit");
  EXPECT_NO_THROW(
      Config::parse("", "job.toml", {"parallelism.attn_res_cache_backward=whole_stack"}));
  EXPECT_NO_THROW(Config::parse("", "job.toml", {"parallelism.attn_res_cache=false"}));
  EXPECT_NO_THROW(Config::parse("", "job.toml",
                                {"parallelism.attn_res_cache=false",
                                 "parallelism.attn_res_cache_backward=whole_stack"}));
  auto msg = error_of("", {"parallelism.attn_res_cache_backward=chain"});
  EXPECT_NE(msg.find("parallelism.attn_res_cache_backward"), std::string::npos) << msg;
  EXPECT_NE(msg.find("whole_stack"), std::string::npos) << msg;
  msg = error_of("[parallelism]\nattn_res_cache = false\nattn_res_cache_backward = \"deposit\"\n");
  EXPECT_NE(msg.find("parallelism.attn_res_cache = true"), std::string::npos) << msg;
}

TEST(Config, SpeedKeysDefaultsAndRefusals) {
  auto c = Config::parse("", "job.toml", {});
  EXPECT_TRUE(c.get_bool("model.cuda_kernels"));
  EXPECT_EQ(c.get_int("model.loss_chunk_tokens"), -1);  // auto
  EXPECT_EQ(c.get_int("metrics.profile_step"), 0);      // off
  auto msg = error_of("", {"model.loss_chunk_tokens=-2"});
  EXPECT_NE(msg.find("model.loss_chunk_tokens"), std::string::npos) << msg;
  msg = error_of("[metrics]\nprofile_step = -1\n");
  EXPECT_NE(msg.find("metrics.profile_step"), std::string::npos) << msg;
  EXPECT_NO_THROW(Config::parse("", "job.toml", {"model.loss_chunk_tokens=4096",
                                                 "model.cuda_kernels=false",
                                                 "metrics.profile_step=3"}));
}

TEST(Config, PipelineBalanceValues) {
  // See Note [Split balanced by FLOPs]: "layers" (torchtitan's rule, the
  // default) or "flops"; anything else is refused by name.
  auto c = Config::parse("", "job.toml", {});
  EXPECT_EQ(c.get_string("parallelism.pipeline_parallel_balance"), "layers");
  EXPECT_NO_THROW(Config::parse("", "job.toml", {"parallelism.pipeline_parallel_balance=flops"}));
  const auto msg = error_of("", {"parallelism.pipeline_parallel_balance=time"});
  EXPECT_NE(msg.find("parallelism.pipeline_parallel_balance"), std::string::npos) << msg;
  EXPECT_NE(msg.find("\"time\""), std::string::npos) << msg;
}

TEST(Config, DataBlendKeys) {
  // A TOML list of numbers, or the command line's TOML array or a,b list.
  auto c = Config::parse("[data]\npaths = [\"a.tok\", \"b/*.tok\"]\nweights = [0.7, 3]\n",
                         "job.toml");
  EXPECT_EQ(c.get_string_list("data.paths"), (viaduct::StringList{"a.tok", "b/*.tok"}));
  EXPECT_EQ(c.get_float_list("data.weights"), (viaduct::FloatList{0.7, 3.0}));
  c = Config::parse("", "job.toml", {"data.paths=a.tok,b.tok", "data.weights=0.25,0.75"});
  EXPECT_EQ(c.get_float_list("data.weights"), (viaduct::FloatList{0.25, 0.75}));
  c = Config::parse("", "job.toml", {"data.paths=[\"a.tok\"]", "data.weights=[2]"});
  EXPECT_EQ(c.get_float_list("data.weights"), (viaduct::FloatList{2.0}));
  // One entry needs no weight.
  EXPECT_NO_THROW(Config::parse("", "job.toml", {"data.paths=a.tok"}));

  // The printed config parses back: data.path, not in effect, is a comment.
  const auto text = c.to_toml();
  EXPECT_NE(text.find("# path = \"data/fortunes.tok\"  (not in effect: data.paths is set)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("weights = [2.0]"), std::string::npos) << text;
  const auto back = Config::parse(text, "printed");
  EXPECT_EQ(back.get_float_list("data.weights"), (viaduct::FloatList{2.0}));
  EXPECT_FALSE(back.is_set("data.path"));
}

TEST(Config, DataBlendErrorsNameTheKeys) {
  // data.path and data.paths together: in one file, on the command line, or
  // the file's data.paths against --data.path.
  auto msg = error_of("[data]\npath = \"x.tok\"\npaths = [\"a.tok\"]\n");
  EXPECT_NE(msg.find("data.path = \"x.tok\" (from job.toml) and data.paths = [\"a.tok\"] "
                     "(from job.toml) are mutually exclusive"),
            std::string::npos)
      << msg;
  msg = error_of("", {"data.path=x.tok", "data.paths=a.tok,b.tok", "data.weights=1,1"});
  EXPECT_NE(msg.find("data.path = \"x.tok\" (from the command line)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("data.paths = [\"a.tok\", \"b.tok\"] (from the command line)"),
            std::string::npos)
      << msg;
  msg = error_of("[data]\npaths = [\"a.tok\"]\n", {"data.path=x.tok"});
  EXPECT_NE(msg.find("mutually exclusive"), std::string::npos) << msg;
  // --data.paths replaces a config file's data.path (every example config
  // sets one).
  const auto c = Config::parse("[data]\npath = \"x.tok\"\n", "job.toml",
                               {"data.paths=a.tok,b.tok", "data.weights=1,1"});
  EXPECT_FALSE(c.is_set("data.path"));
  EXPECT_EQ(c.get_string_list("data.paths"), (viaduct::StringList{"a.tok", "b.tok"}));
  // Weights that do not match the paths in length.
  msg = error_of("[data]\npaths = [\"a.tok\", \"b.tok\"]\nweights = [0.7]\n");
  EXPECT_NE(msg.find("data.weights = [0.7] (from job.toml) has 1 entries but data.paths = "
                     "[\"a.tok\", \"b.tok\"] has 2"),
            std::string::npos)
      << msg;
  msg = error_of("[data]\npaths = [\"a.tok\", \"b.tok\"]\n");
  EXPECT_NE(msg.find("[1, 1] for equal shares"), std::string::npos) << msg;
  // A weight <= 0, named with its path.
  msg = error_of("[data]\npaths = [\"a.tok\", \"b.tok\"]\nweights = [0.7, -0.3]\n");
  EXPECT_NE(msg.find("data.weights[1] = -0.3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'b.tok'"), std::string::npos) << msg;
  EXPECT_NE(error_of("[data]\npaths = [\"a.tok\", \"b.tok\"]\nweights = [0, 1]\n"), "");
  EXPECT_NE(error_of("[data]\npaths = [\"a.tok\", \"b.tok\"]\nweights = [nan, 1]\n"), "");
  // Weights without paths, an empty path, a non-number weight.
  msg = error_of("[data]\nweights = [1.0]\n");
  EXPECT_NE(msg.find("data.weights (from job.toml) needs data.paths"), std::string::npos) << msg;
  msg = error_of("[data]\npaths = [\"a.tok\", \"\"]\nweights = [1, 1]\n");
  EXPECT_NE(msg.find("data.paths[1] (from job.toml) is empty"), std::string::npos) << msg;
  msg = error_of("", {"data.weights=0.5,x"});
  EXPECT_NE(msg.find("data.weights"), std::string::npos) << msg;
  msg = error_of("[data]\nweights = [\"0.5\"]\n");
  EXPECT_NE(msg.find("a list of numbers"), std::string::npos) << msg;
}
