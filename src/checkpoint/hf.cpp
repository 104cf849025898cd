// Hugging Face llama / gpt2 checkpoints (see hf.h and Note [HF rotary
// layout]).
#include "checkpoint/hf.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <set>

#include "checkpoint/safetensors.h"
#include "core/check.h"
#include "core/file_io.h"

namespace viaduct::checkpoint {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kConfigFile = "config.json";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

std::string layer(int64_t i) { return "layers." + std::to_string(i) + "."; }

const at::Tensor& need(const TensorMap& m, const std::string& name,
                       const std::string& source) {
  auto it = m.find(name);
  VIADUCT_CHECK_T(FileError, it != m.end(), source, ": tensor '", name,
                  "' is missing");
  return it->second;
}

void expect_shape(const at::Tensor& t, std::vector<int64_t> shape,
                  const std::string& name, const std::string& source) {
  VIADUCT_CHECK_T(FileError, t.sizes().vec() == shape, source, ": tensor '",
                  name, "' has shape ", t.sizes(), ", expected ",
                  at::IntArrayRef(shape));
}

at::Tensor cpu(const at::Tensor& t) { return t.detach().to(at::kCPU).contiguous(); }

int64_t get_int(const json& c, const std::string& key, const std::string& source) {
  VIADUCT_CHECK_T(ConfigError, c.contains(key) && c[key].is_number_integer(),
                  source, ": config.json has no integer '", key, "'");
  return c[key].get<int64_t>();
}

double get_number(const json& c, const std::string& key, double fallback) {
  return c.contains(key) && c[key].is_number() ? c[key].get<double>() : fallback;
}

}  // namespace

at::Tensor interleaved_to_half_rows(const at::Tensor& w, int64_t n_heads) {
  const int64_t rows = w.size(0);
  const int64_t hd = rows / n_heads;
  auto rest = w.sizes().slice(1).vec();
  std::vector<int64_t> view{n_heads, hd / 2, 2};
  view.insert(view.end(), rest.begin(), rest.end());
  return w.reshape(view).transpose(1, 2).reshape(w.sizes()).contiguous();
}

at::Tensor half_to_interleaved_rows(const at::Tensor& w, int64_t n_heads) {
  const int64_t rows = w.size(0);
  const int64_t hd = rows / n_heads;
  auto rest = w.sizes().slice(1).vec();
  std::vector<int64_t> view{n_heads, 2, hd / 2};
  view.insert(view.end(), rest.begin(), rest.end());
  return w.reshape(view).transpose(1, 2).reshape(w.sizes()).contiguous();
}

std::string torch_dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default:
      throw ConfigError(viaduct::str("HF export: dtype ", c10::toString(dtype),
                                     " is not float32, bfloat16 or float16"));
  }
}

at::ScalarType parse_hf_dtype(const std::string& name) {
  if (name == "fp32" || name == "float32") return at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "fp16" || name == "float16") return at::kHalf;
  throw ConfigError(str("--dtype: '", name, "' is not fp32, bf16 or fp16"));
}

json hf_config_json(const HfModelShape& s, const std::string& torch_dtype) {
  json c;
  if (s.family == "llama") {
    c = {{"architectures", {"LlamaForCausalLM"}},
         {"model_type", "llama"},
         {"hidden_size", s.dim},
         {"intermediate_size", s.ffn_hidden},
         {"num_hidden_layers", s.n_layers},
         {"num_attention_heads", s.n_heads},
         {"num_key_value_heads", s.n_kv_heads},
         {"head_dim", s.dim / s.n_heads},
         {"vocab_size", s.vocab_size},
         {"max_position_embeddings", s.max_seq_len},
         {"rms_norm_eps", s.norm_eps},
         {"rope_theta", s.rope_theta},
         {"rope_scaling",
          s.rope_scaling_factor > 0
              ? json{{"rope_type", "llama3"},
                     {"factor", s.rope_scaling_factor},
                     {"low_freq_factor", s.rope_scaling_low_freq_factor},
                     {"high_freq_factor", s.rope_scaling_high_freq_factor},
                     {"original_max_position_embeddings", s.rope_scaling_original_max_seq_len}}
              : json(nullptr)},
         {"hidden_act", "silu"},
         {"attention_bias", false},
         {"attention_dropout", 0.0},
         {"mlp_bias", false},
         {"pretraining_tp", 1},
         {"initializer_range", 0.02},
         {"tie_word_embeddings", s.tie_embeddings},
         {"use_cache", true},
         {"torch_dtype", torch_dtype}};
  } else if (s.family == "gpt2") {
    c = {{"architectures", {"GPT2LMHeadModel"}},
         {"model_type", "gpt2"},
         {"n_embd", s.dim},
         {"n_layer", s.n_layers},
         {"n_head", s.n_heads},
         {"n_inner", s.ffn_hidden},
         {"n_positions", s.max_seq_len},
         {"n_ctx", s.max_seq_len},
         {"vocab_size", s.vocab_size},
         {"layer_norm_epsilon", s.norm_eps},
         {"activation_function", "gelu_new"},
         {"resid_pdrop", 0.0},
         {"embd_pdrop", 0.0},
         {"attn_pdrop", 0.0},
         {"scale_attn_weights", true},
         {"initializer_range", 0.02},
         {"tie_word_embeddings", s.tie_embeddings},
         {"use_cache", true},
         {"torch_dtype", torch_dtype}};
  } else {
    throw ConfigError(str("HF export: model.family '", s.family,
                          "' has no Hugging Face layout here (llama, gpt2)"));
  }
  return c;
}

HfModelShape shape_from_hf_config(const json& c, const std::string& source) {
  VIADUCT_CHECK_T(ConfigError, c.is_object(), source, ": config.json is not an object");
  const std::string type = c.value("model_type", std::string());
  HfModelShape s;
  if (type == "llama") {
    s.family = "llama";
    s.dim = get_int(c, "hidden_size", source);
    s.ffn_hidden = get_int(c, "intermediate_size", source);
    s.n_layers = get_int(c, "num_hidden_layers", source);
    s.n_heads = get_int(c, "num_attention_heads", source);
    s.n_kv_heads = c.contains("num_key_value_heads") && !c["num_key_value_heads"].is_null()
                       ? get_int(c, "num_key_value_heads", source)
                       : s.n_heads;
    s.vocab_size = get_int(c, "vocab_size", source);
    s.max_seq_len = get_int(c, "max_position_embeddings", source);
    s.norm_eps = get_number(c, "rms_norm_eps", 1e-6);
    s.rope_theta = get_number(c, "rope_theta", 10000.0);
    s.tie_embeddings = c.value("tie_word_embeddings", false);
    // Newer transformers write "rope_parameters" (theta and scaling in one
    // object) instead of rope_theta and rope_scaling.
    json scaling = c.contains("rope_scaling") ? c["rope_scaling"] : json(nullptr);
    if (c.contains("rope_parameters") && c["rope_parameters"].is_object()) {
      const json& r = c["rope_parameters"];
      s.rope_theta = get_number(r, "rope_theta", s.rope_theta);
      const std::string rt = r.value("rope_type", r.value("type", std::string("default")));
      if (rt != "default") scaling = r;
    }
    if (!scaling.is_null()) {
      const json& r = scaling;
      const std::string rt = r.value("rope_type", r.value("type", std::string()));
      if (rt != "llama3") {
        throw ConfigError(str(source, ": rope_scaling ", r.dump(),
                              " is not supported (viaduct's RoPE scales as llama3 only)"));
      }
      s.rope_scaling_factor = get_number(r, "factor", 0.0);
      s.rope_scaling_low_freq_factor = get_number(r, "low_freq_factor", 1.0);
      s.rope_scaling_high_freq_factor = get_number(r, "high_freq_factor", 4.0);
      s.rope_scaling_original_max_seq_len =
          get_int(r, "original_max_position_embeddings", source + " rope_scaling");
      VIADUCT_CHECK_T(ConfigError, s.rope_scaling_factor > 0, source,
                      ": rope_scaling.factor must be > 0, got ", s.rope_scaling_factor);
    }
    if (c.contains("head_dim") && !c["head_dim"].is_null()) {
      const int64_t hd = get_int(c, "head_dim", source);
      VIADUCT_CHECK_T(ConfigError, hd * s.n_heads == s.dim, source,
                      ": head_dim ", hd, " x num_attention_heads ", s.n_heads,
                      " != hidden_size ", s.dim, " (viaduct needs them equal)");
    }
    const std::string act = c.value("hidden_act", std::string("silu"));
    VIADUCT_CHECK_T(ConfigError, act == "silu", source, ": hidden_act '", act,
                    "' is not silu (viaduct's llama is SwiGLU)");
    for (const char* flag : {"attention_bias", "mlp_bias"}) {
      VIADUCT_CHECK_T(ConfigError, !c.value(flag, false), source, ": ", flag,
                      " = true is not supported (viaduct's llama has no biases)");
    }
  } else if (type == "gpt2") {
    s.family = "gpt2";
    s.dim = get_int(c, "n_embd", source);
    s.n_layers = get_int(c, "n_layer", source);
    s.n_heads = get_int(c, "n_head", source);
    s.n_kv_heads = s.n_heads;
    s.ffn_hidden = c.contains("n_inner") && !c["n_inner"].is_null()
                       ? get_int(c, "n_inner", source)
                       : 4 * s.dim;
    s.vocab_size = get_int(c, "vocab_size", source);
    s.max_seq_len = get_int(c, "n_positions", source);
    s.norm_eps = get_number(c, "layer_norm_epsilon", 1e-5);
    s.tie_embeddings = c.value("tie_word_embeddings", true);
    const std::string act = c.value("activation_function", std::string("gelu_new"));
    VIADUCT_CHECK_T(ConfigError, act == "gelu_new" || act == "gelu_pytorch_tanh",
                    source, ": activation_function '", act,
                    "' is not the tanh GELU viaduct's gpt2 uses");
  } else {
    throw ConfigError(str(source, ": model_type '", type,
                          "' is not supported (llama, gpt2)"));
  }
  return s;
}

void check_hf_shape(const HfModelShape& hf, const HfModelShape& v,
                    const std::string& source) {
  auto differ = [&](const char* hf_field, auto a, const char* key, auto b) {
    throw ConfigError(str(source, ": config.json ", hf_field, " = ", a,
                          " but the viaduct config has ", key, " = ", b));
  };
  if (hf.family != v.family) differ("model_type", hf.family, "model.family", v.family);
  const bool llama = hf.family == "llama";
  if (hf.n_layers != v.n_layers)
    differ(llama ? "num_hidden_layers" : "n_layer", hf.n_layers, "model.n_layers", v.n_layers);
  if (hf.dim != v.dim) differ(llama ? "hidden_size" : "n_embd", hf.dim, "model.dim", v.dim);
  if (hf.n_heads != v.n_heads)
    differ(llama ? "num_attention_heads" : "n_head", hf.n_heads, "model.n_heads", v.n_heads);
  if (hf.n_kv_heads != v.n_kv_heads)
    differ("num_key_value_heads", hf.n_kv_heads, "model.n_kv_heads", v.n_kv_heads);
  if (hf.ffn_hidden != v.ffn_hidden)
    differ(llama ? "intermediate_size" : "n_inner", hf.ffn_hidden, "model.ffn_hidden_dim",
           v.ffn_hidden);
  if (hf.vocab_size > v.vocab_size)
    differ("vocab_size", hf.vocab_size, "model.vocab_size (at least as large)", v.vocab_size);
  if (!llama && hf.max_seq_len != v.max_seq_len)
    differ("n_positions", hf.max_seq_len, "model.max_seq_len", v.max_seq_len);
  if (hf.norm_eps != v.norm_eps)
    differ(llama ? "rms_norm_eps" : "layer_norm_epsilon", hf.norm_eps, "model.norm_eps",
           v.norm_eps);
  if (llama && hf.rope_theta != v.rope_theta)
    differ("rope_theta", hf.rope_theta, "model.rope_theta", v.rope_theta);
  if (llama && hf.rope_scaling_factor != v.rope_scaling_factor)
    differ("rope_scaling.factor", hf.rope_scaling_factor, "model.rope_scaling_factor",
           v.rope_scaling_factor);
  if (llama && hf.rope_scaling_factor > 0) {
    if (hf.rope_scaling_low_freq_factor != v.rope_scaling_low_freq_factor)
      differ("rope_scaling.low_freq_factor", hf.rope_scaling_low_freq_factor,
             "model.rope_scaling_low_freq_factor", v.rope_scaling_low_freq_factor);
    if (hf.rope_scaling_high_freq_factor != v.rope_scaling_high_freq_factor)
      differ("rope_scaling.high_freq_factor", hf.rope_scaling_high_freq_factor,
             "model.rope_scaling_high_freq_factor", v.rope_scaling_high_freq_factor);
    if (hf.rope_scaling_original_max_seq_len != v.rope_scaling_original_max_seq_len)
      differ("rope_scaling.original_max_position_embeddings",
             hf.rope_scaling_original_max_seq_len, "model.rope_scaling_original_max_seq_len",
             v.rope_scaling_original_max_seq_len);
  }
  if (hf.tie_embeddings != v.tie_embeddings)
    differ("tie_word_embeddings", hf.tie_embeddings, "model.tie_embeddings", v.tie_embeddings);
}

TensorMap to_hf_tensors(const TensorMap& v, const HfModelShape& s) {
  const std::string src = "viaduct checkpoint";
  TensorMap out;
  if (s.family == "llama") {
    out["model.embed_tokens.weight"] = cpu(need(v, "tok_embeddings.weight", src));
    for (int64_t i = 0; i < s.n_layers; ++i) {
      const std::string a = layer(i), h = "model.layers." + std::to_string(i) + ".";
      out[h + "self_attn.q_proj.weight"] =
          interleaved_to_half_rows(cpu(need(v, a + "attention.wq.weight", src)), s.n_heads);
      out[h + "self_attn.k_proj.weight"] =
          interleaved_to_half_rows(cpu(need(v, a + "attention.wk.weight", src)), s.n_kv_heads);
      out[h + "self_attn.v_proj.weight"] = cpu(need(v, a + "attention.wv.weight", src));
      out[h + "self_attn.o_proj.weight"] = cpu(need(v, a + "attention.wo.weight", src));
      out[h + "mlp.gate_proj.weight"] = cpu(need(v, a + "feed_forward.w1.weight", src));
      out[h + "mlp.down_proj.weight"] = cpu(need(v, a + "feed_forward.w2.weight", src));
      out[h + "mlp.up_proj.weight"] = cpu(need(v, a + "feed_forward.w3.weight", src));
      out[h + "input_layernorm.weight"] = cpu(need(v, a + "attention_norm.weight", src));
      out[h + "post_attention_layernorm.weight"] = cpu(need(v, a + "ffn_norm.weight", src));
    }
    out["model.norm.weight"] = cpu(need(v, "norm.weight", src));
    if (!s.tie_embeddings) out["lm_head.weight"] = cpu(need(v, "lm_head.weight", src));
  } else if (s.family == "gpt2") {
    const std::string t = "transformer.";
    out[t + "wte.weight"] = cpu(need(v, "tok_embeddings.weight", src));
    out[t + "wpe.weight"] = cpu(need(v, "pos_embeddings.weight", src));
    for (int64_t i = 0; i < s.n_layers; ++i) {
      const std::string a = layer(i), h = t + "h." + std::to_string(i) + ".";
      for (const char* p : {"weight", "bias"}) {
        const std::string ps = p;
        out[h + "ln_1." + ps] = cpu(need(v, a + "attention_norm." + ps, src));
        out[h + "ln_2." + ps] = cpu(need(v, a + "ffn_norm." + ps, src));
      }
      auto w = [&](const std::string& n) { return cpu(need(v, a + n, src)); };
      out[h + "attn.c_attn.weight"] =
          at::cat({w("attention.wq.weight"), w("attention.wk.weight"),
                   w("attention.wv.weight")}, 0).t().contiguous();
      out[h + "attn.c_attn.bias"] =
          at::cat({w("attention.wq.bias"), w("attention.wk.bias"), w("attention.wv.bias")}, 0);
      out[h + "attn.c_proj.weight"] = w("attention.wo.weight").t().contiguous();
      out[h + "attn.c_proj.bias"] = w("attention.wo.bias");
      out[h + "mlp.c_fc.weight"] = w("feed_forward.w1.weight").t().contiguous();
      out[h + "mlp.c_fc.bias"] = w("feed_forward.w1.bias");
      out[h + "mlp.c_proj.weight"] = w("feed_forward.w2.weight").t().contiguous();
      out[h + "mlp.c_proj.bias"] = w("feed_forward.w2.bias");
    }
    out[t + "ln_f.weight"] = cpu(need(v, "norm.weight", src));
    out[t + "ln_f.bias"] = cpu(need(v, "norm.bias", src));
    if (!s.tie_embeddings) out["lm_head.weight"] = cpu(need(v, "lm_head.weight", src));
  } else {
    throw ConfigError(str("HF export: model.family '", s.family,
                          "' has no Hugging Face layout here (llama, gpt2)"));
  }
  return out;
}

TensorMap from_hf_tensors(const TensorMap& hf_in, const HfModelShape& s,
                          int64_t hf_vocab, const std::string& source) {
  // gpt2 checkpoints are saved with or without the "transformer." prefix;
  // the attention-mask buffers of old ones are not weights.
  TensorMap hf;
  for (const auto& [name, t] : hf_in) {
    std::string n = name;
    if (s.family == "gpt2" && n.rfind("transformer.", 0) == 0) n = n.substr(12);
    if (s.family == "gpt2" &&
        (n.size() > 9 && (n.compare(n.size() - 9, 9, ".attn.bias") == 0 ||
                          n.find(".attn.masked_bias") != std::string::npos))) {
      continue;
    }
    hf[n] = t;
  }
  const int64_t D = s.dim, hd = s.dim / s.n_heads, kv = s.n_kv_heads * hd;
  auto take = [&](const std::string& name, std::vector<int64_t> shape) {
    const at::Tensor& t = need(hf, name, source);
    expect_shape(t, shape, name, source);
    return t.to(at::kFloat).contiguous();
  };
  auto embedding = [&](const std::string& name) {
    at::Tensor e = take(name, {hf_vocab, D});
    if (hf_vocab == s.vocab_size) return e;
    at::Tensor padded = at::zeros({s.vocab_size, D}, e.options());
    padded.narrow(0, 0, hf_vocab).copy_(e);
    return padded;
  };
  TensorMap v;
  if (s.family == "llama") {
    v["tok_embeddings.weight"] = embedding("model.embed_tokens.weight");
    for (int64_t i = 0; i < s.n_layers; ++i) {
      const std::string a = layer(i), h = "model.layers." + std::to_string(i) + ".";
      v[a + "attention.wq.weight"] =
          half_to_interleaved_rows(take(h + "self_attn.q_proj.weight", {D, D}), s.n_heads);
      v[a + "attention.wk.weight"] =
          half_to_interleaved_rows(take(h + "self_attn.k_proj.weight", {kv, D}), s.n_kv_heads);
      v[a + "attention.wv.weight"] = take(h + "self_attn.v_proj.weight", {kv, D});
      v[a + "attention.wo.weight"] = take(h + "self_attn.o_proj.weight", {D, D});
      v[a + "feed_forward.w1.weight"] = take(h + "mlp.gate_proj.weight", {s.ffn_hidden, D});
      v[a + "feed_forward.w2.weight"] = take(h + "mlp.down_proj.weight", {D, s.ffn_hidden});
      v[a + "feed_forward.w3.weight"] = take(h + "mlp.up_proj.weight", {s.ffn_hidden, D});
      v[a + "attention_norm.weight"] = take(h + "input_layernorm.weight", {D});
      v[a + "ffn_norm.weight"] = take(h + "post_attention_layernorm.weight", {D});
    }
    v["norm.weight"] = take("model.norm.weight", {D});
    if (!s.tie_embeddings) {
      // A tied HF checkpoint loaded untied starts its head from the embedding.
      v["lm_head.weight"] = hf.count("lm_head.weight") ? embedding("lm_head.weight")
                                                       : v["tok_embeddings.weight"].clone();
    }
  } else if (s.family == "gpt2") {
    v["tok_embeddings.weight"] = embedding("wte.weight");
    v["pos_embeddings.weight"] = take("wpe.weight", {s.max_seq_len, D});
    const int64_t F = s.ffn_hidden;
    for (int64_t i = 0; i < s.n_layers; ++i) {
      const std::string a = layer(i), h = "h." + std::to_string(i) + ".";
      for (const char* p : {"weight", "bias"}) {
        const std::string ps = p;
        v[a + "attention_norm." + ps] = take(h + "ln_1." + ps, {D});
        v[a + "ffn_norm." + ps] = take(h + "ln_2." + ps, {D});
      }
      at::Tensor qkv = take(h + "attn.c_attn.weight", {D, 3 * D}).t();
      at::Tensor qkv_b = take(h + "attn.c_attn.bias", {3 * D});
      const char* names[3] = {"wq", "wk", "wv"};
      for (int k = 0; k < 3; ++k) {
        const std::string n = std::string("attention.") + names[k];
        v[a + n + ".weight"] = qkv.narrow(0, k * D, D).contiguous();
        v[a + n + ".bias"] = qkv_b.narrow(0, k * D, D).contiguous();
      }
      v[a + "attention.wo.weight"] = take(h + "attn.c_proj.weight", {D, D}).t().contiguous();
      v[a + "attention.wo.bias"] = take(h + "attn.c_proj.bias", {D});
      v[a + "feed_forward.w1.weight"] = take(h + "mlp.c_fc.weight", {D, F}).t().contiguous();
      v[a + "feed_forward.w1.bias"] = take(h + "mlp.c_fc.bias", {F});
      v[a + "feed_forward.w2.weight"] = take(h + "mlp.c_proj.weight", {F, D}).t().contiguous();
      v[a + "feed_forward.w2.bias"] = take(h + "mlp.c_proj.bias", {D});
    }
    v["norm.weight"] = take("ln_f.weight", {D});
    v["norm.bias"] = take("ln_f.bias", {D});
    if (!s.tie_embeddings) {
      v["lm_head.weight"] = hf.count("lm_head.weight") ? embedding("lm_head.weight")
                                                       : v["tok_embeddings.weight"].clone();
    }
  } else {
    throw ConfigError(str(source, ": family '", s.family, "' has no HF layout here"));
  }
  return v;
}

bool is_hf_folder(const fs::path& folder) {
  std::error_code ec;
  return fs::is_regular_file(folder / kConfigFile, ec);
}

HfFolder read_hf_folder(const fs::path& folder) {
  const std::string source = folder.string();
  VIADUCT_CHECK_T(FileError, is_hf_folder(folder), source,
                  ": no config.json (not a Hugging Face model folder)");
  HfFolder out;
  try {
    out.config = json::parse(read_text_file(folder / kConfigFile));
  } catch (const json::exception& e) {
    throw FileError(str(source, "/config.json is not valid JSON: ", e.what()));
  }
  out.shape = shape_from_hf_config(out.config, source + "/config.json");
  std::vector<fs::path> files;
  json index_names = json::object();
  std::error_code ec;
  if (fs::is_regular_file(folder / kIndexFile, ec)) {
    json index;
    try {
      index = json::parse(read_text_file(folder / kIndexFile));
    } catch (const json::exception& e) {
      throw FileError(str(source, "/", kIndexFile, " is not valid JSON: ", e.what()));
    }
    VIADUCT_CHECK_T(FileError, index.contains("weight_map") && index["weight_map"].is_object(),
                    source, "/", kIndexFile, " has no weight_map");
    std::set<std::string> shards;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      shards.insert(it.value().get<std::string>());
    }
    for (const auto& s : shards) {
      VIADUCT_CHECK_T(FileError, fs::is_regular_file(folder / s, ec), source, "/",
                      kIndexFile, " lists shard '", s, "', which is missing");
      files.push_back(folder / s);
    }
    index_names = index["weight_map"];
  } else {
    VIADUCT_CHECK_T(FileError, fs::is_regular_file(folder / kSingleFile, ec), source,
                    ": neither ", kSingleFile, " nor ", kIndexFile);
    files.push_back(folder / kSingleFile);
  }
  for (const auto& f : files) {
    SafetensorsFile st(f);
    for (const auto& [name, entry] : st.entries()) {
      VIADUCT_CHECK_T(FileError, !out.tensors.count(name), source, ": tensor '", name,
                      "' is in more than one shard");
      out.tensors[name] = st.read(name);
    }
  }
  for (auto it = index_names.begin(); it != index_names.end(); ++it) {
    VIADUCT_CHECK_T(FileError, out.tensors.count(it.key()), source, "/", kIndexFile,
                    " maps '", it.key(), "' to ", it.value().dump(),
                    ", which does not hold it");
  }
  return out;
}

std::vector<HfExtraFile> hf_tokenizer_files(const fs::path& tokenizer,
                                            const std::string& key) {
  std::error_code ec;
  VIADUCT_CHECK_T(FileError, fs::exists(tokenizer, ec), key, ": the tokenizer '",
                  tokenizer.string(), "' does not exist");
  fs::path file = tokenizer;
  if (fs::is_directory(tokenizer, ec)) {
    file = tokenizer / "tokenizer.json";
    VIADUCT_CHECK_T(FileError, fs::is_regular_file(file, ec), key, ": the folder '",
                    tokenizer.string(), "' holds no tokenizer.json");
  }
  VIADUCT_CHECK_T(FileError, fs::is_regular_file(file, ec), key, ": the tokenizer '",
                  file.string(), "' is not a file");
  // The names transformers looks for: tokenizer.json, and tokenizer.model
  // for a SentencePiece model; a tiktoken file keeps its own name.
  const std::string ext = file.extension().string();
  const std::string name = ext == ".json"    ? std::string("tokenizer.json")
                           : ext == ".model" ? std::string("tokenizer.model")
                                             : file.filename().string();
  std::vector<HfExtraFile> out{{file, name}};
  for (const char* companion : {"tokenizer_config.json", "special_tokens_map.json"}) {
    const fs::path beside = file.parent_path() / companion;
    if (beside != file && fs::is_regular_file(beside, ec)) out.push_back({beside, companion});
  }
  return out;
}

void write_hf_folder(const fs::path& folder, const TensorMap& viaduct,
                     const HfModelShape& shape, const HfWriteOptions& options) {
  std::error_code ec;
  VIADUCT_CHECK_T(FileError, !fs::exists(folder, ec), "HF export: '", folder.string(),
                  "' exists; give a new folder");
  std::set<std::string> names = {kConfigFile, kSingleFile, kIndexFile};
  for (const auto& f : options.extra_files) {
    VIADUCT_CHECK_T(FileError, fs::is_regular_file(f.source, ec), "HF export: '",
                    f.source.string(), "' (to copy as ", f.name, ") is not a file");
    VIADUCT_CHECK_T(FileError, names.insert(f.name).second, "HF export: two files named '",
                    f.name, "' (the last from '", f.source.string(), "')");
  }
  const std::string dtype_name = torch_dtype_name(options.dtype);
  TensorMap hf = to_hf_tensors(viaduct, shape);
  fs::path tmp = folder;
  tmp += ".tmp-" + std::to_string(::getpid());
  remove_tree(tmp);
  make_dirs(tmp);
  try {
    // Shards in name order, each up to max_shard_bytes (a larger tensor
    // gets a shard of its own).
    std::vector<NamedTensors> shards(1);
    int64_t bytes = 0, total = 0;
    for (const auto& [name, t] : hf) {
      at::Tensor c = t.to(options.dtype).contiguous();
      const int64_t n = c.numel() * static_cast<int64_t>(c.element_size());
      if (!shards.back().empty() && bytes + n > options.max_shard_bytes) {
        shards.emplace_back();
        bytes = 0;
      }
      shards.back().emplace_back(name, c);
      bytes += n;
      total += n;
    }
    const StringMap meta{{"format", "pt"}};
    if (shards.size() == 1) {
      write_safetensors(tmp / kSingleFile, shards[0], meta);
    } else {
      json weight_map = json::object();
      for (size_t k = 0; k < shards.size(); ++k) {
        char name[64];
        std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", k + 1,
                      shards.size());
        write_safetensors(tmp / name, shards[k], meta);
        for (const auto& [n, t] : shards[k]) weight_map[n] = name;
      }
      json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
      write_text_file(tmp / kIndexFile, index.dump(2) + "\n");
    }
    write_text_file(tmp / kConfigFile, hf_config_json(shape, dtype_name).dump(2) + "\n");
    for (const auto& f : options.extra_files) {
      write_text_file(tmp / f.name, read_text_file(f.source));
    }
    fsync_dir(tmp);
    rename_path(tmp, folder);
    fsync_dir(folder.has_parent_path() ? folder.parent_path() : fs::path("."));
  } catch (...) {
    remove_tree_noexcept(tmp);
    throw;
  }
}

}  // namespace viaduct::checkpoint
