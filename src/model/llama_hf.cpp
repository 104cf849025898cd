// llama as transformers' LlamaForCausalLM: the q and k rows permuted per
// head, see Note [HF rotary layout] in hf_adapter.h; llama3 rope_scaling in
// config.json, no biases, an untied head unless tie_word_embeddings.
#include <utility>

#include "model/hf_adapter.h"

namespace viaduct {
namespace {

using json = nlohmann::json;
using checkpoint::TensorMap;

// What config.json says of the model, as a ChainSpec (the fields it has).
ChainSpec read_config(const json& c, const std::string& source) {
  ChainSpec s;
  s.dim = hf::get_int(c, "hidden_size", source);
  s.ffn_hidden = hf::get_int(c, "intermediate_size", source);
  s.n_layers = hf::get_int(c, "num_hidden_layers", source);
  s.n_heads = hf::get_int(c, "num_attention_heads", source);
  s.n_kv_heads =
      c.contains("num_key_value_heads") && !c["num_key_value_heads"].is_null()
          ? hf::get_int(c, "num_key_value_heads", source)
          : s.n_heads;
  s.vocab_size = hf::get_int(c, "vocab_size", source);
  s.max_seq_len = hf::get_int(c, "max_position_embeddings", source);
  s.norm_eps = hf::get_number(c, "rms_norm_eps", 1e-6);
  s.rope_theta = hf::get_number(c, "rope_theta", 10000.0);
  s.tie_embeddings = c.value("tie_word_embeddings", false);
  // Newer transformers write "rope_parameters" (theta and scaling in one
  // object) instead of rope_theta and rope_scaling.
  json scaling = c.contains("rope_scaling") ? c["rope_scaling"] : json(nullptr);
  if (c.contains("rope_parameters") && c["rope_parameters"].is_object()) {
    const json& r = c["rope_parameters"];
    s.rope_theta = hf::get_number(r, "rope_theta", s.rope_theta);
    const std::string rt =
        r.value("rope_type", r.value("type", std::string("default")));
    if (rt != "default") scaling = r;
  }
  if (!scaling.is_null()) {
    const json& r = scaling;
    const std::string rt = r.value("rope_type", r.value("type", std::string()));
    if (rt != "llama3") {
      throw ConfigError(
          str(source, ": rope_scaling ", r.dump(),
              " is not supported (viaduct's RoPE scales as llama3 only)"));
    }
    s.rope_scaling.factor = hf::get_number(r, "factor", 0.0);
    s.rope_scaling.low_freq_factor = hf::get_number(r, "low_freq_factor", 1.0);
    s.rope_scaling.high_freq_factor =
        hf::get_number(r, "high_freq_factor", 4.0);
    s.rope_scaling.original_max_seq_len = hf::get_int(
        r, "original_max_position_embeddings", source + " rope_scaling");
    VIADUCT_CHECK_T(ConfigError, s.rope_scaling.factor > 0, source,
                    ": rope_scaling.factor must be > 0, got ",
                    s.rope_scaling.factor);
  }
  if (c.contains("head_dim") && !c["head_dim"].is_null()) {
    const int64_t hd = hf::get_int(c, "head_dim", source);
    VIADUCT_CHECK_T(ConfigError, hd * s.n_heads == s.dim, source, ": head_dim ",
                    hd, " x num_attention_heads ", s.n_heads,
                    " != hidden_size ", s.dim, " (viaduct needs them equal)");
  }
  const std::string act = c.value("hidden_act", std::string("silu"));
  VIADUCT_CHECK_T(ConfigError, act == "silu", source, ": hidden_act '", act,
                  "' is not silu (viaduct's llama is SwiGLU)");
  for (const char* flag : {"attention_bias", "mlp_bias"}) {
    VIADUCT_CHECK_T(ConfigError, !c.value(flag, false), source, ": ", flag,
                    " = true is not supported (viaduct's llama has no biases)");
  }
  return s;
}

class LlamaHfAdapter final : public checkpoint::StateDictAdapter {
 public:
  explicit LlamaHfAdapter(ChainSpec spec) : s_(std::move(spec)) {}

  json to_hf_config(const std::string& torch_dtype) const override {
    const RopeScaling& r = s_.rope_scaling;
    return {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", kLlamaModelType},
            {"hidden_size", s_.dim},
            {"intermediate_size", s_.ffn_hidden},
            {"num_hidden_layers", s_.n_layers},
            {"num_attention_heads", s_.n_heads},
            {"num_key_value_heads", s_.n_kv_heads},
            {"head_dim", s_.dim / s_.n_heads},
            {"vocab_size", s_.vocab_size},
            {"max_position_embeddings", s_.max_seq_len},
            {"rms_norm_eps", s_.norm_eps},
            {"rope_theta", s_.rope_theta},
            {"rope_scaling",
             r.enabled() ? json{{"rope_type", "llama3"},
                                {"factor", r.factor},
                                {"low_freq_factor", r.low_freq_factor},
                                {"high_freq_factor", r.high_freq_factor},
                                {"original_max_position_embeddings",
                                 r.original_max_seq_len}}
                         : json(nullptr)},
            {"hidden_act", "silu"},
            {"attention_bias", false},
            {"attention_dropout", 0.0},
            {"mlp_bias", false},
            {"pretraining_tp", 1},
            {"initializer_range", 0.02},
            {"tie_word_embeddings", s_.tie_embeddings},
            {"use_cache", true},
            {"torch_dtype", torch_dtype}};
  }

  std::vector<std::string> from_hf_config(
      const json& c, const std::string& folder) const override {
    hf::check_model_type(c, kLlamaModelType, s_.family, folder);
    const ChainSpec h = read_config(c, folder + "/config.json");
    std::vector<std::string> o = hf::chain_overrides(s_.family, h);
    o.push_back(hf::override_of("model.rope_theta", h.rope_theta));
    o.push_back(hf::override_of("model.rope_scaling_factor", h.rope_scaling.factor));
    if (h.rope_scaling.enabled()) {
      o.push_back(hf::override_of("model.rope_scaling_low_freq_factor",
                                  h.rope_scaling.low_freq_factor));
      o.push_back(hf::override_of("model.rope_scaling_high_freq_factor",
                                  h.rope_scaling.high_freq_factor));
      o.push_back(hf::override_of("model.rope_scaling_original_max_seq_len",
                                  h.rope_scaling.original_max_seq_len));
    }
    return o;
  }

  void check_hf_config(const json& c,
                       const std::string& folder) const override {
    hf::check_model_type(c, kLlamaModelType, s_.family, folder);
    const ChainSpec h = read_config(c, folder + "/config.json");
    const ChainSpec& v = s_;
    // max_position_embeddings is not checked: viaduct's RoPE takes any length.
    hf::check_chain_fields(folder,
                           {"num_hidden_layers", "hidden_size", "num_attention_heads",
                            "num_key_value_heads", "intermediate_size", "vocab_size", "",
                            "rms_norm_eps"},
                           h, v);
    if (h.rope_theta != v.rope_theta)
      hf::differ(folder, "rope_theta", h.rope_theta, "model.rope_theta",
                 v.rope_theta);
    const RopeScaling &hr = h.rope_scaling, &vr = v.rope_scaling;
    if (hr.factor != vr.factor)
      hf::differ(folder, "rope_scaling.factor", hr.factor,
                 "model.rope_scaling_factor", vr.factor);
    if (hr.enabled()) {
      if (hr.low_freq_factor != vr.low_freq_factor)
        hf::differ(folder, "rope_scaling.low_freq_factor", hr.low_freq_factor,
                   "model.rope_scaling_low_freq_factor", vr.low_freq_factor);
      if (hr.high_freq_factor != vr.high_freq_factor)
        hf::differ(folder, "rope_scaling.high_freq_factor", hr.high_freq_factor,
                   "model.rope_scaling_high_freq_factor", vr.high_freq_factor);
      if (hr.original_max_seq_len != vr.original_max_seq_len)
        hf::differ(folder, "rope_scaling.original_max_position_embeddings",
                   hr.original_max_seq_len,
                   "model.rope_scaling_original_max_seq_len",
                   vr.original_max_seq_len);
    }
  }

  TensorMap to_hf(const TensorMap& v) const override {
    const std::string src = "viaduct checkpoint";
    auto w = [&](const std::string& n) { return hf::cpu(hf::need(v, n, src)); };
    TensorMap out;
    out["model.embed_tokens.weight"] = w("tok_embeddings.weight");
    for (int64_t i = 0; i < s_.n_layers; ++i) {
      const std::string a = hf::layer(i),
                        h = "model.layers." + std::to_string(i) + ".";
      out[h + "self_attn.q_proj.weight"] =
          interleaved_to_half_rows(w(a + "attention.wq.weight"), s_.n_heads);
      out[h + "self_attn.k_proj.weight"] =
          interleaved_to_half_rows(w(a + "attention.wk.weight"), s_.n_kv_heads);
      out[h + "self_attn.v_proj.weight"] = w(a + "attention.wv.weight");
      out[h + "self_attn.o_proj.weight"] = w(a + "attention.wo.weight");
      out[h + "mlp.gate_proj.weight"] = w(a + "feed_forward.w1.weight");
      out[h + "mlp.down_proj.weight"] = w(a + "feed_forward.w2.weight");
      out[h + "mlp.up_proj.weight"] = w(a + "feed_forward.w3.weight");
      out[h + "input_layernorm.weight"] = w(a + "attention_norm.weight");
      out[h + "post_attention_layernorm.weight"] = w(a + "ffn_norm.weight");
    }
    out["model.norm.weight"] = w("norm.weight");
    if (!s_.tie_embeddings) out["lm_head.weight"] = w("lm_head.weight");
    return out;
  }

  TensorMap from_hf(const TensorMap& hf_tensors, const json& c,
                    const std::string& source) const override {
    const int64_t hf_vocab =
        hf::get_int(c, "vocab_size", source + "/config.json");
    const int64_t D = s_.dim, kv = s_.n_kv_heads * (s_.dim / s_.n_heads),
                  F = s_.ffn_hidden;
    hf::Taker take(hf_tensors, source);
    TensorMap v;
    v["tok_embeddings.weight"] =
        hf::padded_embedding(take, "model.embed_tokens.weight", hf_vocab, s_.vocab_size, D);
    for (int64_t i = 0; i < s_.n_layers; ++i) {
      const std::string a = hf::layer(i),
                        h = "model.layers." + std::to_string(i) + ".";
      v[a + "attention.wq.weight"] = half_to_interleaved_rows(
          take(h + "self_attn.q_proj.weight", {D, D}), s_.n_heads);
      v[a + "attention.wk.weight"] = half_to_interleaved_rows(
          take(h + "self_attn.k_proj.weight", {kv, D}), s_.n_kv_heads);
      v[a + "attention.wv.weight"] =
          take(h + "self_attn.v_proj.weight", {kv, D});
      v[a + "attention.wo.weight"] =
          take(h + "self_attn.o_proj.weight", {D, D});
      v[a + "feed_forward.w1.weight"] =
          take(h + "mlp.gate_proj.weight", {F, D});
      v[a + "feed_forward.w2.weight"] =
          take(h + "mlp.down_proj.weight", {D, F});
      v[a + "feed_forward.w3.weight"] = take(h + "mlp.up_proj.weight", {F, D});
      v[a + "attention_norm.weight"] = take(h + "input_layernorm.weight", {D});
      v[a + "ffn_norm.weight"] =
          take(h + "post_attention_layernorm.weight", {D});
    }
    v["norm.weight"] = take("model.norm.weight", {D});
    hf::take_head(take, v, s_.tie_embeddings, "lm_head.weight", "model.embed_tokens.weight",
                  hf_vocab, s_.vocab_size, D);
    // transformers' older llama checkpoints keep each layer's rotary
    // frequencies as a buffer; viaduct computes its own.
    take.expect_all_taken(
        [](const std::string& n) { return n.ends_with(".rotary_emb.inv_freq"); });
    return v;
  }

 private:
  ChainSpec s_;
};

}  // namespace

std::unique_ptr<checkpoint::StateDictAdapter> llama_hf_adapter(
    const ChainSpec& spec) {
  return std::make_unique<LlamaHfAdapter>(spec);
}

}  // namespace viaduct
