#include "model/chain_transformer.h"

#include <algorithm>

#include <cmath>

#include "core/check.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "core/rng.h"
#include "model/families.h"

namespace viaduct {
namespace {

// (s, norm(s)) for s = stream + pending, the add inside the norm (see Note
// [Deferred residual add]); (stream, norm(stream)) with nothing pending.
template <typename Norm>
std::pair<at::Tensor, at::Tensor> norm_of(Norm& norm, const at::Tensor& stream,
                                          const at::Tensor& pending) {
  if (pending.defined()) return norm->forward_with_residual(stream, pending);
  return {stream, norm->forward(stream)};
}

}  // namespace

ChainBlockImpl::ChainBlockImpl(const ChainSpec& s, int64_t layer_id)
    : spec_(s), layer_id_(layer_id) {
  AttentionOptions ao;
  ao.dim = s.dim;
  ao.n_heads = s.n_heads;
  ao.n_kv_heads = s.n_kv_heads;
  ao.bias = s.bias;
  ao.rope = !s.learned_positions;
  ao.max_seq_len = s.max_seq_len;
  ao.rope_theta = s.rope_theta;
  ao.rope_scaling = s.rope_scaling;
  // Registration order fixes the parameter order (and so optimizer order).
  if (s.layer_norm) {
    attention_ln_ = register_module("attention_norm", LayerNorm(s.dim, s.norm_eps));
  } else {
    attention_rms_ = register_module("attention_norm", RMSNorm(s.dim, s.norm_eps));
  }
  attention_ = register_module("attention", Attention(ao));
  if (s.layer_norm) {
    ffn_ln_ = register_module("ffn_norm", LayerNorm(s.dim, s.norm_eps));
  } else {
    ffn_rms_ = register_module("ffn_norm", RMSNorm(s.dim, s.norm_eps));
  }
  if (s.gelu_mlp) {
    gelu_ = register_module("feed_forward", GeluMLP(s.dim, s.ffn_hidden));
  } else {
    swiglu_ = register_module("feed_forward", SwiGLU(s.dim, s.ffn_hidden));
  }
}

void ChainBlockImpl::init_weights(uint64_t seed, const std::string& p) {
  if (spec_.layer_norm) {
    attention_ln_->reset_parameters();
    ffn_ln_->reset_parameters();
  } else {
    attention_rms_->reset_parameters();
    ffn_rms_->reset_parameters();
  }
  if (spec_.gelu_mlp) {
    // GPT-2: N(0, 0.02), residual projections 0.02 / sqrt(2 n_layers).
    const double out_std = 0.02 / std::sqrt(2.0 * spec_.n_layers);
    attention_->init_weights(seed, p + "attention.", 0.02, out_std, false);
    gelu_->init_weights(seed, p + "feed_forward.", 0.02, out_std);
  } else {
    // llama (torchtitan, depth_init): truncated normal, 0.02 in, and
    // 0.02 / sqrt(2 (layer_id + 1)) for the outputs.
    const double out_std =
        spec_.depth_init ? 0.02 / std::sqrt(2.0 * (layer_id_ + 1))
                         : 0.02 / std::sqrt(2.0 * spec_.n_layers);
    attention_->init_weights(seed, p + "attention.", 0.02, out_std, true);
    swiglu_->init_weights(seed, p + "feed_forward.", 0.02, out_std);
  }
}

ChainResidual ChainBlockImpl::forward(const ChainResidual& x,
                                     const ops::DocumentsPtr& documents) {
  if (!spec_.activation_checkpoint.checkpoints(layer_id_)) {
    return forward_layer(x, documents.get());
  }
  // See Note [Deferred residual add]: one tensor in, one out. The recompute
  // runs in the backward, when the part may hold the next micro-batch's
  // documents: the body keeps this one's.
  auto body = [this, documents](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{forward_layer({in[0], {}}, documents.get()).sum()};
  };
  return {ops::recompute(spec_.activation_checkpoint, body, {x.sum()}, parameters()).at(0), {}};
}

ChainResidual ChainBlockImpl::forward_layer(const ChainResidual& x,
                                            const ops::Documents* documents) {
  auto ffn = [&](const at::Tensor& f) {
    return spec_.gelu_mlp ? gelu_->forward(f) : swiglu_->forward(f);
  };
  // See Note [Deferred residual add]: s = stream + pending and h = s +
  // attention, each summed in the norm that takes it.
  const bool ln = spec_.layer_norm;
  auto [s, a] = ln ? norm_of(attention_ln_, x.stream, x.pending)
                   : norm_of(attention_rms_, x.stream, x.pending);
  auto o = attention_->forward(a, documents);
  auto [h, f] = ln ? norm_of(ffn_ln_, s, o) : norm_of(ffn_rms_, s, o);
  return {h, ffn(f)};
}

std::vector<std::string> chain_module_fqns(const ChainSpec& s) {
  std::vector<std::string> out{"tok_embeddings"};
  if (s.learned_positions) out.push_back("pos_embeddings");
  for (int64_t i = 0; i < s.n_layers; ++i) out.push_back(str("layers.", i));
  out.push_back("norm");
  out.push_back("lm_head");
  return out;
}

void check_chain_part(const ChainSpec& s, const std::vector<std::string>& fqns) {
  if (!s.tie_embeddings || fqns.empty()) return;
  const auto has = [&](const char* m) { return std::find(fqns.begin(), fqns.end(), m) != fqns.end(); };
  VIADUCT_CHECK_T(ConfigError, has("tok_embeddings") || !has("lm_head"),
                  "model.tie_embeddings = true needs tok_embeddings and lm_head in the same "
                  "part; with pipeline parallelism set model.tie_embeddings = false");
}

ChainTransformer::ChainTransformer(const ChainSpec& s,
                                   const std::vector<std::string>& fqns)
    : spec_(s) {
  module_fqns_ = select_modules(chain_module_fqns(s), fqns, s.family);
  check_chain_part(s, module_fqns_);
  for (const auto& m : module_fqns_) {
    if (m == "tok_embeddings") {
      has_first_ = true;
      tok_embeddings_ = register_module(
          "tok_embeddings", torch::nn::Embedding(s.vocab_size, s.dim));
    } else if (m == "pos_embeddings") {
      pos_embeddings_ = register_module(
          "pos_embeddings", torch::nn::Embedding(s.max_seq_len, s.dim));
    } else if (m.rfind("layers.", 0) == 0) {
      if (!layers_) layers_ = register_module("layers", torch::nn::ModuleDict());
      const int64_t id = std::stoll(m.substr(7));
      ChainBlock b(s, id);
      layers_->update({{std::to_string(id), b.ptr()}});
      blocks_.emplace_back(id, b);
    } else if (m == "norm") {
      has_norm_ = true;
      if (s.layer_norm) {
        norm_ln_ = register_module("norm", LayerNorm(s.dim, s.norm_eps));
      } else {
        norm_rms_ = register_module("norm", RMSNorm(s.dim, s.norm_eps));
      }
    } else if (m == "lm_head") {
      has_head_ = true;
      has_last_ = true;
      if (!s.tie_embeddings) {
        lm_head_ = register_module(
            "lm_head", torch::nn::Linear(
                           torch::nn::LinearOptions(s.dim, s.vocab_size).bias(false)));
      }
    }
  }
  VIADUCT_CHECK_T(ConfigError, has_norm_ == has_head_,
                  "norm and lm_head must be in the same model part");
}

void ChainTransformer::init_weights(uint64_t seed) {
  if (tok_embeddings_) {
    // llama (torchtitan): N(0, 1); gpt2: N(0, 0.02).
    init_normal_(tok_embeddings_->weight, spec_.gelu_mlp ? 0.02 : 1.0, seed,
                 "tok_embeddings.weight");
  }
  if (pos_embeddings_) {
    init_normal_(pos_embeddings_->weight, 0.02, seed, "pos_embeddings.weight");
  }
  for (auto& [id, b] : blocks_) b->init_weights(seed, str("layers.", id, "."));
  if (norm_ln_) norm_ln_->reset_parameters();
  if (norm_rms_) norm_rms_->reset_parameters();
  if (lm_head_) {
    if (spec_.gelu_mlp) {
      init_normal_(lm_head_->weight, 0.02, seed, "lm_head.weight");
    } else {
      const double std = 1.0 / std::sqrt(static_cast<double>(spec_.dim));
      init_trunc_normal_(lm_head_->weight, std, -3 * std, 3 * std, seed,
                         "lm_head.weight");
    }
  }
}

at::Tensor ChainTransformer::trunk(const Activations& in) {
  VIADUCT_CHECK(!in.empty(), "model part got no inputs");
  at::Tensor h;
  if (has_first_) {
    const auto& tokens = in[0];  // [B, T] int64
    VIADUCT_CHECK(tokens.dim() == 2, "tokens must be [B, T], got ", tokens.sizes());
    h = ops::embedding(tok_embeddings_->weight, tokens, kernel_options_);  // [B, T, D]
    if (pos_embeddings_) {
      const auto T = tokens.size(1);
      VIADUCT_CHECK(T <= spec_.max_seq_len, "sequence length ", T,
                    " exceeds model.max_seq_len ", spec_.max_seq_len);
      if (documents_ && documents_->reset_positions()) {
        // Each token at its position in its document.
        const auto pos = documents_->positions(h.device());
        h = h + pos_embeddings_->weight.index_select(0, pos.flatten()).view(h.sizes());
      } else {
        h = h + pos_embeddings_->weight.slice(0, 0, T).unsqueeze(0);
      }
    }
    if (compute_dtype_ != h.scalar_type()) h = h.to(compute_dtype_);
  } else {
    h = in[0];
  }
  ChainResidual x{h, {}};
  for (auto& [id, b] : blocks_) x = b->forward(x, documents_);
  // See Note [Deferred residual add]: the part's output is one tensor; the
  // final RMSNorm adds the last block's FFN output as it normalises.
  if (!has_head_) return x.sum();
  if (norm_ln_) return norm_of(norm_ln_, x.stream, x.pending).second;
  return norm_of(norm_rms_, x.stream, x.pending).second;
}

Activations ChainTransformer::forward(const Activations& in) {
  auto h = trunk(in);
  if (!has_head_) return {h};
  const auto& w = lm_head_ ? lm_head_->weight : tok_embeddings_->weight;
  return {ops::linear(h, w, at::Tensor(), kernel_options_)};  // [B, T, V]
}

at::Tensor ChainTransformer::forward_loss(const Activations& in, const at::Tensor& targets) {
  VIADUCT_CHECK(has_head_, "forward_loss on a part without the head");
  auto h = trunk(in);
  const auto& w = lm_head_ ? lm_head_->weight : tok_embeddings_->weight;
  const int64_t chunk = ops::loss_chunk_tokens(spec_.loss_chunk_tokens, h, kernel_options_);
  if (chunk == 0) {
    return summed_cross_entropy(ops::linear(h, w, at::Tensor(), kernel_options_), targets);
  }
  return ops::chunked_head_cross_entropy(h.reshape({-1, h.size(-1)}), w, targets, chunk,
                                         kernel_options_);
}

ChainSpec apply_model_overrides(ChainSpec s, const JobConfig& job) {
  const ModelKeys& keys = job.model.keys;
  s.n_layers = int_or(keys, "model.n_layers", s.n_layers);
  const bool dim_changed = keys.is_set("model.dim");
  s.dim = int_or(keys, "model.dim", s.dim);
  s.n_heads = int_or(keys, "model.n_heads", s.n_heads);
  if (keys.is_set("model.n_kv_heads")) {
    s.n_kv_heads = keys.get_int("model.n_kv_heads");
  } else if (keys.is_set("model.n_heads") &&
             (s.n_kv_heads > s.n_heads || s.n_heads % s.n_kv_heads != 0)) {
    s.n_kv_heads = s.n_heads;  // the flavor's KV heads no longer fit
  }
  s.vocab_size = int_or(keys, "model.vocab_size", s.vocab_size);
  if (keys.is_set("model.ffn_hidden_dim")) {
    s.ffn_hidden = keys.get_int("model.ffn_hidden_dim");
  } else if (dim_changed) {
    s.ffn_hidden = s.gelu_mlp ? 4 * s.dim : llama_ffn_hidden(s.dim, 256, 1.0);
  }
  s.max_seq_len = int_or(keys, "model.max_seq_len", s.max_seq_len);
  s.norm_eps = float_or(keys, "model.norm_eps", s.norm_eps);
  s.rope_theta = float_or(keys, "model.rope_theta", s.rope_theta);
  s.rope_scaling.factor = float_or(keys, "model.rope_scaling_factor", s.rope_scaling.factor);
  s.rope_scaling.low_freq_factor =
      float_or(keys, "model.rope_scaling_low_freq_factor", s.rope_scaling.low_freq_factor);
  s.rope_scaling.high_freq_factor =
      float_or(keys, "model.rope_scaling_high_freq_factor", s.rope_scaling.high_freq_factor);
  s.rope_scaling.original_max_seq_len = int_or(keys, "model.rope_scaling_original_max_seq_len",
                                               s.rope_scaling.original_max_seq_len);
  VIADUCT_CHECK_T(ConfigError,
                  !s.rope_scaling.enabled() ||
                      s.rope_scaling.high_freq_factor > s.rope_scaling.low_freq_factor,
                  "model.rope_scaling_high_freq_factor (", s.rope_scaling.high_freq_factor,
                  ") must exceed model.rope_scaling_low_freq_factor (",
                  s.rope_scaling.low_freq_factor, ")");
  s.tie_embeddings = bool_or(keys, "model.tie_embeddings", s.tie_embeddings);
  s.loss_chunk_tokens = keys.get_int("model.loss_chunk_tokens");
  s.activation_checkpoint = activation_checkpoint(job.activation_checkpoint);
  auto pos = [&](int64_t v, const char* key) {
    VIADUCT_CHECK_T(ConfigError, v > 0, key, " must be > 0 (", s.family, " ",
                    s.flavor, ")");
  };
  pos(s.n_layers, "model.n_layers");
  pos(s.dim, "model.dim");
  pos(s.n_heads, "model.n_heads");
  pos(s.n_kv_heads, "model.n_kv_heads");
  pos(s.vocab_size, "model.vocab_size");
  pos(s.ffn_hidden, "model.ffn_hidden_dim");
  pos(s.max_seq_len, "model.max_seq_len");
  VIADUCT_CHECK_T(ConfigError, s.dim % s.n_heads == 0, "model.dim (", s.dim,
                  ") must be divisible by model.n_heads (", s.n_heads, ")");
  VIADUCT_CHECK_T(ConfigError, s.n_heads % s.n_kv_heads == 0, "model.n_heads (",
                  s.n_heads, ") must be divisible by model.n_kv_heads (",
                  s.n_kv_heads, ")");
  VIADUCT_CHECK_T(ConfigError, s.learned_positions || (s.dim / s.n_heads) % 2 == 0,
                  "rotary embeddings need an even head dim, got model.dim / "
                  "model.n_heads = ", s.dim / s.n_heads);
  const auto seq = job.training.seq_len;
  VIADUCT_CHECK_T(ConfigError, seq <= s.max_seq_len, "training.seq_len (", seq,
                  ") exceeds model.max_seq_len (", s.max_seq_len, ")");
  return s;
}

ModelInfo describe_chain(const ChainSpec& s, int64_t seq_len) {
  ModelInfo info;
  info.family = s.family;
  info.flavor = s.flavor;
  info.n_layers = s.n_layers;
  const int64_t hd = s.dim / s.n_heads;
  const int64_t kv = s.n_kv_heads * hd;
  int64_t attn = s.dim * s.dim * 2 + 2 * s.dim * kv;
  if (s.bias) attn += 2 * s.dim + 2 * kv;
  int64_t ffn = s.gelu_mlp ? 2 * s.dim * s.ffn_hidden + s.ffn_hidden + s.dim
                           : 3 * s.dim * s.ffn_hidden;
  const int64_t norms = s.layer_norm ? 4 * s.dim : 2 * s.dim;
  const int64_t per_layer = attn + ffn + norms;
  info.embedding_params = s.vocab_size * s.dim +
                          (s.learned_positions ? s.max_seq_len * s.dim : 0);
  const int64_t head = s.tie_embeddings ? 0 : s.vocab_size * s.dim;
  info.params = info.embedding_params + s.n_layers * per_layer +
                (s.layer_norm ? 2 : 1) * s.dim + head;
  info.active_params = info.params;
  // Note [FLOPs per token]
  // 6 x (non-embedding parameters, the head
  // included) for the matmuls of forward + backward, plus 12 L D T for
  // causal attention's scores and values (PaLM's formula as torchtitan uses
  // it, with T the sequence length): each token counts all T keys of its
  // window, no causal discount, 2 D for the score and 2 D for the value of
  // each (query, key) pair forward and twice that backward, so 12 D a pair
  // and layer (ModelInfo::attention_flops_per_pair).
  const int64_t matmul_params = s.n_layers * (attn + ffn) + s.vocab_size * s.dim;
  info.flops_per_token_outside_attention = 6.0 * static_cast<double>(matmul_params);
  info.attention_flops_per_pair = 12.0 * static_cast<double>(s.n_layers * s.dim);
  info.flops_per_token = info.flops_per_token_outside_attention +
                         info.attention_flops_per_pair * static_cast<double>(seq_len);
  const double layer_flops = 6.0 * static_cast<double>(attn + ffn) +
                             12.0 * s.dim * static_cast<double>(seq_len);
  info.module_flops["lm_head"] = 6.0 * static_cast<double>(s.vocab_size * s.dim);
  info.dim = s.dim;
  info.vocab_size = s.vocab_size;
  info.loss_chunk_tokens = s.loss_chunk_tokens;
  // See Note [Activation memory estimate]: two norms' inputs and outputs (4 D),
  // q and the attention output (2 D), k and v (2 kv); SwiGLU keeps w1 x,
  // w3 x and their product (3 H), the GELU MLP its pre- and post-GELU
  // hidden (2 H).
  const double saved = 6.0 * s.dim + 2.0 * kv + (s.gelu_mlp ? 2.0 : 3.0) * s.ffn_hidden;
  // Under "op": the outputs of wq, wk, wv, wo (2 D + 2 kv), of attention's
  // core (D, as flash keeps it), of w1 and w3 (SwiGLU) or w1 (GELU) and of
  // w2 (D).
  const double op_outputs = 4.0 * s.dim + 2.0 * kv + (s.gelu_mlp ? 1.0 : 2.0) * s.ffn_hidden;
  for (int64_t i = 0; i < s.n_layers; ++i) {
    info.module_flops["layers." + std::to_string(i)] = layer_flops;
    LayerInfo l;
    l.saved_values_per_token = saved;
    l.op_output_values_per_token = op_outputs;
    l.layer = i;
    l.attention = s.n_kv_heads == s.n_heads ? "mha" : "gqa";
    l.ffn = s.gelu_mlp ? "gelu" : "swiglu";
    info.layers.push_back(l);
  }
  if (s.learned_positions) info.pinned_first.push_back("pos_embeddings");
  return info;
}

}  // namespace viaduct
