// The exact16 model family (see Note [exact16: integer gradients] in
// exact16.h): options and refusals, the part, and its registry entry.
#include "model/exact16.h"

#include <cmath>
#include <map>
#include <set>

#include "core/check.h"
#include "core/rng.h"
#include "model/families.h"

namespace viaduct {
namespace {

constexpr const char* kFamily = "exact16";
constexpr const char* kFlavor = "debugmodel";  // the family's one shape
constexpr double kExactLimit = 16777216.0;  // 2^24: fp32 integers are exact below

std::vector<std::string> all_module_fqns(const Exact16Options& o) {
  std::vector<std::string> m{"tok_embeddings"};
  for (int64_t i = 0; i < o.n_layers; ++i) m.push_back(str("layers.", i));
  m.push_back("lm_head");
  m.push_back("attn_res_final");
  return m;
}

// The read: the sources summed in stack order, the partial sum last.
at::Tensor read(const std::vector<at::Tensor>& stack, const at::Tensor& partial) {
  // stack[n], partial: [B, T, D]
  at::Tensor h = stack.at(0);
  for (size_t n = 1; n < stack.size(); ++n) h = h + stack[n];
  return partial.defined() ? h + partial : h;
}

}  // namespace

float exact16_scale(int64_t layer, int64_t channel, bool ffn) {
  // Mostly zeros, so the integers stay small; -2 flips the sign of the path
  // through the sublayer (1 + -2 = -1), so block gradients mix signs.
  static constexpr float kAttention[5] = {0, 1, 0, 0, -2};
  static constexpr float kFfn[5] = {1, 0, 0, -2, 0};
  return ffn ? kFfn[(layer + 2 * channel) % 5] : kAttention[(layer + channel) % 5];
}

double exact16_gradient_bound(const Exact16Options& o) {
  // The backward of see Note [exact16: integer gradients] per channel at one
  // counted token, in units of the loss scale: signed values for the
  // recurrence, magnitudes summed per stack entry for the bound.
  double bound = 1;
  for (int64_t d = 0; d < o.dim; ++d) {
    const auto N = static_cast<size_t>(o.n_entries());
    std::vector<double> g(N, 1.0), mag(N, 1.0);  // the final read
    double gh = 1;                                // into the final read
    for (int64_t j = o.n_layers - 1; j >= 0; --j) {
      const auto c = static_cast<size_t>(o.block_of(j));
      const double g_out = gh;
      const double g_h2 = exact16_scale(j, d, true) * g_out;
      const double g_p2 = g_out + g_h2;
      const double g_h1 = exact16_scale(j, d, false) * g_p2;
      for (size_t n = 0; n <= c; ++n) {
        g[n] += g_h2 + g_h1;
        mag[n] += std::abs(g_h2) + std::abs(g_h1);
        bound = std::max(bound, mag[n]);
      }
      gh = o.opens_block(j) ? g[c] : g_p2 + g_h1;
      bound = std::max({bound, std::abs(g_out) + std::abs(g_h2),
                        std::abs(g_p2) + std::abs(g_h1)});
    }
  }
  return bound;
}

Exact16Options exact16_options(const JobConfig& job) {
  const ModelKeys& keys = job.model.keys;
  // Every other model key belongs to the K3 hybrid; a switch set to what
  // exact16 is anyway is fine (configs/kimi_k3_debug.toml sets vision = false).
  static const std::set<std::string> kShape{"model.family", "model.flavor", "model.n_layers",
                                            "model.dim", "model.vocab_size",
                                            "model.attn_res_block_size"};
  static const std::map<std::string, bool> kSwitches{{"model.vision", false},
                                                     {"model.synthetic_images", false},
                                                     {"model.moe_ffn", false},
                                                     {"model.attn_res", true}};
  for (const auto& key : ModelKeys::names()) {
    if (kShape.count(key) || !keys.is_set(key)) continue;
    auto sw = kSwitches.find(key);
    if (sw != kSwitches.end() && keys.get_bool(key) == sw->second) continue;
    if (key == "model.loss_chunk_tokens" && keys.get_int(key) == 0) continue;
    if (key == "model.attn_mask_type" && !job.model.block_causal()) continue;
    throw ConfigError(str(
        key,
        sw != kSwitches.end() ? str(" = ", sw->second ? "false" : "true") : std::string(),
        " (", job.origin(), ") does not apply to ", kFamily,
        ": it is the integer-gradient AttnRes model (no KDA, MLA, MoE, vision, "
        "norms or cross-entropy) and takes only model.n_layers, model.dim, "
        "model.vocab_size and model.attn_res_block_size"));
  }
  Exact16Options o;
  o.activation_checkpoint = activation_checkpoint(job.activation_checkpoint);
  o.n_layers = int_or(keys, "model.n_layers", o.n_layers);
  o.block_size = int_or(keys, "model.attn_res_block_size", o.block_size);
  o.dim = int_or(keys, "model.dim", o.dim);
  o.vocab_size = int_or(keys, "model.vocab_size", o.vocab_size);
  for (const auto& [v, key] : {std::pair{o.n_layers, "model.n_layers"},
                               std::pair{o.dim, "model.dim"},
                               std::pair{o.block_size, "model.attn_res_block_size"}}) {
    VIADUCT_CHECK_T(ConfigError, v > 0, key, " must be > 0 for ", kFamily, ", got ", v, " (",
                    job.origin(), ")");
  }
  VIADUCT_CHECK_T(ConfigError, o.vocab_size >= 257,
                  "model.vocab_size must be >= 257 (the byte tokenizer), got ", o.vocab_size);
  const double bound = exact16_gradient_bound(o);
  VIADUCT_CHECK_T(ConfigError, bound < kExactLimit, kFamily, " with model.n_layers = ",
                  o.n_layers, " and model.attn_res_block_size = ", o.block_size,
                  ": its block-gradient sums reach ", bound,
                  " x the loss scale, past 2^24 where float32 stops holding "
                  "integers exactly; use fewer layers");
  return o;
}

void check_exact16_training(const JobConfig& job) {
  VIADUCT_CHECK_T(ConfigError, job.training.dtype != "bfloat16", kFamily,
                  " computes in float32 (its gradients are exact integers); "
                  "training.dtype = \"bfloat16\" would round them (",
                  job.origin(), ")");
  const int64_t b = job.training.local_batch_size;
  const int64_t t = job.training.seq_len;
  const int64_t dp = job.parallelism.data_parallel_degree;
  const int64_t a = job.training.gradient_accumulation_steps;
  const int64_t tokens = b * t * dp * a;
  VIADUCT_CHECK_T(ConfigError, tokens > 0 && (tokens & (tokens - 1)) == 0, kFamily,
                  " needs a power-of-two token count per step, so that the loss "
                  "scale 1 / tokens keeps every gradient exact: "
                  "training.local_batch_size (", b, ") x training.seq_len (", t,
                  ") x parallelism.data_parallel_degree (", dp,
                  ") x training.gradient_accumulation_steps (", a, ") = ", tokens,
                  " (", job.origin(), ")");
}

// ---------------------------------------------------------------- part

Exact16MixImpl::Exact16MixImpl(int64_t layer, int64_t dim, bool ffn) {
  auto s = at::empty({dim}, at::kFloat);
  for (int64_t d = 0; d < dim; ++d) s[d] = exact16_scale(layer, d, ffn);
  scale = register_buffer("scale", s);
  bias = register_parameter("bias", at::zeros({dim}, at::kFloat));
}

Exact16Part::Exact16Part(const Exact16Options& o, const std::vector<std::string>& fqns)
    : opts_(o) {
  module_fqns_ = select_modules(all_module_fqns(o), fqns, kFamily);
  std::set<std::string> held(module_fqns_.begin(), module_fqns_.end());
  const int n_head = static_cast<int>(held.count("lm_head") + held.count("attn_res_final"));
  VIADUCT_CHECK_T(ConfigError, n_head != 1, kFamily,
                  ": lm_head and attn_res_final must sit on the same part "
                  "(the final read feeds the readout)");
  has_first_ = held.count("tok_embeddings") > 0;
  has_last_ = n_head == 2;
  if (has_first_) {
    tok_embeddings = register_module("tok_embeddings",
                                     torch::nn::Embedding(o.vocab_size, o.dim));
  }
  std::shared_ptr<torch::nn::Module> container;
  for (int64_t i = 0; i < o.n_layers; ++i) {
    if (!held.count(str("layers.", i))) continue;
    if (!container) container = register_module("layers", std::make_shared<torch::nn::Module>());
    auto layer = std::make_shared<torch::nn::Module>();
    Layer l{i, Exact16Mix(i, o.dim, false), Exact16Mix(i, o.dim, true)};
    layer->register_module("attention", l.attention.ptr());
    layer->register_module("feed_forward", l.feed_forward.ptr());
    container->register_module(std::to_string(i), layer);
    layers_.push_back(l);
  }
}

void Exact16Part::init_weights(uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto integers = [&](at::Tensor t, int64_t lo, int64_t hi, const std::string& fqn) {
    auto gen = make_generator(seed, fqn);
    t.copy_(at::randint(lo, hi + 1, t.sizes(), gen, at::TensorOptions().dtype(at::kFloat)));
  };
  if (tok_embeddings) integers(tok_embeddings->weight, -2, 2, "tok_embeddings.weight");
  for (const auto& l : layers_) {
    integers(l.attention->bias, -1, 1, str("layers.", l.id, ".attention.bias"));
    integers(l.feed_forward->bias, -1, 1, str("layers.", l.id, ".feed_forward.bias"));
  }
}

at::Tensor Exact16Part::layer_forward(const Layer& l, const at::Tensor& hidden,
                                      std::vector<at::Tensor>& stack,
                                      int64_t forward_index) {
  at::Tensor partial;
  if (opts_.opens_block(l.id)) {
    stack.push_back(hidden);  // the incoming block is complete
    const auto entry = static_cast<int64_t>(stack.size()) - 1;
    if (probe_ && forward_index >= 0 && hidden.requires_grad()) {
      hidden.register_hook([probe = probe_, forward_index, entry](const at::Tensor& g) {
        probe(forward_index, entry, g);
      });
    }
  } else {
    partial = hidden;
  }
  const Layer* layer = &l;
  auto sublayers = [layer](const std::vector<at::Tensor>& st, at::Tensor p) {
    auto a = layer->attention->forward(read(st, p));
    p = p.defined() ? p + a : a;
    return p + layer->feed_forward->forward(read(st, p));
  };
  if (!opts_.activation_checkpoint.checkpoints(l.id)) return sublayers(stack, partial);
  // See Note [Activation checkpointing]: the region's inputs are the stack and
  // the partial sum; the push (and the probe's hook) stay outside.
  std::vector<at::Tensor> inputs = stack;
  if (partial.defined()) inputs.push_back(partial);
  auto body = [sublayers, n = stack.size(), has_partial = partial.defined()](
                  const std::vector<at::Tensor>& in) {
    const std::vector<at::Tensor> st(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(n));
    return std::vector<at::Tensor>{sublayers(st, has_partial ? in.back() : at::Tensor())};
  };
  auto params = l.attention->parameters();
  for (const auto& p : l.feed_forward->parameters()) params.push_back(p);
  return ops::recompute(opts_.activation_checkpoint, body, inputs, params).at(0);
}

Activations Exact16Part::forward(const Activations& in) {
  VIADUCT_CHECK_T(ConfigError, compute_dtype_ == at::kFloat, kFamily,
                  " computes in float32 only (its gradients are exact integers); set "
                  "training.dtype = \"float32\"");
  const int64_t index = at::GradMode::is_enabled() ? grad_forwards_++ : -1;
  at::Tensor hidden;
  std::vector<at::Tensor> stack;
  if (has_first_) {
    VIADUCT_CHECK(!in.empty() && in[0].dim() == 2 && in[0].scalar_type() == at::kLong, kFamily,
                  ": the first part takes {tokens [B, T] int64}");
    hidden = at::embedding(tok_embeddings->weight, in[0]);  // [B, T, D]
  } else {
    VIADUCT_CHECK(!in.empty(), kFamily, ": a middle part takes {hidden, e_0, ...}");
    hidden = in[0];
    stack.assign(in.begin() + 1, in.end());
  }
  for (const auto& l : layers_) {
    const auto expected = opts_.block_of(l.id) + (opts_.opens_block(l.id) ? 0 : 1);
    VIADUCT_CHECK(static_cast<int64_t>(stack.size()) == expected, kFamily, ": layers.", l.id,
                  " expects ", expected, " completed blocks on the stack, got ", stack.size());
    hidden = layer_forward(l, hidden, stack, index);
  }
  if (has_last_) {
    VIADUCT_CHECK(static_cast<int64_t>(stack.size()) == opts_.n_entries(), kFamily,
                  ": the final read expects ", opts_.n_entries(), " stack entries, got ",
                  stack.size());
    return {read(stack, hidden).sum(-1)};  // agg [B, T, D] -> readout [B, T]
  }
  Activations out{hidden};
  out.insert(out.end(), stack.begin(), stack.end());
  return out;
}

at::Tensor Exact16Part::forward_loss(const Activations& inputs, const at::Tensor& targets) {
  auto readout = forward(inputs).at(0);  // [B, T]
  VIADUCT_CHECK(targets.sizes() == readout.sizes(), kFamily, ": targets ", targets.sizes(),
                " do not match the readout ", readout.sizes());
  return (readout * (targets != -100).to(readout.scalar_type())).sum();
}

// ---------------------------------------------------------------- family

namespace {

ModelInfo describe_exact16(const JobConfig& job) {
  const auto o = exact16_options(job);
  const int64_t D = o.dim;
  ModelInfo info;
  info.family = kFamily;
  info.flavor = kFlavor;
  info.n_layers = o.n_layers;
  info.embedding_params = o.vocab_size * D;
  info.dim = D;
  info.vocab_size = o.vocab_size;
  info.params = info.embedding_params + 2 * o.n_layers * D;  // two biases a layer
  info.active_params = info.params;
  // Elementwise work per token, forward: each read of n sources n - 1 adds
  // of D, each sublayer a multiply and an add, the partial sums' adds; the
  // backward about twice that.
  double fwd = 0;
  for (int64_t i = 0; i < o.n_layers; ++i) {
    LayerInfo li;
    li.layer = i;
    li.saved_values_per_token = 2.0 * D;  // each sublayer's input
    li.attention = "scale";
    li.ffn = "scale";
    li.block = o.block_of(i);
    li.opens_block = o.opens_block(i);
    info.layers.push_back(li);
    const int64_t entries = o.block_of(i) + 1;
    const int64_t first_read = entries + (li.opens_block ? 0 : 1);
    fwd += static_cast<double>((first_read - 1) + 2 + (li.opens_block ? 0 : 1) + entries + 2 + 1);
  }
  fwd += static_cast<double>(o.n_entries() + 1);  // final read and readout
  info.flops_per_token = 3.0 * fwd * static_cast<double>(D);
  info.flops_per_token_outside_attention = info.flops_per_token;  // no attention
  info.pinned_last.push_back("attn_res_final");
  return info;
}

}  // namespace

ModelFamily exact16_family() {
  ModelFamily f;
  f.name = kFamily;
  f.flavors = {kFlavor};
  f.module_fqns = [](const JobConfig& job) { return all_module_fqns(exact16_options(job)); };
  f.build = [](const JobConfig& job,
               const std::vector<std::string>& fqns) -> std::shared_ptr<ModelPart> {
    check_exact16_training(job);
    return std::make_shared<Exact16Part>(exact16_options(job), fqns);
  };
  f.describe = describe_exact16;
  // Its model keys (exact16_options refuses the others, switches at the
  // value exact16 has anyway excepted) at every lookup, as model_keys does
  // for the other families.
  f.check = [](const JobConfig& job) { (void)exact16_options(job); };
  f.attn_res = [](const JobConfig& job) -> std::optional<AttnResLayout> {
    const auto o = exact16_options(job);
    return AttnResLayout{o.n_layers, o.block_size, o.dim};
  };
  return f;
}

}  // namespace viaduct
