// HF checkpoints: the q/k row permutation against a hand-written
// rotate-half RoPE (transformers' form) and viaduct's own ops::rope (the
// layout: see Note [HF rotary layout]); llama3 RoPE scaling against its
// closed form; the families' StateDictAdapters: config.json from a config
// and back into the same config, viaduct -> HF folder ->
// viaduct bitwise for llama (GQA, untied, sharded) and gpt2 (tied, padded
// vocab); bad folders and shape mismatches refused naming the field; a
// family without an HF layout refused naming those with one.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <filesystem>
#include <fstream>

#include "checkpoint/hf.h"
#include "config/job_config.h"
#include "core/check.h"
#include "core/file_io.h"
#include "data/temp_dir.h"
#include "model/family.h"
#include "model/hf_adapter.h"
#include "model/layers.h"
#include "model/rope_scaling.h"
#include "ops/rope.h"

namespace viaduct::checkpoint {
namespace {

namespace fs = std::filesystem;
using data::testing::TempDir;
using viaduct::Attention;
using viaduct::AttentionOptions;
using viaduct::ChainSpec;
using viaduct::JobConfig;
using viaduct::RopeScaling;
using viaduct::gpt2_hf_adapter;
using viaduct::llama_hf_adapter;

// Meta's interleaved RoPE on x [T, H, hd] (fp64): pairs (2i, 2i+1).
at::Tensor rope_interleaved(const at::Tensor& x, double theta) {
  const int64_t T = x.size(0), hd = x.size(2);
  at::Tensor out = x.clone();
  auto xa = x.accessor<double, 3>();
  auto oa = out.accessor<double, 3>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < x.size(1); ++h)
      for (int64_t i = 0; i < hd / 2; ++i) {
        double ang = t * std::pow(theta, -2.0 * i / hd);
        double c = std::cos(ang), s = std::sin(ang);
        double a = xa[t][h][2 * i], b = xa[t][h][2 * i + 1];
        oa[t][h][2 * i] = a * c - b * s;
        oa[t][h][2 * i + 1] = a * s + b * c;
      }
  return out;
}

// transformers' llama RoPE: x * cos + rotate_half(x) * sin, with the
// frequencies repeated over the two halves.
at::Tensor rope_rotate_half(const at::Tensor& x, double theta) {
  const int64_t T = x.size(0), hd = x.size(2);
  at::Tensor out = x.clone();
  auto xa = x.accessor<double, 3>();
  auto oa = out.accessor<double, 3>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < x.size(1); ++h)
      for (int64_t j = 0; j < hd; ++j) {
        int64_t i = j % (hd / 2);
        double ang = t * std::pow(theta, -2.0 * i / hd);
        double rot = j < hd / 2 ? -xa[t][h][j + hd / 2] : xa[t][h][j - hd / 2];
        oa[t][h][j] = xa[t][h][j] * std::cos(ang) + rot * std::sin(ang);
      }
  return out;
}

TEST(HfRotaryLayout, PermutedRowsUnderRotateHalfEqualInterleaved) {
  at::manual_seed(0);
  const int64_t T = 7, H = 3, hd = 8, D = 16;
  const double theta = 500000.0;
  at::Tensor w = at::randn({H * hd, D}, at::kDouble);
  at::Tensor x = at::randn({T, D}, at::kDouble);
  at::Tensor q_v = rope_interleaved(at::matmul(x, w.t()).reshape({T, H, hd}), theta);
  at::Tensor w_hf = interleaved_to_half_rows(w, H);
  at::Tensor q_h = rope_rotate_half(at::matmul(x, w_hf.t()).reshape({T, H, hd}), theta);
  // HF feature j < hd/2 is viaduct's 2j; hd/2 + j is 2j + 1.
  at::Tensor expect = at::cat({q_v.slice(2, 0, hd, 2), q_v.slice(2, 1, hd, 2)}, 2);
  EXPECT_LT((q_h - expect).abs().max().item<double>(), 1e-12);
  // Scores between two positions are the same on both sides.
  EXPECT_NEAR((q_h[2] * q_h[5]).sum().item<double>(),
              (q_v[2] * q_v[5]).sum().item<double>(), 1e-10);
  EXPECT_TRUE(at::equal(half_to_interleaved_rows(w_hf, H), w));
  at::Tensor b = at::randn({H * hd}, at::kDouble);
  EXPECT_TRUE(at::equal(half_to_interleaved_rows(interleaved_to_half_rows(b, H), H), b));
}

TEST(HfRotaryLayout, ViaductRopeIsTheInterleavedForm) {
  at::manual_seed(1);
  const int64_t T = 6, H = 2, hd = 8;
  at::Tensor x = at::randn({1, T, H, hd}, at::kDouble);
  auto tables = ops::make_rope_tables(hd, 16, 10000.0);
  at::Tensor got = ops::rope(x, tables, ops::KernelOptions{});
  EXPECT_LT((got[0] - rope_interleaved(x[0], 10000.0)).abs().max().item<double>(), 1e-6);
}

// transformers' _compute_llama3_parameters, frequency by frequency.
double llama3_frequency(int64_t i, int64_t hd, double theta, const RopeScaling& s, int* regime) {
  const double f = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
  const double wavelen = 2 * M_PI / f;
  const double L = static_cast<double>(s.original_max_seq_len);
  if (wavelen < L / s.high_freq_factor) {
    *regime = 0;
    return f;
  }
  if (wavelen > L / s.low_freq_factor) {
    *regime = 2;
    return f / s.factor;
  }
  *regime = 1;
  const double smooth = (L / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  return (1 - smooth) * f / s.factor + smooth * f;
}

TEST(RopeScaling, Llama3FrequenciesMatchTheClosedForm) {
  const RopeScaling s{32.0, 1.0, 4.0, 8192};  // llama-3.2
  const int64_t hd = 64;
  const double theta = 500000.0;
  at::Tensor got = rope_frequencies(hd, theta, s);
  ASSERT_EQ(got.numel(), hd / 2);
  int seen[3] = {0, 0, 0};
  for (int64_t i = 0; i < hd / 2; ++i) {
    int regime = 0;
    const double reference = llama3_frequency(i, hd, theta, s, &regime);
    ++seen[regime];
    EXPECT_NEAR(got[i].item<double>(), reference, 1e-13 * reference) << "frequency " << i;
  }
  EXPECT_GT(seen[0], 0);
  EXPECT_GT(seen[1], 0);
  EXPECT_GT(seen[2], 0);
  auto tables = make_scaled_rope_tables(hd, 100, theta, s);
  EXPECT_NEAR(tables.cos[77][5].item<double>(), std::cos(77 * got[5].item<double>()), 1e-12);
  EXPECT_NEAR(tables.sin[77][30].item<double>(), std::sin(77 * got[30].item<double>()), 1e-12);
}

TEST(RopeScaling, OffGivesTheUnscaledTablesAndAttentionUsesTheScaledOnes) {
  auto plain = ops::make_rope_tables(16, 32, 10000.0);
  auto off = make_scaled_rope_tables(16, 32, 10000.0, RopeScaling{});
  EXPECT_TRUE(at::equal(plain.cos, off.cos));
  EXPECT_TRUE(at::equal(plain.sin, off.sin));
  AttentionOptions o;
  o.dim = 32;
  o.n_heads = 2;
  o.n_kv_heads = 2;
  o.max_seq_len = 32;
  o.rope_theta = 10000.0;
  o.rope_scaling = RopeScaling{8.0, 1.0, 4.0, 16};
  Attention a(o);
  auto scaled = make_scaled_rope_tables(16, 32, 10000.0, o.rope_scaling);
  bool found = false;
  for (const auto& b : a->named_buffers()) {
    if (b.key() == "rope_cos") {
      found = true;
      EXPECT_TRUE(at::equal(b.value(), scaled.cos));
      EXPECT_FALSE(at::equal(b.value(), plain.cos));
    }
  }
  EXPECT_TRUE(found);
}

// The value `key` has in `overrides` (from_hf_config's "key=value").
std::string value_of(const std::vector<std::string>& overrides, const std::string& key) {
  for (const auto& o : overrides) {
    if (o.rfind(key + "=", 0) == 0) return o.substr(key.size() + 1);
  }
  ADD_FAILURE() << key << " is not among the overrides";
  return "";
}

TEST(HfCheckpoint, Llama3RopeScalingGoesThroughConfigJson) {
  ChainSpec s;
  s.family = "llama";
  s.n_layers = 2;
  s.dim = 32;
  s.n_heads = 4;
  s.n_kv_heads = 2;
  s.vocab_size = 300;
  s.ffn_hidden = 48;
  s.max_seq_len = 131072;
  s.rope_theta = 500000.0;
  s.rope_scaling.factor = 32.0;
  s.rope_scaling.original_max_seq_len = 8192;
  const auto adapter = llama_hf_adapter(s);
  nlohmann::json c = adapter->to_hf_config("bfloat16");
  EXPECT_EQ(c["rope_scaling"]["rope_type"], "llama3");
  const auto back = adapter->from_hf_config(c, "src");
  EXPECT_EQ(std::stod(value_of(back, "model.rope_scaling_factor")), 32.0);
  EXPECT_EQ(std::stod(value_of(back, "model.rope_scaling_low_freq_factor")), 1.0);
  EXPECT_EQ(std::stod(value_of(back, "model.rope_scaling_high_freq_factor")), 4.0);
  EXPECT_EQ(value_of(back, "model.rope_scaling_original_max_seq_len"), "8192");
  EXPECT_NO_THROW(adapter->check_hf_config(c, "src"));
  // Newer transformers: theta and scaling in rope_parameters.
  nlohmann::json c5 = c;
  c5.erase("rope_theta");
  c5.erase("rope_scaling");
  c5["rope_parameters"] = c["rope_scaling"];
  c5["rope_parameters"]["rope_theta"] = 500000.0;
  const auto back5 = adapter->from_hf_config(c5, "src");
  EXPECT_EQ(std::stod(value_of(back5, "model.rope_theta")), 500000.0);
  EXPECT_EQ(std::stod(value_of(back5, "model.rope_scaling_factor")), 32.0);
  EXPECT_NO_THROW(adapter->check_hf_config(c5, "src"));
  c5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  EXPECT_EQ(std::stod(value_of(adapter->from_hf_config(c5, "src"), "model.rope_scaling_factor")),
            0.0);
  EXPECT_EQ(std::stod(value_of(adapter->from_hf_config(c5, "src"), "model.rope_theta")), 10000.0);
  ChainSpec unscaled = s;
  unscaled.rope_scaling.factor = 0;
  std::string msg;
  try {
    llama_hf_adapter(unscaled)->check_hf_config(c, "src");
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("rope_scaling.factor = 32 but the viaduct config has "
                     "model.rope_scaling_factor = 0"),
            std::string::npos)
      << msg;
}

// config.json written from a config reads back into overrides that build
// the same model: the same config.json, every field both ways.
TEST(HfCheckpoint, ConfigJsonReadsBackIntoTheSameConfig) {
  const std::vector<std::vector<std::string>> configs = {
      {"model.family=llama", "model.n_layers=3", "model.dim=48", "model.n_heads=6",
       "model.n_kv_heads=2", "model.vocab_size=301", "model.ffn_hidden_dim=80",
       "model.max_seq_len=4096", "model.norm_eps=1e-6", "model.rope_theta=500000",
       "model.rope_scaling_factor=8", "model.rope_scaling_low_freq_factor=1.5",
       "model.rope_scaling_high_freq_factor=3.25",
       "model.rope_scaling_original_max_seq_len=2048", "model.tie_embeddings=true"},
      {"model.family=llama", "model.flavor=8B", "training.seq_len=128"},
      {"model.family=gpt2", "model.n_layers=3", "model.dim=48", "model.n_heads=3",
       "model.vocab_size=333", "model.ffn_hidden_dim=100", "model.max_seq_len=256",
       "model.norm_eps=0.00001", "model.tie_embeddings=false"},
      {"model.family=gpt2", "model.flavor=124M"}};
  for (const auto& o : configs) {
    const auto adapter = viaduct::state_dict_adapter(JobConfig::parse("", "job.toml", o));
    const nlohmann::json c = adapter->to_hf_config("float32");
    const auto back = adapter->from_hf_config(c, "hf");
    const auto again = viaduct::state_dict_adapter(JobConfig::parse("", "config.json", back));
    EXPECT_EQ(again->to_hf_config("float32"), c) << o[0] << " " << o[1];
    EXPECT_NO_THROW(again->check_hf_config(c, "hf"));
  }
}

TEST(HfCheckpoint, AFamilyWithoutAnHfLayoutIsRefusedNamingThoseWithOne) {
  for (const std::string family : {"kimi_k3", "exact16"}) {
    std::string msg;
    try {
      viaduct::state_dict_adapter(JobConfig::parse("", "job.toml", {"model.family=" + family}));
    } catch (const ConfigError& e) {
      msg = e.what();
    }
    EXPECT_EQ(msg, "model.family '" + family + "' has no Hugging Face layout (llama, gpt2)");
  }
}

ChainSpec llama_shape() {
  ChainSpec s;
  s.family = "llama";
  s.n_layers = 2;
  s.dim = 32;
  s.n_heads = 4;
  s.n_kv_heads = 2;
  s.vocab_size = 300;
  s.ffn_hidden = 48;
  s.max_seq_len = 64;
  s.norm_eps = 1e-5;
  s.rope_theta = 10000.0;
  s.tie_embeddings = false;
  return s;
}

ChainSpec gpt2_shape() {
  ChainSpec s;
  s.family = "gpt2";
  s.n_layers = 2;
  s.dim = 32;
  s.n_heads = 4;
  s.n_kv_heads = 4;
  s.vocab_size = 320;
  s.ffn_hidden = 128;
  s.max_seq_len = 64;
  s.tie_embeddings = true;
  return s;
}

TensorMap random_llama(const ChainSpec& s) {
  const int64_t D = s.dim, kv = s.n_kv_heads * (D / s.n_heads), F = s.ffn_hidden;
  TensorMap m;
  m["tok_embeddings.weight"] = at::randn({s.vocab_size, D});
  for (int64_t i = 0; i < s.n_layers; ++i) {
    std::string a = "layers." + std::to_string(i) + ".";
    m[a + "attention.wq.weight"] = at::randn({D, D});
    m[a + "attention.wk.weight"] = at::randn({kv, D});
    m[a + "attention.wv.weight"] = at::randn({kv, D});
    m[a + "attention.wo.weight"] = at::randn({D, D});
    m[a + "feed_forward.w1.weight"] = at::randn({F, D});
    m[a + "feed_forward.w2.weight"] = at::randn({D, F});
    m[a + "feed_forward.w3.weight"] = at::randn({F, D});
    m[a + "attention_norm.weight"] = at::randn({D});
    m[a + "ffn_norm.weight"] = at::randn({D});
  }
  m["norm.weight"] = at::randn({D});
  m["lm_head.weight"] = at::randn({s.vocab_size, D});
  return m;
}

TensorMap random_gpt2(const ChainSpec& s) {
  const int64_t D = s.dim, F = s.ffn_hidden;
  TensorMap m;
  m["tok_embeddings.weight"] = at::randn({s.vocab_size, D});
  m["pos_embeddings.weight"] = at::randn({s.max_seq_len, D});
  for (int64_t i = 0; i < s.n_layers; ++i) {
    std::string a = "layers." + std::to_string(i) + ".";
    for (const char* n : {"wq", "wk", "wv", "wo"}) {
      m[a + "attention." + n + ".weight"] = at::randn({D, D});
      m[a + "attention." + n + ".bias"] = at::randn({D});
    }
    m[a + "feed_forward.w1.weight"] = at::randn({F, D});
    m[a + "feed_forward.w1.bias"] = at::randn({F});
    m[a + "feed_forward.w2.weight"] = at::randn({D, F});
    m[a + "feed_forward.w2.bias"] = at::randn({D});
    for (const char* n : {"attention_norm", "ffn_norm"}) {
      m[a + n + ".weight"] = at::randn({D});
      m[a + n + ".bias"] = at::randn({D});
    }
  }
  m["norm.weight"] = at::randn({D});
  m["norm.bias"] = at::randn({D});
  return m;
}

void expect_bitwise(const TensorMap& a, const TensorMap& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_EQ(t.scalar_type(), b.at(name).scalar_type()) << name;
    EXPECT_TRUE(at::equal(t, b.at(name))) << name << " differs";
  }
}

TEST(HfCheckpoint, LlamaRoundTripIsBitwiseThroughShards) {
  at::manual_seed(2);
  TempDir dir;
  const auto adapter = llama_hf_adapter(llama_shape());
  TensorMap v = random_llama(llama_shape());
  HfWriteOptions o;
  o.max_shard_bytes = 40000;  // several shards
  fs::path out = dir.path() / "hf";
  write_hf_folder(out, v, *adapter, o);
  EXPECT_TRUE(fs::exists(out / "model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(out / "model-00001-of-00003.safetensors") ||
              fs::exists(out / "model-00001-of-00004.safetensors") ||
              fs::exists(out / "model-00001-of-00002.safetensors"));
  HfFolder hf = read_hf_folder(out);
  EXPECT_EQ(hf.config["architectures"][0], "LlamaForCausalLM");
  EXPECT_NO_THROW(adapter->check_hf_config(hf.config, "test"));
  EXPECT_EQ(hf.tensors.size(), v.size());
  // q and k are permuted in the file, v is not.
  EXPECT_TRUE(at::equal(hf.tensors.at("model.layers.1.self_attn.k_proj.weight"),
                        interleaved_to_half_rows(v.at("layers.1.attention.wk.weight"), 2)));
  EXPECT_FALSE(at::equal(hf.tensors.at("model.layers.1.self_attn.q_proj.weight"),
                         v.at("layers.1.attention.wq.weight")));
  expect_bitwise(v, adapter->from_hf(hf.tensors, hf.config, "test"));
  expect_bitwise(v, read_hf_model(out, *adapter));
}

TEST(HfCheckpoint, Gpt2RoundTripIsBitwiseWithTiedHead) {
  at::manual_seed(3);
  TempDir dir;
  const auto adapter = gpt2_hf_adapter(gpt2_shape());
  TensorMap v = random_gpt2(gpt2_shape());
  fs::path out = dir.path() / "hf";
  write_hf_folder(out, v, *adapter, {});
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
  HfFolder hf = read_hf_folder(out);
  EXPECT_EQ(hf.config["architectures"][0], "GPT2LMHeadModel");
  EXPECT_FALSE(hf.tensors.count("lm_head.weight"));
  // Conv1D: c_attn is [D, 3D] with q first.
  EXPECT_TRUE(at::equal(hf.tensors.at("transformer.h.0.attn.c_attn.weight").slice(1, 0, 32),
                        v.at("layers.0.attention.wq.weight").t()));
  expect_bitwise(v, adapter->from_hf(hf.tensors, hf.config, "test"));
  expect_bitwise(v, read_hf_model(out, *adapter));
}

TEST(HfCheckpoint, Gpt2SmallerHfVocabIsPaddedWithZeros) {
  at::manual_seed(4);
  const auto adapter = gpt2_hf_adapter(gpt2_shape());
  TensorMap v = random_gpt2(gpt2_shape());
  TensorMap hf = adapter->to_hf(v);
  // Without the "transformer." prefix, as GPT2Model saves, and 257 rows.
  TensorMap bare;
  for (auto& [n, t] : hf) bare[n.substr(12)] = t;
  bare["wte.weight"] = hf.at("transformer.wte.weight").slice(0, 0, 257).clone();
  bare["h.0.attn.bias"] = at::ones({1, 1, 64, 64});  // an old mask buffer
  nlohmann::json config = adapter->to_hf_config("float32");
  config["vocab_size"] = 257;
  EXPECT_NO_THROW(adapter->check_hf_config(config, "test"));
  TensorMap back = adapter->from_hf(bare, config, "test");
  EXPECT_TRUE(at::equal(back.at("tok_embeddings.weight").slice(0, 0, 257),
                        v.at("tok_embeddings.weight").slice(0, 0, 257)));
  EXPECT_EQ(back.at("tok_embeddings.weight").slice(0, 257).abs().sum().item<float>(), 0.0f);
}

TEST(HfCheckpoint, Bf16ExportRoundsOnce) {
  at::manual_seed(5);
  TempDir dir;
  const auto adapter = llama_hf_adapter(llama_shape());
  TensorMap v = random_llama(llama_shape());
  HfWriteOptions o;
  o.dtype = at::kBFloat16;
  write_hf_folder(dir.path() / "hf", v, *adapter, o);
  HfFolder hf = read_hf_folder(dir.path() / "hf");
  EXPECT_EQ(hf.config["torch_dtype"], "bfloat16");
  EXPECT_EQ(hf.tensors.at("model.norm.weight").scalar_type(), at::kBFloat16);
  TensorMap back = adapter->from_hf(hf.tensors, hf.config, "test");
  for (const auto& [n, t] : v) {
    EXPECT_TRUE(at::equal(back.at(n), t.to(at::kBFloat16).to(at::kFloat))) << n;
  }
}

template <typename E, typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

// Each field both layouts share, changed alone in the viaduct config, is
// refused naming config.json's field and the config's key with both values;
// a smaller HF vocabulary is taken (padded rows), and llama takes any
// max_position_embeddings (its RoPE has no table of positions).
TEST(HfCheckpoint, EachSharedFieldThatDiffersIsNamed) {
  struct Case {
    const char* hf_field;
    const char* key;
    std::function<void(ChainSpec&)> change;
    std::string hf_value, viaduct_value;
  };
  auto cases = [](bool gpt2) {
    return std::vector<Case>{
        {gpt2 ? "n_layer" : "num_hidden_layers", "model.n_layers",
         [](ChainSpec& s) { s.n_layers = 3; }, "2", "3"},
        {gpt2 ? "n_embd" : "hidden_size", "model.dim", [](ChainSpec& s) { s.dim = 64; }, "32",
         "64"},
        {gpt2 ? "n_head" : "num_attention_heads", "model.n_heads",
         [](ChainSpec& s) { s.n_heads = 8; }, "4", "8"},
        {gpt2 ? "n_inner" : "intermediate_size", "model.ffn_hidden_dim",
         [](ChainSpec& s) { s.ffn_hidden = 96; }, gpt2 ? "128" : "48", "96"},
        {"vocab_size", "model.vocab_size (at least as large)",
         [](ChainSpec& s) { s.vocab_size = 256; }, gpt2 ? "320" : "300", "256"},
        {gpt2 ? "layer_norm_epsilon" : "rms_norm_eps", "model.norm_eps",
         [](ChainSpec& s) { s.norm_eps = 1e-3; }, "1e-05", "0.001"},
        {"tie_word_embeddings", "model.tie_embeddings",
         [](ChainSpec& s) { s.tie_embeddings = !s.tie_embeddings; }, gpt2 ? "1" : "0",
         gpt2 ? "0" : "1"}};
  };
  for (const bool gpt2 : {false, true}) {
    const ChainSpec hf = gpt2 ? gpt2_shape() : llama_shape();
    auto adapter = [&](const ChainSpec& s) {
      return gpt2 ? gpt2_hf_adapter(s) : llama_hf_adapter(s);
    };
    const nlohmann::json c = adapter(hf)->to_hf_config("float32");
    std::vector<Case> all = cases(gpt2);
    if (gpt2) {
      all.push_back({"n_positions", "model.max_seq_len", [](ChainSpec& s) { s.max_seq_len = 128; },
                     "64", "128"});
    }
    for (const Case& k : all) {
      ChainSpec v = hf;
      k.change(v);
      const std::string msg =
          error_of<ConfigError>([&] { adapter(v)->check_hf_config(c, "src"); });
      EXPECT_EQ(msg, "src: config.json " + std::string(k.hf_field) + " = " + k.hf_value +
                         " but the viaduct config has " + k.key + " = " + k.viaduct_value)
          << (gpt2 ? "gpt2 " : "llama ") << k.key;
    }
    ChainSpec larger = hf;
    larger.vocab_size += 64;
    EXPECT_NO_THROW(adapter(larger)->check_hf_config(c, "src"));
    ChainSpec longer = hf;
    longer.max_seq_len = 4 * hf.max_seq_len;
    if (gpt2) {
      EXPECT_THROW(adapter(longer)->check_hf_config(c, "src"), ConfigError);
    } else {
      EXPECT_NO_THROW(adapter(longer)->check_hf_config(c, "src"));
    }
  }
}

TEST(HfCheckpoint, MismatchesAndBadFoldersNameTheProblem) {
  TempDir dir;
  const ChainSpec hf = llama_shape();
  ChainSpec v = llama_shape();
  v.n_kv_heads = 4;
  const auto adapter = llama_hf_adapter(hf);
  std::string msg = error_of<ConfigError>(
      [&] { llama_hf_adapter(v)->check_hf_config(adapter->to_hf_config("float32"), "src"); });
  EXPECT_NE(msg.find("num_key_value_heads = 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.n_kv_heads = 4"), std::string::npos) << msg;

  nlohmann::json c = adapter->to_hf_config("float32");
  c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_NE(error_of<ConfigError>([&] { adapter->from_hf_config(c, "src"); }).find("rope_scaling"),
            std::string::npos);
  EXPECT_NE(error_of<ConfigError>([&] { adapter->check_hf_config(c, "src"); }).find("rope_scaling"),
            std::string::npos);
  c = adapter->to_hf_config("float32");
  c["model_type"] = "mistral";
  msg = error_of<ConfigError>([&] { adapter->check_hf_config(c, "src"); });
  EXPECT_EQ(msg, "src/config.json: model_type 'mistral' is not supported (llama, gpt2)");
  EXPECT_NE(error_of<ConfigError>([&] { adapter->from_hf_config(c, "src"); }).find("'mistral'"),
            std::string::npos);
  // Another family's layout: both named.
  msg = error_of<ConfigError>([&] {
    adapter->check_hf_config(gpt2_hf_adapter(gpt2_shape())->to_hf_config("float32"), "src");
  });
  EXPECT_EQ(msg, "src: config.json model_type = gpt2 but the viaduct config has model.family = llama");

  at::manual_seed(6);
  HfWriteOptions o;
  o.max_shard_bytes = 40000;
  fs::path out = dir.path() / "hf";
  write_hf_folder(out, random_llama(hf), *adapter, o);
  EXPECT_NE(error_of<FileError>([&] { write_hf_folder(out, random_llama(hf), *adapter, o); })
                .find("exists"),
            std::string::npos);
  // A folder of another shape is refused before its tensors are read.
  msg = error_of<ConfigError>([&] { read_hf_model(out, *llama_hf_adapter(v)); });
  EXPECT_NE(msg.find("num_key_value_heads = 2 but the viaduct config has model.n_kv_heads = 4"),
            std::string::npos)
      << msg;
  fs::remove(out / "model-00002-of-00003.safetensors");
  fs::remove(out / "model-00002-of-00004.safetensors");
  EXPECT_NE(error_of<FileError>([&] { read_hf_folder(out); }).find("which is missing"),
            std::string::npos);
  EXPECT_NE(error_of<FileError>([&] { read_hf_model(out, *adapter); }).find("which is missing"),
            std::string::npos);
  EXPECT_NE(error_of<FileError>([&] { read_hf_folder(dir.path()); }).find("no config.json"),
            std::string::npos);
  TensorMap t = adapter->to_hf(random_llama(hf));
  t.erase("model.layers.1.mlp.up_proj.weight");
  EXPECT_NE(error_of<FileError>([&] { adapter->from_hf(t, adapter->to_hf_config("float32"), "src"); })
                .find("model.layers.1.mlp.up_proj.weight"),
            std::string::npos);
}

// A checkpoint holding tensors the model does not have (a deeper model's
// layer, a stray weight) is refused naming them; the buffers that are no
// weights (llama's rotary frequencies, gpt2's attention masks) and a tied
// head stored beside its embedding load as before.
TEST(HfCheckpoint, TensorsTheModelDoesNotHaveAreRefused) {
  at::manual_seed(8);
  const auto llama = llama_hf_adapter(llama_shape());
  const auto config = llama->to_hf_config("float32");
  const TensorMap v = random_llama(llama_shape());
  TensorMap t = llama->to_hf(v);
  t["model.layers.0.self_attn.rotary_emb.inv_freq"] = at::ones({4});
  expect_bitwise(v, llama->from_hf(t, config, "src"));
  t["model.layers.2.mlp.up_proj.weight"] = at::zeros({48, 32});
  t["model.layers.2.mlp.down_proj.weight"] = at::zeros({32, 48});
  std::string msg = error_of<FileError>([&] { llama->from_hf(t, config, "src"); });
  EXPECT_EQ(msg, "src: 2 tensor(s) that this model does not have (model.layers.2.mlp.down_proj.weight, "
                 "model.layers.2.mlp.up_proj.weight): a checkpoint of another size or architecture?");

  const auto gpt2 = gpt2_hf_adapter(gpt2_shape());
  const auto gpt2_config = gpt2->to_hf_config("float32");
  const TensorMap g = random_gpt2(gpt2_shape());
  TensorMap h = gpt2->to_hf(g);
  h["transformer.h.1.attn.masked_bias"] = at::zeros({});
  // GPT2LMHeadModel's own state dict: the tied head stored too.
  h["lm_head.weight"] = h.at("transformer.wte.weight").clone();
  expect_bitwise(g, gpt2->from_hf(h, gpt2_config, "src"));
  h["lm_head.weight"] = h.at("lm_head.weight") + 1;
  msg = error_of<FileError>([&] { gpt2->from_hf(h, gpt2_config, "src"); });
  EXPECT_NE(msg.find("lm_head.weight differs from wte.weight"), std::string::npos) << msg;
  h.erase("lm_head.weight");
  h["transformer.h.0.attn.q_norm.weight"] = at::ones({32});
  msg = error_of<FileError>([&] { gpt2->from_hf(h, gpt2_config, "src"); });
  EXPECT_NE(msg.find("1 tensor(s) that this model does not have (h.0.attn.q_norm.weight)"),
            std::string::npos)
      << msg;
}

TEST(HfCheckpoint, TokenizerFilesAreCopiedByteForByte) {
  TempDir dir;
  const auto adapter = llama_hf_adapter(llama_shape());
  // A tokenizer folder as transformers saves it (any bytes: the copy is raw).
  const fs::path tok = dir.path() / "tok";
  fs::create_directories(tok);
  std::string json = "{\"model\": {\"type\": \"BPE\"}, \"bytes\": \"";
  for (int i = 1; i < 256; ++i) json += static_cast<char>(i == '"' || i == '\\' ? 'x' : i);
  json += "\"}\n";
  data::testing::write_text((tok / "tokenizer.json").string(), json);
  data::testing::write_text((tok / "tokenizer_config.json").string(), "{\"a\": 1}\n");
  data::testing::write_text((tok / "special_tokens_map.json").string(), "{\"b\": 2}\n");
  const auto by_file = hf_tokenizer_files(tok / "tokenizer.json", "--tokenizer");
  ASSERT_EQ(by_file.size(), 3u);
  const auto by_folder = hf_tokenizer_files(tok, "--tokenizer");
  ASSERT_EQ(by_folder.size(), 3u);
  EXPECT_EQ(by_folder[0].source, tok / "tokenizer.json");
  at::manual_seed(3);
  HfWriteOptions o;
  o.extra_files = by_folder;
  const fs::path out = dir.path() / "hf";
  write_hf_folder(out, random_llama(llama_shape()), *adapter, o);
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}) {
    EXPECT_EQ(data::testing::read_bytes((out / name).string()),
              data::testing::read_bytes((tok / name).string()))
        << name;
  }
  // A tokenizer.json of another name is copied as tokenizer.json; a
  // .tiktoken file keeps its name; companions only where they are.
  data::testing::write_text((dir.path() / "gpt2-tokenizer.json").string(), json);
  data::testing::write_text((dir.path() / "cl100k_base.tiktoken").string(), "IQ== 0\n");
  auto files = hf_tokenizer_files(dir.path() / "gpt2-tokenizer.json", "--tokenizer");
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].name, "tokenizer.json");
  files = hf_tokenizer_files(dir.path() / "cl100k_base.tiktoken", "--tokenizer");
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].name, "cl100k_base.tiktoken");
  // A SentencePiece model goes in as tokenizer.model, transformers' name.
  data::testing::write_text((dir.path() / "llama2.model").string(), "spm");
  files = hf_tokenizer_files(dir.path() / "llama2.model", "--tokenizer");
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].name, "tokenizer.model");

  // Missing: named with the key, before anything is written.
  std::string msg = error_of<FileError>(
      [&] { hf_tokenizer_files(dir.path() / "missing.json", "data.tokenizer"); });
  EXPECT_NE(msg.find("data.tokenizer: the tokenizer '" + (dir.path() / "missing.json").string() +
                     "' does not exist"),
            std::string::npos)
      << msg;
  msg = error_of<FileError>([&] { hf_tokenizer_files(dir.path() / "hf" / "..", "x"); });
  EXPECT_NE(msg.find("holds no tokenizer.json"), std::string::npos) << msg;
  o.extra_files = {{dir.path() / "gone.json", "tokenizer.json"}};
  const fs::path out2 = dir.path() / "hf2";
  msg = error_of<FileError>([&] { write_hf_folder(out2, random_llama(llama_shape()), *adapter, o); });
  EXPECT_NE(msg.find("gone.json"), std::string::npos) << msg;
  // Two files of one name: refused too.
  o.extra_files = by_folder;
  o.extra_files.push_back({dir.path() / "gpt2-tokenizer.json", "tokenizer.json"});
  msg = error_of<FileError>([&] { write_hf_folder(out2, random_llama(llama_shape()), *adapter, o); });
  EXPECT_NE(msg.find("two files named 'tokenizer.json'"), std::string::npos) << msg;
  // Nothing of either attempt is left.
  for (const auto& e : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(e.path().filename().string().rfind("hf2", 0), std::string::npos) << e.path();
  }
}

}  // namespace
}  // namespace viaduct::checkpoint
