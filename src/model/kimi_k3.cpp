// The kimi_k3 family: flavors, the layer, the part (see Note [Kimi-K3 part
// activations] in kimi_k3.h) and its description.
#include "model/kimi_k3.h"

#include <cmath>
#include <map>

#include "core/check.h"
#include "core/rng.h"
#include "model/families.h"
#include "ops/embedding.h"

namespace viaduct {
namespace {

constexpr const char* kFamily = "kimi_k3";
const std::vector<std::string> kFlavors{"debugmodel", "debugmodel_deep", "full"};

// Flavor presets. The debug shapes are small enough for CPU training; `full`
// has the 93-layer depth (7 blocks of 12 and one of 9) with illustrative
// widths.
KimiK3Options flavor_defaults(const std::string& flavor) {
  KimiK3Options o;
  o.flavor = flavor;
  o.dim = 64;
  o.n_heads = 2;
  o.vocab_size = 320;  // the byte tokenizer's 257 ids plus spare ids
  o.ffn_hidden_dim = 192;
  o.max_seq_len = 2048;
  o.norm_eps = 1e-5;
  o.block_size = 12;
  o.first_k_dense = 1;
  o.moe_ffn = true;
  o.kda = KdaOptions{0, 0, 32, 4, 16, 1e-5};
  o.mla = MlaOptions{};
  o.mla.q_lora_rank = 0;
  o.mla.kv_lora_rank = 32;
  o.mla.qk_nope_head_dim = 16;
  o.mla.qk_rope_head_dim = 8;
  o.mla.v_head_dim = 16;
  o.mla.rope = false;
  o.moe = MoeOptions{0, 8, 2, 64, 1, 1.0, 1e-3};
  o.vis = VisionOptions{};
  o.vis.dim = 32;
  o.vis.image_size = 16;
  o.vis.patch_size = 8;
  if (flavor == "debugmodel") {
    o.n_layers = 24;
  } else if (flavor == "debugmodel_deep") {
    o.n_layers = 33;  // blocks 12 + 12 + 9
  } else if (flavor == "full") {
    o.n_layers = 93;  // 7 x 12 + 9
    o.dim = 2048;
    o.n_heads = 16;
    o.vocab_size = 163840;
    o.ffn_hidden_dim = 9216;
    o.max_seq_len = 8192;
    o.kda.head_dim = 128;
    o.kda.chunk_size = 64;
    o.mla.kv_lora_rank = 512;
    o.mla.qk_nope_head_dim = 128;
    o.mla.qk_rope_head_dim = 64;
    o.mla.v_head_dim = 128;
    o.moe = MoeOptions{0, 128, 8, 1024, 1, 2.446, 1e-3};
    o.vis.dim = 1024;
    o.vis.n_heads = 16;
    o.vis.image_size = 448;
    o.vis.patch_size = 14;
  } else {
    throw unknown_flavor_error(kFamily, flavor, kFlavors);
  }
  return o;
}

std::vector<std::string> all_module_fqns(const KimiK3Options& o) {
  std::vector<std::string> m{"tok_embeddings"};
  if (o.vision) m.push_back("vision_tower");
  for (int64_t i = 0; i < o.n_layers; ++i) m.push_back(str("layers.", i));
  m.push_back("norm");
  m.push_back("lm_head");
  if (o.attn_res) m.push_back("attn_res_final");
  return m;
}

// Sources of each read at a layer: the stack after an opening push, plus the
// partial sum (none in an opening layer's first read).
int64_t first_read_sources(const KimiK3Options& o, int64_t i) {
  return o.block_of(i) + (o.opens_block(i) ? 1 : 2);
}
int64_t second_read_sources(const KimiK3Options& o, int64_t i) {
  return o.block_of(i) + 2;
}

}  // namespace

KimiK3Options kimi_k3_options(const JobConfig& job) {
  const ModelKeys& keys = job.model.keys;
  auto o = flavor_defaults(job.model.flavor);
  o.n_layers = int_or(keys, "model.n_layers", o.n_layers);
  o.dim = int_or(keys, "model.dim", o.dim);
  o.n_heads = int_or(keys, "model.n_heads", o.n_heads);
  o.vocab_size = int_or(keys, "model.vocab_size", o.vocab_size);
  o.ffn_hidden_dim = int_or(keys, "model.ffn_hidden_dim", o.ffn_hidden_dim);
  o.max_seq_len = int_or(keys, "model.max_seq_len", o.max_seq_len);
  o.norm_eps = float_or(keys, "model.norm_eps", o.norm_eps);
  o.block_size = int_or(keys, "model.attn_res_block_size", o.block_size);
  o.first_k_dense = int_or(keys, "model.first_k_dense", o.first_k_dense);
  o.mla_interval = int_or(keys, "model.mla_interval", o.mla_interval);
  o.moe_ffn = bool_or(keys, "model.moe_ffn", o.moe_ffn);
  o.vision = bool_or(keys, "model.vision", o.vision);
  o.attn_res = keys.get_bool("model.attn_res");
  o.synthetic_images = bool_or(keys, "model.synthetic_images", o.synthetic_images);
  o.activation_checkpoint = activation_checkpoint(job.activation_checkpoint);

  o.kda.dim = o.dim;
  o.kda.n_heads = o.n_heads;
  o.kda.head_dim = int_or(keys, "model.kda_head_dim", o.kda.head_dim);
  o.kda.chunk_size = int_or(keys, "model.kda_chunk_size", o.kda.chunk_size);
  o.kda.conv_size = int_or(keys, "model.kda_conv_size", o.kda.conv_size);
  o.kda.norm_eps = o.norm_eps;

  o.mla.dim = o.dim;
  o.mla.n_heads = o.n_heads;
  o.mla.q_lora_rank = int_or(keys, "model.mla_q_lora_rank", o.mla.q_lora_rank);
  o.mla.kv_lora_rank = int_or(keys, "model.mla_kv_lora_rank", o.mla.kv_lora_rank);
  o.mla.qk_nope_head_dim =
      int_or(keys, "model.mla_qk_nope_head_dim", o.mla.qk_nope_head_dim);
  o.mla.qk_rope_head_dim =
      int_or(keys, "model.mla_qk_rope_head_dim", o.mla.qk_rope_head_dim);
  o.mla.v_head_dim = int_or(keys, "model.mla_v_head_dim", o.mla.v_head_dim);
  o.mla.rope = bool_or(keys, "model.mla_rope", o.mla.rope);
  o.mla.max_seq_len = o.max_seq_len;
  o.mla.rope_theta = float_or(keys, "model.rope_theta", o.mla.rope_theta);
  o.mla.norm_eps = o.norm_eps;

  o.moe.dim = o.dim;
  o.moe.n_routed_experts = int_or(keys, "model.n_routed_experts", o.moe.n_routed_experts);
  o.moe.n_activated_experts =
      int_or(keys, "model.n_activated_experts", o.moe.n_activated_experts);
  o.moe.hidden_dim = int_or(keys, "model.moe_hidden_dim", o.moe.hidden_dim);
  o.moe.n_shared_experts = int_or(keys, "model.n_shared_experts", o.moe.n_shared_experts);
  o.moe.route_scale = float_or(keys, "model.moe_route_scale", o.moe.route_scale);
  o.moe.bias_update_rate =
      float_or(keys, "model.moe_bias_update_rate", o.moe.bias_update_rate);
  o.moe.capacity_factor = job.model.moe_capacity_factor;

  o.vis.out_dim = o.dim;
  o.vis.dim = int_or(keys, "model.vision_dim", o.vis.dim);
  o.vis.image_size = int_or(keys, "model.vision_image_size", o.vis.image_size);
  o.vis.patch_size = int_or(keys, "model.vision_patch_size", o.vis.patch_size);
  o.vis.norm_eps = o.norm_eps;
  o.image_token_id = int_or(keys, "model.image_token_id", o.vocab_size - 1);

  auto pos = [&](int64_t v, const char* key) {
    VIADUCT_CHECK_T(ConfigError, v > 0, key, " must be > 0 for kimi_k3, got ",
                    v, " (", job.origin(), ")");
  };
  pos(o.n_layers, "model.n_layers");
  pos(o.dim, "model.dim");
  pos(o.n_heads, "model.n_heads");
  pos(o.block_size, "model.attn_res_block_size");
  pos(o.mla_interval, "model.mla_interval");
  pos(o.kda.chunk_size, "model.kda_chunk_size");
  pos(o.kda.conv_size, "model.kda_conv_size");
  VIADUCT_CHECK_T(ConfigError, o.vocab_size >= 257,
                  "model.vocab_size must be >= 257 (the byte tokenizer), got ",
                  o.vocab_size);
  VIADUCT_CHECK_T(ConfigError, o.first_k_dense >= 0,
                  "model.first_k_dense must be >= 0");
  if (o.vision) {
    VIADUCT_CHECK_T(ConfigError,
                    o.image_token_id >= 257 && o.image_token_id < o.vocab_size,
                    "model.image_token_id (", o.image_token_id,
                    ") must be a spare id in [257, model.vocab_size = ",
                    o.vocab_size, ")");
  }
  VIADUCT_CHECK_T(ConfigError, !o.synthetic_images || o.vision,
                  "model.synthetic_images needs model.vision = true");
  return o;
}

// ---------------------------------------------------------------- layer

KimiK3LayerImpl::KimiK3LayerImpl(const KimiK3Options& o, int64_t layer_id)
    : layer_id_(layer_id),
      attn_res_(o.attn_res),
      opens_block_(o.attn_res && o.opens_block(layer_id)),
      checkpointed_(o.activation_checkpoint.checkpoints(layer_id)),
      keep_op_outputs_(o.activation_checkpoint.mode == ops::ActivationCheckpoint::Mode::kOp) {
  if (attn_res_) {
    attn_res_attn = register_module("attn_res_attn", AttnResRead(o.dim, o.norm_eps));
  }
  attention_norm = register_module("attention_norm", RMSNorm(o.dim, o.norm_eps));
  if (o.is_mla(layer_id)) {
    mla = register_module("attention", Mla(o.mla));
  } else {
    kda = register_module("attention", Kda(o.kda));
  }
  if (attn_res_) {
    attn_res_ffn = register_module("attn_res_ffn", AttnResRead(o.dim, o.norm_eps));
  }
  ffn_norm = register_module("ffn_norm", RMSNorm(o.dim, o.norm_eps));
  if (o.is_moe(layer_id)) {
    moe = register_module("moe", Moe(o.moe));
  } else {
    feed_forward = register_module("feed_forward", SwiGLU(o.dim, o.ffn_hidden_dim));
  }
}

void KimiK3LayerImpl::init_weights(uint64_t seed, const std::string& p,
                                   double std_in, double std_out) {
  if (attn_res_) {
    attn_res_attn->init_weights();
    attn_res_ffn->init_weights();
  }
  attention_norm->reset_parameters();
  ffn_norm->reset_parameters();
  if (mla) mla->init_weights(seed, p + "attention.", std_in, std_out);
  if (kda) kda->init_weights(seed, p + "attention.", std_in, std_out);
  if (moe) moe->init_weights(seed, p + "moe.", std_in, std_out);
  if (feed_forward) {
    feed_forward->init_weights(seed, p + "feed_forward.", std_in, std_out);
  }
}

at::Tensor KimiK3LayerImpl::forward(const at::Tensor& hidden,
                                    std::vector<at::Tensor>& blocks,
                                    std::vector<at::Tensor>* slots,
                                    const ops::DocumentsPtr& documents) {
  // hidden, blocks[i]: [B, T, D]. A recompute runs in the backward, when the
  // part may hold another micro-batch's documents: the bodies keep these.
  if (!attn_res_) {
    if (!checkpointed_) return forward_plain(hidden, documents.get());
    auto body = [this, documents](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{forward_plain(in[0], documents.get())};
    };
    return ops::recompute(body, {hidden}, parameters(), keep_op_outputs_).at(0);
  }
  at::Tensor partial;
  if (opens_block_) {  // the incoming block is complete
    if (slots != nullptr) {
      slots->push_back(attn_res_new_slot(hidden));
      blocks.push_back(attn_res_block_sink(hidden, slots->back()));
    } else {
      blocks.push_back(hidden);
    }
  } else {
    partial = hidden;
  }
  if (!checkpointed_) return forward_sublayers(blocks, partial, slots, documents.get());
  // See Note [Activation checkpointing]: the block push (the sink and its slot)
  // stays outside; the region's inputs are the stack and the partial sum,
  // and the recompute's reads add into the same slots.
  std::vector<at::Tensor> inputs = blocks;
  if (partial.defined()) inputs.push_back(partial);
  const bool with_slots = slots != nullptr;
  auto body = [this, n_blocks = blocks.size(), has_partial = partial.defined(), with_slots,
               body_slots = with_slots ? *slots : std::vector<at::Tensor>(), documents](
                  const std::vector<at::Tensor>& in) {
    const std::vector<at::Tensor> stack(in.begin(),
                                        in.begin() + static_cast<std::ptrdiff_t>(n_blocks));
    return std::vector<at::Tensor>{forward_sublayers(
        stack, has_partial ? in.back() : at::Tensor(), with_slots ? &body_slots : nullptr,
        documents.get())};
  };
  return ops::recompute(body, inputs, parameters(), keep_op_outputs_).at(0);
}

at::Tensor KimiK3LayerImpl::mix(const at::Tensor& n, const ops::Documents* documents) {
  return mla ? mla(n, documents) : kda(n, documents);
}

at::Tensor KimiK3LayerImpl::forward_plain(const at::Tensor& hidden,
                                          const ops::Documents* documents) {
  // Plain residuals: h = h + attention(norm(h)); h = h + ffn(norm(h)).
  auto n = attention_norm(hidden);
  auto h = hidden + mix(n, documents);
  n = ffn_norm(h);
  return h + (moe ? moe(n) : feed_forward(n));
}

at::Tensor KimiK3LayerImpl::forward_sublayers(const std::vector<at::Tensor>& blocks,
                                              at::Tensor partial,
                                              const std::vector<at::Tensor>* slots,
                                              const ops::Documents* documents) {
  // With slots, the partial sums have theirs too (see Note [AttnRes partial
  // sums in place]): the incoming one as a sink, each sum through
  // attn_res_partial_add.
  const bool with_slots = slots != nullptr;
  at::Tensor partial_slot;
  auto sink = [&](const at::Tensor& t) {  // t becomes the partial sum, with a slot
    partial_slot = attn_res_new_slot(t);
    partial = attn_res_block_sink(t, partial_slot);
  };
  if (with_slots && partial.defined() && partial.requires_grad()) sink(partial);
  auto add = [&](const at::Tensor& x) {
    if (!partial_slot.defined()) {
      partial = partial.defined() ? partial + x : x;
      return;
    }
    auto out_slot = attn_res_new_slot(x);
    partial = attn_res_partial_add(partial, partial_slot, x, out_slot);
    partial_slot = out_slot;
  };
  std::vector<at::Tensor> sources = blocks;
  if (partial.defined()) sources.push_back(partial);
  // The read's slots: the blocks', then the partial sum's.
  std::vector<at::Tensor> read_slots;
  if (with_slots) {
    read_slots = *slots;
    read_slots.resize(sources.size());
    if (partial.defined()) read_slots.back() = partial_slot;
  }
  const bool trace = trace_ != nullptr && !ops::recomputing();
  if (trace) trace_->push_back(sources);
  auto n = attn_res_attn->forward_normed(sources, with_slots ? &read_slots : nullptr,
                                         *attention_norm);
  auto a = mix(n, documents);
  if (with_slots && !partial.defined() && a.requires_grad()) {
    sink(a);  // an opening layer's partial sum is a itself
  } else {
    add(a);
  }
  sources = blocks;
  sources.push_back(partial);
  if (with_slots) {
    read_slots.resize(sources.size());
    read_slots.back() = partial_slot;
  }
  if (trace) trace_->push_back(sources);
  n = attn_res_ffn->forward_normed(sources, with_slots ? &read_slots : nullptr, *ffn_norm);
  auto f = moe ? moe(n) : feed_forward(n);
  add(f);
  return partial;
}

// ---------------------------------------------------------------- part

KimiK3Part::KimiK3Part(const KimiK3Options& o,
                       const std::vector<std::string>& fqns)
    : opts_(o) {
  module_fqns_ = select_modules(all_module_fqns(o), fqns, kFamily);
  std::map<std::string, bool> held;
  for (const auto& m : module_fqns_) held[m] = true;
  auto has = [&](const char* m) { return held.count(m) > 0; };
  const int n_head = has("norm") + has("lm_head") + has("attn_res_final");
  const int head_modules = o.attn_res ? 3 : 2;
  VIADUCT_CHECK_T(ConfigError, n_head == 0 || n_head == head_modules,
                  o.attn_res ? "kimi_k3: norm, lm_head and attn_res_final must "
                               "sit on the same part (the final AttnRes read "
                               "feeds the norm)"
                             : "kimi_k3: norm and lm_head must sit on the same part");
  VIADUCT_CHECK_T(ConfigError, !has("vision_tower") || has("tok_embeddings"),
                  "kimi_k3: vision_tower must sit with tok_embeddings");
  has_first_ = has("tok_embeddings");
  has_last_ = n_head == head_modules;
  if (has_first_) {
    tok_embeddings = register_module(
        "tok_embeddings", torch::nn::Embedding(o.vocab_size, o.dim));
  }
  if (has("vision_tower")) {
    vision_tower = register_module("vision_tower", VisionTower(o.vis));
  }
  std::shared_ptr<torch::nn::Module> container;
  for (int64_t i = 0; i < o.n_layers; ++i) {
    if (!held.count(str("layers.", i))) continue;
    if (!container) {
      container = register_module("layers", std::make_shared<torch::nn::Module>());
    }
    auto layer = KimiK3Layer(o, i);
    container->register_module(std::to_string(i), layer.ptr());
    layers_.push_back(layer);
  }
  if (has_last_) {
    norm = register_module("norm", RMSNorm(o.dim, o.norm_eps));
    lm_head = make_linear(*this, "lm_head", o.dim, o.vocab_size, false);
    if (o.attn_res) {
      attn_res_final = register_module("attn_res_final", AttnResRead(o.dim, o.norm_eps));
    }
  }
}

void KimiK3Part::init_weights(uint64_t seed) {
  const double std_in = 0.02;
  const double std_out = 0.02 / std::sqrt(2.0 * static_cast<double>(opts_.n_layers));
  if (tok_embeddings) {
    init_normal_(tok_embeddings->weight, 1.0, seed, "tok_embeddings.weight");
  }
  if (vision_tower) vision_tower->init_weights(seed, "vision_tower.");
  for (auto& layer : layers_) {
    layer->init_weights(seed, str("layers.", layer->layer_id_, "."), std_in,
                        std_out);
  }
  if (has_last_) {
    norm->reset_parameters();
    if (attn_res_final) attn_res_final->init_weights();
    const double s = 1.0 / std::sqrt(static_cast<double>(opts_.dim));
    init_trunc_normal_(lm_head->weight, s, -3 * s, 3 * s, seed, "lm_head.weight");
  }
}

void KimiK3Part::after_optimizer_step() {
  for (auto& layer : layers_) {
    if (layer->moe && layer->moe->opts_.bias_update_rate > 0) {
      layer->moe->update_bias();
    }
  }
}

std::vector<std::pair<std::string, at::Tensor>> KimiK3Part::extra_state() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& b : named_buffers(/*recurse=*/true)) {
    const auto& k = b.key();
    if (k.size() >= 11 && k.compare(k.size() - 11, 11, "expert_bias") == 0) {
      out.emplace_back(k, b.value());
    }
  }
  return out;
}

std::vector<at::Tensor> KimiK3Part::replica_statistics() {
  std::vector<at::Tensor> out;
  for (auto& layer : layers_) {
    if (layer->moe) out.push_back(layer->moe->tokens_per_expert);
  }
  return out;
}

at::Tensor KimiK3Part::synthetic_images(int64_t batch) const {
  // A fixed smooth pattern per row, independent of the tokens (no leak of the
  // targets): [B, 1, C, S, S].
  const auto C = opts_.vis.channels, S = opts_.vis.image_size;
  auto grid = at::arange(C * S * S, at::kFloat).view({1, 1, C, S, S});
  auto row = at::arange(batch, at::kFloat).view({batch, 1, 1, 1, 1});
  return at::sin(grid * 0.37 + row * 1.3);
}

Activations KimiK3Part::forward(const Activations& in) {
  at::Tensor hidden;
  std::vector<at::Tensor> blocks;
  if (has_first_) {
    VIADUCT_CHECK(!in.empty() && in[0].dim() == 2 &&
                      in[0].scalar_type() == at::kLong,
                  "kimi_k3: the first part takes {tokens [B, T] int64"
                  "[, images]}");
    const auto& tokens = in[0];
    auto h = ops::embedding(tok_embeddings->weight, tokens, kernel_options_);  // [B, T, D]
    if (vision_tower) {
      if (in.size() > 1) {
        auto patches = vision_tower(in[1].to(h.device()));
        h = merge_image_embeddings(h, tokens, patches, opts_.image_token_id);
      } else if (opts_.synthetic_images) {
        // Demo: one synthetic image over the first patches of each sequence.
        const auto P = opts_.vis.patches(), T = h.size(1);
        VIADUCT_CHECK(T > P, "kimi_k3 synthetic images need seq_len > ", P);
        auto images = synthetic_images(h.size(0)).to(h.device());
        auto patches = vision_tower(images);  // [B, P, D]
        h = at::cat({patches.to(h.scalar_type()), h.narrow(1, P, T - P)}, 1);
      }
    }
    hidden = h.to(compute_dtype_);
  } else {
    VIADUCT_CHECK(!in.empty(),
                  "kimi_k3: a middle part takes {hidden, block_0, ...}");
    VIADUCT_CHECK(opts_.attn_res || in.size() == 1,
                  "kimi_k3 without AttnRes: a middle part takes {hidden}, got ",
                  in.size(), " tensors");
    hidden = in[0];
    blocks.assign(in.begin() + 1, in.end());
  }
  // See Note [AttnRes block gradients in place]: while autograd records, every
  // block on the stack is a sink with a slot, and a middle part's outputs
  // go through the seed.
  const bool in_place = opts_.attn_res && opts_.attn_res_grad_in_place &&
                        at::GradMode::is_enabled();
  std::vector<at::Tensor> slots;
  if (in_place) {
    for (auto& b : blocks) {
      slots.push_back(b.requires_grad() ? attn_res_new_slot(b) : at::Tensor());
      if (slots.back().defined()) b = attn_res_block_sink(b, slots.back());
    }
  }
  for (auto& layer : layers_) {
    const int64_t expected =  // without AttnRes the stack stays empty
        opts_.attn_res ? opts_.block_of(layer->layer_id_) + (layer->opens_block_ ? 0 : 1)
                       : 0;
    VIADUCT_CHECK(static_cast<int64_t>(blocks.size()) == expected,
                  "kimi_k3: layers.", layer->layer_id_, " expects ", expected,
                  " completed blocks on the stack, got ", blocks.size());
    hidden = layer(hidden, blocks, in_place ? &slots : nullptr, documents_);
  }
  if (has_last_ && !opts_.attn_res) return {linear(norm(hidden), lm_head, kernel_options_)};
  if (has_last_) {
    std::vector<at::Tensor> sources = blocks;
    sources.push_back(hidden);
    auto read_slots = slots;
    read_slots.resize(sources.size());
    auto out = attn_res_final->forward_normed(sources, in_place ? &read_slots : nullptr, *norm);
    return {linear(out, lm_head, kernel_options_)};  // [B, T, V]
  }
  Activations out{hidden};
  out.insert(out.end(), blocks.begin(), blocks.end());
  if (in_place && !slots.empty()) {
    std::vector<at::Tensor> out_slots{at::Tensor()};
    out_slots.insert(out_slots.end(), slots.begin(), slots.end());
    out = attn_res_seed(out, out_slots);
  }
  return out;
}

// ---------------------------------------------------------------- family

namespace {

// See Note [Activation memory estimate] for one layer, in values of the
// compute dtype (bf16: an fp32 tensor counts twice): the two norms' inputs
// and outputs (4 D); MLA keeps its low-rank latents, q, k, v and the
// attention output; a MoE layer each routed token's copy of x, its expert's
// w1 x, w3 x and product and its weighted output, the router's scores and
// the shared experts' SwiGLU; a dense layer its SwiGLU. KDA (hk = H dk,
// chunk C) as its kernels run it: the short convolutions' inputs and
// pre-activations (6 hk; q's and k's convolution and L2 norm keep nothing
// between them), the decay's input (hk: the kernel recomputes softplus),
// the output gate's logits (hk) and the output norm's input in fp32 (2 hk:
// one kernel for both) and the output projection's input (hk), the two
// low-rank maps' outputs (2 dk) and beta in fp32 (2 H); and the chunk
// scan's saved set, fp32 but v (in the compute dtype, which its kernels
// read as it is): q, k, g (6 hk), v (hk), the two WY terms (4 hk),
// q and k with their decay applied (4 hk), v' (2 hk), three C x C matrices
// per chunk and head (6 C H) and the chunk states (2 hk dk / C). AttnRes reads are left out (their sources are the block
// stack). saved_values_per_token below sums these per layer.

// The chunk scan's saved set (see above), which "op" keeps as well.
double kda_scan_saved_values_per_token(const KdaOptions& k) {
  const double hk = static_cast<double>(k.n_heads * k.head_dim);
  const double H = static_cast<double>(k.n_heads), dk = static_cast<double>(k.head_dim);
  const double C = static_cast<double>(k.chunk_size);
  return 17.0 * hk + 6.0 * C * H + 2.0 * hk * dk / C + 2.0 * H;
}

double kda_saved_values_per_token(const KdaOptions& k) {
  const double hk = static_cast<double>(k.n_heads * k.head_dim);
  const double H = static_cast<double>(k.n_heads), dk = static_cast<double>(k.head_dim);
  return 11.0 * hk + 2.0 * dk + 2.0 * H + kda_scan_saved_values_per_token(k);
}

double saved_values_per_token(const KimiK3Options& o, int64_t layer) {
  const double D = static_cast<double>(o.dim);
  double v = 4.0 * D;
  if (o.is_mla(layer)) {
    const auto& m = o.mla;
    const double qk = static_cast<double>(m.qk_nope_head_dim + m.qk_rope_head_dim);
    v += static_cast<double>(m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim);
    v += static_cast<double>(m.n_heads) * (2.0 * qk + 2.0 * static_cast<double>(m.v_head_dim));
  } else {
    v += kda_saved_values_per_token(o.kda);
  }
  if (o.is_moe(layer)) {
    const auto& e = o.moe;
    const double h = static_cast<double>(e.hidden_dim);
    v += static_cast<double>(e.n_activated_experts) * (2.0 * D + 3.0 * h) +
         static_cast<double>(e.n_routed_experts) + 3.0 * h * static_cast<double>(e.n_shared_experts);
  } else {
    v += 3.0 * static_cast<double>(o.ffn_hidden_dim);
  }
  return v;
}

// See Note [Activation memory estimate] for one layer under "op" (see Note [Per-op
// activation checkpointing]): the outputs of its linear projections -- MLA's
// q (through the q latent where there is one), kv latent, k/v and wo; KDA's
// q, k, v, the decay and gate low-rank pairs, beta and o_proj -- KDA's chunk
// scan with its whole saved set (the op keeps its node), a MoE
// layer's router scores, each routed token's w1 x, w3 x and w2 output, and
// the shared experts' three; a dense layer its SwiGLU's three.
double op_output_values_per_token(const KimiK3Options& o, int64_t layer) {
  const double D = static_cast<double>(o.dim);
  double v = 0;
  if (o.is_mla(layer)) {
    const auto& m = o.mla;
    const double qk = static_cast<double>(m.qk_nope_head_dim + m.qk_rope_head_dim);
    const double H = static_cast<double>(m.n_heads);
    v += static_cast<double>(m.q_lora_rank) + H * qk;
    v += static_cast<double>(m.kv_lora_rank + m.qk_rope_head_dim);
    v += H * static_cast<double>(m.qk_nope_head_dim + m.v_head_dim) + D;
  } else {
    const auto& k = o.kda;
    const double hd = static_cast<double>(k.n_heads * k.head_dim);
    v += 5.0 * hd + 2.0 * static_cast<double>(k.head_dim) + static_cast<double>(k.n_heads) + D;
    v += kda_scan_saved_values_per_token(k);
  }
  if (o.is_moe(layer)) {
    const auto& e = o.moe;
    const double h = static_cast<double>(e.hidden_dim);
    v += static_cast<double>(e.n_routed_experts) +
         static_cast<double>(e.n_activated_experts) * (2.0 * h + D);
    if (e.n_shared_experts > 0) v += 2.0 * h * static_cast<double>(e.n_shared_experts) + D;
  } else {
    v += 2.0 * static_cast<double>(o.ffn_hidden_dim) + D;
  }
  return v;
}

// Counts are analytic (the full flavor is far too large to build); a test
// checks them against built debug models.
ModelInfo describe_kimi_k3(const JobConfig& job) {
  const auto o = kimi_k3_options(job);
  const int64_t D = o.dim, V = o.vocab_size;
  const int64_t T = job.training.seq_len;
  ModelInfo info;
  info.family = kFamily;
  info.flavor = o.flavor;
  info.n_layers = o.n_layers;
  info.embedding_params = V * D;
  info.dim = D;
  info.vocab_size = V;
  int64_t params = V * D, active = V * D;
  if (o.vision) {
    params += VisionTowerImpl::count_params(o.vis);  // image tokens only
    info.pinned_first.push_back("vision_tower");
  }
  // Note [Kimi-K3 FLOPs per token]
  // flops_per_token = 6 (N_active - N_embedding)
  //   + sum over MLA layers of 6 T H (qk_head_dim + v_head_dim)
  //   + sum over KDA layers of KdaImpl::mixing_flops (chunked form, 3 x fwd)
  //   + sum over AttnRes reads of 3 x 6 D n_sources (none with
  //     model.attn_res = false).
  // N_active counts each MoE layer's router, top-k and shared experts; the
  // vision tower is left out (it runs on image tokens only). The MLA terms
  // are the attention part (MlaImpl::attention_flops_per_pair x T); KDA's
  // and the reads' do not grow with T and count outside it.
  double mixing = 0;       // outside attention: KDA and the AttnRes reads
  double pair_flops = 0;   // the MLA layers' per (query, key) pair
  for (int64_t i = 0; i < o.n_layers; ++i) {
    LayerInfo li;
    li.layer = i;
    li.attention = o.is_mla(i) ? "mla" : "kda";
    li.ffn = o.is_moe(i) ? "moe" : "dense";
    li.block = o.attn_res ? o.block_of(i) : -1;
    li.opens_block = o.attn_res && o.opens_block(i);
    li.saved_values_per_token = saved_values_per_token(o, i);
    li.op_output_values_per_token = op_output_values_per_token(o, i);
    info.layers.push_back(li);
    int64_t common = 2 * D;  // norms
    if (o.attn_res) common += 2 * AttnResReadImpl::count_params(D);
    common += o.is_mla(i) ? MlaImpl::count_params(o.mla)
                          : KdaImpl::count_params(o.kda);
    params += common;
    active += common;
    int64_t layer_active = common;
    if (o.is_moe(i)) {
      params += MoeImpl::count_params(o.moe);
      info.routed_expert_params += 3 * o.moe.n_routed_experts * o.moe.dim * o.moe.hidden_dim;
      info.routed_experts = o.moe.n_routed_experts;
      info.experts_per_token = o.moe.n_activated_experts;
      active += MoeImpl::active_params(o.moe);
      layer_active += MoeImpl::active_params(o.moe);
    } else {
      params += 3 * D * o.ffn_hidden_dim;
      active += 3 * D * o.ffn_hidden_dim;
      layer_active += 3 * D * o.ffn_hidden_dim;
    }
    const double layer_pair = o.is_mla(i) ? MlaImpl::attention_flops_per_pair(o.mla) : 0.0;
    double layer_mixing = o.is_mla(i) ? 0.0 : KdaImpl::mixing_flops(o.kda);
    if (o.attn_res) {
      layer_mixing += 3 * (attn_res_read_flops(first_read_sources(o, i), D) +
                           attn_res_read_flops(second_read_sources(o, i), D));
    }
    mixing += layer_mixing;
    pair_flops += layer_pair;
    info.module_flops["layers." + std::to_string(i)] =
        6.0 * static_cast<double>(layer_active) + layer_mixing +
        layer_pair * static_cast<double>(T);
  }
  const int64_t head = D + D * V + (o.attn_res ? AttnResReadImpl::count_params(D) : 0);
  params += head;
  active += head;
  info.module_flops["norm"] = 6.0 * static_cast<double>(D);
  info.module_flops["lm_head"] = 6.0 * static_cast<double>(D * V);
  if (o.attn_res) {
    const int64_t n_blocks = (o.n_layers + o.block_size - 1) / o.block_size;
    mixing += 3 * attn_res_read_flops(n_blocks + 1, D);
    info.pinned_last.push_back("attn_res_final");
    info.module_flops["attn_res_final"] =
        6.0 * static_cast<double>(AttnResReadImpl::count_params(D)) +
        3 * attn_res_read_flops(n_blocks + 1, D);
  }
  info.params = params;
  info.active_params = active;
  info.flops_per_token_outside_attention =
      6.0 * static_cast<double>(active - info.embedding_params) + mixing;
  info.attention_flops_per_pair = pair_flops;
  info.flops_per_token = info.flops_per_token_outside_attention +
                         pair_flops * static_cast<double>(T);
  return info;
}

}  // namespace

ModelFamily kimi_k3_family() {
  ModelFamily f;
  f.name = kFamily;
  f.flavors = kFlavors;
  f.module_fqns = [](const JobConfig& job) { return all_module_fqns(kimi_k3_options(job)); };
  f.build = [](const JobConfig& job,
               const std::vector<std::string>& fqns) -> std::shared_ptr<ModelPart> {
    return std::make_shared<KimiK3Part>(kimi_k3_options(job), fqns);
  };
  f.describe = describe_kimi_k3;
  f.model_keys = {"model.n_layers", "model.dim", "model.n_heads", "model.vocab_size",
                  "model.ffn_hidden_dim", "model.max_seq_len", "model.norm_eps",
                  "model.attn_res", "model.attn_res_block_size", "model.first_k_dense",
                  "model.mla_interval", "model.moe_ffn", "model.vision",
                  "model.synthetic_images", "model.kda_head_dim", "model.kda_chunk_size",
                  "model.kda_conv_size", "model.mla_q_lora_rank", "model.mla_kv_lora_rank",
                  "model.mla_qk_nope_head_dim", "model.mla_qk_rope_head_dim",
                  "model.mla_v_head_dim", "model.mla_rope", "model.rope_theta",
                  "model.n_routed_experts", "model.n_activated_experts", "model.moe_hidden_dim",
                  "model.n_shared_experts", "model.moe_route_scale",
                  "model.moe_bias_update_rate", "model.moe_capacity_factor", "model.vision_dim",
                  "model.vision_image_size", "model.vision_patch_size", "model.image_token_id",
                  "model.cuda_kernels", "model.swiglu_recompute", "model.attn_mask_type",
                  "model.reset_position_ids"};
  f.routed_experts = [](const JobConfig& job) -> int64_t {
    const auto o = kimi_k3_options(job);
    return o.moe_ffn && o.n_layers > o.first_k_dense ? o.moe.n_routed_experts : 0;
  };
  f.attn_res = [](const JobConfig& job) -> std::optional<AttnResLayout> {
    const auto o = kimi_k3_options(job);
    if (!o.attn_res) return std::nullopt;  // a chain (see Note [Kimi-K3 part activations])
    return AttnResLayout{o.n_layers, o.block_size, o.dim};
  };
  f.image_input = [](const JobConfig& job) -> std::optional<ImageInput> {
    const auto o = kimi_k3_options(job);
    if (!o.vision) return std::nullopt;
    return ImageInput{o.vis.patches(), o.image_token_id, o.vis.channels, o.vis.image_size};
  };
  return f;
}

}  // namespace viaduct
