// gpt2 as transformers' GPT2LMHeadModel (see hf_adapter.h). transformers
// stores Conv1D weights as [in, out] (viaduct's Linear is [out, in]) and
// fuses q, k, v into c_attn ([D, 3D], q first); lm_head is tied to wte. A
// padded viaduct vocab (50,304) is written whole and config.json says so; an
// HF vocab smaller than viaduct's is padded with zero rows on the way in.
#include <utility>

#include "model/hf_adapter.h"

namespace viaduct {
namespace {

using json = nlohmann::json;
using checkpoint::TensorMap;

// What config.json says of the model, as a ChainSpec (the fields it has).
ChainSpec read_config(const json& c, const std::string& source) {
  ChainSpec s;
  s.dim = hf::get_int(c, "n_embd", source);
  s.n_layers = hf::get_int(c, "n_layer", source);
  s.n_heads = hf::get_int(c, "n_head", source);
  s.n_kv_heads = s.n_heads;
  s.ffn_hidden = c.contains("n_inner") && !c["n_inner"].is_null()
                     ? hf::get_int(c, "n_inner", source)
                     : 4 * s.dim;
  s.vocab_size = hf::get_int(c, "vocab_size", source);
  s.max_seq_len = hf::get_int(c, "n_positions", source);
  s.norm_eps = hf::get_number(c, "layer_norm_epsilon", 1e-5);
  s.tie_embeddings = c.value("tie_word_embeddings", true);
  const std::string act =
      c.value("activation_function", std::string("gelu_new"));
  VIADUCT_CHECK_T(ConfigError, act == "gelu_new" || act == "gelu_pytorch_tanh",
                  source, ": activation_function '", act,
                  "' is not the tanh GELU viaduct's gpt2 uses");
  return s;
}

class Gpt2HfAdapter final : public checkpoint::StateDictAdapter {
 public:
  explicit Gpt2HfAdapter(ChainSpec spec) : s_(std::move(spec)) {}

  json to_hf_config(const std::string& torch_dtype) const override {
    return {{"architectures", {"GPT2LMHeadModel"}},
            {"model_type", kGpt2ModelType},
            {"n_embd", s_.dim},
            {"n_layer", s_.n_layers},
            {"n_head", s_.n_heads},
            {"n_inner", s_.ffn_hidden},
            {"n_positions", s_.max_seq_len},
            {"n_ctx", s_.max_seq_len},
            {"vocab_size", s_.vocab_size},
            {"layer_norm_epsilon", s_.norm_eps},
            {"activation_function", "gelu_new"},
            {"resid_pdrop", 0.0},
            {"embd_pdrop", 0.0},
            {"attn_pdrop", 0.0},
            {"scale_attn_weights", true},
            {"initializer_range", 0.02},
            {"tie_word_embeddings", s_.tie_embeddings},
            {"use_cache", true},
            {"torch_dtype", torch_dtype}};
  }

  std::vector<std::string> from_hf_config(
      const json& c, const std::string& folder) const override {
    hf::check_model_type(c, kGpt2ModelType, s_.family, folder);
    return hf::chain_overrides(s_.family, read_config(c, folder + "/config.json"));
  }

  void check_hf_config(const json& c,
                       const std::string& folder) const override {
    hf::check_model_type(c, kGpt2ModelType, s_.family, folder);
    hf::check_chain_fields(folder,
                           {"n_layer", "n_embd", "n_head", "num_key_value_heads", "n_inner",
                            "vocab_size", "n_positions", "layer_norm_epsilon"},
                           read_config(c, folder + "/config.json"), s_);
  }

  TensorMap to_hf(const TensorMap& v) const override {
    const std::string src = "viaduct checkpoint";
    auto w = [&](const std::string& n) { return hf::cpu(hf::need(v, n, src)); };
    const std::string t = "transformer.";
    TensorMap out;
    out[t + "wte.weight"] = w("tok_embeddings.weight");
    out[t + "wpe.weight"] = w("pos_embeddings.weight");
    for (int64_t i = 0; i < s_.n_layers; ++i) {
      const std::string a = hf::layer(i),
                        h = t + "h." + std::to_string(i) + ".";
      for (const char* p : {"weight", "bias"}) {
        const std::string ps = p;
        out[h + "ln_1." + ps] = w(a + "attention_norm." + ps);
        out[h + "ln_2." + ps] = w(a + "ffn_norm." + ps);
      }
      auto lw = [&](const std::string& n) { return w(a + n); };
      out[h + "attn.c_attn.weight"] =
          at::cat({lw("attention.wq.weight"), lw("attention.wk.weight"),
                   lw("attention.wv.weight")},
                  0)
              .t()
              .contiguous();
      out[h + "attn.c_attn.bias"] =
          at::cat({lw("attention.wq.bias"), lw("attention.wk.bias"),
                   lw("attention.wv.bias")},
                  0);
      out[h + "attn.c_proj.weight"] =
          lw("attention.wo.weight").t().contiguous();
      out[h + "attn.c_proj.bias"] = lw("attention.wo.bias");
      out[h + "mlp.c_fc.weight"] =
          lw("feed_forward.w1.weight").t().contiguous();
      out[h + "mlp.c_fc.bias"] = lw("feed_forward.w1.bias");
      out[h + "mlp.c_proj.weight"] =
          lw("feed_forward.w2.weight").t().contiguous();
      out[h + "mlp.c_proj.bias"] = lw("feed_forward.w2.bias");
    }
    out[t + "ln_f.weight"] = w("norm.weight");
    out[t + "ln_f.bias"] = w("norm.bias");
    if (!s_.tie_embeddings) out["lm_head.weight"] = w("lm_head.weight");
    return out;
  }

  TensorMap from_hf(const TensorMap& hf_in, const json& c,
                    const std::string& source) const override {
    const int64_t hf_vocab =
        hf::get_int(c, "vocab_size", source + "/config.json");
    // gpt2 checkpoints are saved with or without the "transformer." prefix;
    // the attention-mask buffers of old ones are not weights.
    TensorMap hf_tensors;
    for (const auto& [name, t] : hf_in) {
      std::string n = name;
      if (n.rfind("transformer.", 0) == 0) n = n.substr(12);
      if (n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias")) {
        continue;
      }
      hf_tensors[n] = t;
    }
    const int64_t D = s_.dim, F = s_.ffn_hidden;
    hf::Taker take(hf_tensors, source);
    TensorMap v;
    v["tok_embeddings.weight"] = hf::padded_embedding(take, "wte.weight", hf_vocab, s_.vocab_size, D);
    v["pos_embeddings.weight"] = take("wpe.weight", {s_.max_seq_len, D});
    for (int64_t i = 0; i < s_.n_layers; ++i) {
      const std::string a = hf::layer(i), h = "h." + std::to_string(i) + ".";
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
      v[a + "attention.wo.weight"] =
          take(h + "attn.c_proj.weight", {D, D}).t().contiguous();
      v[a + "attention.wo.bias"] = take(h + "attn.c_proj.bias", {D});
      v[a + "feed_forward.w1.weight"] =
          take(h + "mlp.c_fc.weight", {D, F}).t().contiguous();
      v[a + "feed_forward.w1.bias"] = take(h + "mlp.c_fc.bias", {F});
      v[a + "feed_forward.w2.weight"] =
          take(h + "mlp.c_proj.weight", {F, D}).t().contiguous();
      v[a + "feed_forward.w2.bias"] = take(h + "mlp.c_proj.bias", {D});
    }
    v["norm.weight"] = take("ln_f.weight", {D});
    v["norm.bias"] = take("ln_f.bias", {D});
    hf::take_head(take, v, s_.tie_embeddings, "lm_head.weight", "wte.weight", hf_vocab,
                  s_.vocab_size, D);
    take.expect_all_taken();
    return v;
  }

 private:
  ChainSpec s_;
};

}  // namespace

std::unique_ptr<checkpoint::StateDictAdapter> gpt2_hf_adapter(
    const ChainSpec& spec) {
  return std::make_unique<Gpt2HfAdapter>(spec);
}

}  // namespace viaduct
