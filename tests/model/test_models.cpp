// llama and gpt2 against a straightforward reference written from the
// papers' equations with plain tensor ops (explicit masked softmax attention,
// complex-number RoPE, hand-written norms), in fp64: logits and every
// parameter's gradient.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "config/job_config.h"
#include "core/check.h"
#include "model/family.h"
#include "model/model.h"

using namespace viaduct;

namespace {

using ParamMap = std::map<std::string, at::Tensor>;

ParamMap params_of(const torch::nn::Module& m) {
  ParamMap out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value();
  return out;
}

at::Tensor reference_rms(const at::Tensor& x, const at::Tensor& w, double eps) {
  return x / (x.pow(2).mean(-1, true) + eps).sqrt() * w;
}

at::Tensor reference_layer_norm(const at::Tensor& x, const at::Tensor& w,
                          const at::Tensor& b, double eps) {
  auto mu = x.mean(-1, true);
  auto var = (x - mu).pow(2).mean(-1, true);
  return (x - mu) / (var + eps).sqrt() * w + b;
}

// Rotate consecutive pairs as complex numbers: (x0 + i x1) e^{i t f_j}.
at::Tensor reference_rope(const at::Tensor& x, double theta) {
  // x: [B, T, H, hd]
  const auto T = x.size(1), hd = x.size(3);
  auto j = torch::arange(0, hd / 2, torch::kDouble);
  auto f = torch::pow(theta, -2.0 * j / static_cast<double>(hd));
  auto ang = torch::outer(torch::arange(T, torch::kDouble), f);  // [T, hd/2]
  auto rot = torch::polar(torch::ones_like(ang), ang).view({1, T, 1, hd / 2});
  auto xc = torch::view_as_complex(x.reshape({x.size(0), T, x.size(2), hd / 2, 2}).contiguous());
  return torch::view_as_real(xc * rot).reshape(x.sizes());
}

at::Tensor reference_attention(const at::Tensor& x, ParamMap& p, const std::string& pre,
                         int64_t H, int64_t KV, bool rope, double theta,
                         bool bias) {
  const auto B = x.size(0), T = x.size(1), D = x.size(2), hd = D / H;
  auto lin = [&](const at::Tensor& in, const std::string& n) {
    auto y = at::matmul(in, p[pre + n + ".weight"].t());
    if (bias) y = y + p[pre + n + ".bias"];
    return y;
  };
  auto q = lin(x, "wq").view({B, T, H, hd});
  auto k = lin(x, "wk").view({B, T, KV, hd});
  auto v = lin(x, "wv").view({B, T, KV, hd});
  if (rope) {
    q = reference_rope(q, theta);
    k = reference_rope(k, theta);
  }
  std::vector<at::Tensor> heads;
  auto mask = torch::ones({T, T}, torch::kBool).triu(1);
  for (int64_t h = 0; h < H; ++h) {
    const int64_t g = h / (H / KV);  // the KV head this query head reads
    auto qh = q.select(2, h), kh = k.select(2, g), vh = v.select(2, g);  // [B,T,hd]
    auto s = at::matmul(qh, kh.transpose(1, 2)) / std::sqrt(static_cast<double>(hd));
    s = s.masked_fill(mask, -std::numeric_limits<double>::infinity());
    heads.push_back(at::matmul(s.softmax(-1), vh));
  }
  return lin(at::cat(heads, -1), "wo");
}

struct ReferenceSpec {
  bool gpt2 = false;
  int64_t H = 0, KV = 0;
  double eps = 1e-5, theta = 10000;
};

at::Tensor reference_forward(ParamMap& p, const at::Tensor& tokens, int64_t L,
                       const ReferenceSpec& s) {
  auto x = p["tok_embeddings.weight"].index_select(0, tokens.reshape(-1))
               .view({tokens.size(0), tokens.size(1), -1});
  if (s.gpt2) x = x + p["pos_embeddings.weight"].slice(0, 0, tokens.size(1));
  for (int64_t i = 0; i < L; ++i) {
    const std::string pre = "layers." + std::to_string(i) + ".";
    auto norm = [&](const at::Tensor& in, const std::string& n) {
      return s.gpt2 ? reference_layer_norm(in, p[pre + n + ".weight"], p[pre + n + ".bias"], s.eps)
                    : reference_rms(in, p[pre + n + ".weight"], s.eps);
    };
    x = x + reference_attention(norm(x, "attention_norm"), p, pre + "attention.", s.H,
                          s.KV, !s.gpt2, s.theta, s.gpt2);
    auto h = norm(x, "ffn_norm");
    const std::string f = pre + "feed_forward.";
    if (s.gpt2) {
      auto u = at::matmul(h, p[f + "w1.weight"].t()) + p[f + "w1.bias"];
      const double c = std::sqrt(2.0 / M_PI);
      auto g = 0.5 * u * (1 + torch::tanh(c * (u + 0.044715 * u.pow(3))));
      x = x + at::matmul(g, p[f + "w2.weight"].t()) + p[f + "w2.bias"];
    } else {
      auto a = at::matmul(h, p[f + "w1.weight"].t());
      auto b = at::matmul(h, p[f + "w3.weight"].t());
      x = x + at::matmul(a * torch::sigmoid(a) * b, p[f + "w2.weight"].t());
    }
  }
  x = s.gpt2 ? reference_layer_norm(x, p["norm.weight"], p["norm.bias"], s.eps)
             : reference_rms(x, p["norm.weight"], s.eps);
  const auto& head = p.count("lm_head.weight") ? p["lm_head.weight"] : p["tok_embeddings.weight"];
  return at::matmul(x, head.t());
}

void check_against_reference(const std::string& family, const ReferenceSpec& s) {
  at::set_num_threads(1);
  auto cfg = JobConfig::parse("", "test", {"model.family=" + family, "model.n_layers=2",
                                        "training.seq_len=12"});
  auto model = build_model_part(cfg);
  model->init_weights(7);
  model->to(at::kDouble);
  model->set_compute_dtype(at::kDouble);
  auto tokens = torch::randint(0, 300, {2, 12}, torch::kLong);
  auto targets = torch::randint(0, 300, {2, 12}, torch::kLong);

  auto logits = model->forward({tokens}).at(0);
  summed_cross_entropy(logits, targets).backward();

  // The reference on detached copies of the same parameters.
  ParamMap reference;
  for (auto& [k, v] : params_of(*model)) reference[k] = v.detach().clone().requires_grad_(true);
  auto reference_logits = reference_forward(reference, tokens, 2, s);
  at::cross_entropy_loss(reference_logits.reshape({-1, reference_logits.size(-1)}),
                         targets.reshape(-1), {}, at::Reduction::Sum)
      .backward();

  EXPECT_TRUE(torch::allclose(logits, reference_logits, 1e-9, 1e-10))
      << (logits - reference_logits).abs().max().item<double>();
  for (auto& [k, v] : params_of(*model)) {
    ASSERT_TRUE(v.grad().defined()) << k;
    EXPECT_TRUE(torch::allclose(v.grad(), reference[k].grad(), 1e-8, 1e-10))
        << family << " " << k << " max diff "
        << (v.grad() - reference[k].grad()).abs().max().item<double>() << " of max "
        << reference[k].grad().abs().max().item<double>();
  }
}

}  // namespace

TEST(Llama, ForwardAndBackwardMatchReference) {
  check_against_reference("llama", ReferenceSpec{false, 8, 4, 1e-5, 10000});
}

TEST(Gpt2, ForwardAndBackwardMatchReference) {
  check_against_reference("gpt2", ReferenceSpec{true, 4, 4, 1e-5, 10000});
}

TEST(Models, FqnsFollowTorchtitanNames) {
  auto cfg = JobConfig::parse("", "test", {"model.n_layers=2"});
  auto fqns = model_module_fqns(cfg);
  EXPECT_EQ(fqns, (std::vector<std::string>{"tok_embeddings", "layers.0", "layers.1",
                                            "norm", "lm_head"}));
  auto model = build_model_part(cfg);
  auto p = params_of(*model);
  for (const char* k : {"tok_embeddings.weight", "layers.1.attention.wq.weight",
                        "layers.1.attention.wk.weight", "layers.0.feed_forward.w3.weight",
                        "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight",
                        "norm.weight", "lm_head.weight"}) {
    EXPECT_TRUE(p.count(k)) << k;
  }
  auto g = JobConfig::parse("", "test", {"model.family=gpt2", "model.n_layers=1"});
  EXPECT_EQ(model_module_fqns(g),
            (std::vector<std::string>{"tok_embeddings", "pos_embeddings", "layers.0",
                                      "norm", "lm_head"}));
}

TEST(Models, ModuleFlopsAddUpToTheModelsFlops) {
  // See Note [Bubble weighted by FLOPs]: the per-module figures partition
  // flops_per_token, name real modules, and give llama's head 6 V D.
  const std::vector<std::vector<std::string>> configs = {
      {"model.n_layers=3"},
      {"model.family=gpt2", "model.n_layers=2", "model.tie_embeddings=false"},
      {"model.family=kimi_k3", "model.flavor=debugmodel"},
      {"model.family=kimi_k3", "model.flavor=debugmodel", "model.attn_res=false"},
  };
  for (const auto& overrides : configs) {
    auto cfg = JobConfig::parse("", "test", overrides);
    const auto info = describe_model(cfg);
    const auto fqns = model_module_fqns(cfg);
    double sum = 0;
    for (const auto& [fqn, f] : info.module_flops) {
      EXPECT_NE(std::find(fqns.begin(), fqns.end(), fqn), fqns.end()) << fqn;
      EXPECT_GT(f, 0) << fqn;
      sum += f;
    }
    EXPECT_NEAR(sum, info.flops_per_token, 1e-12 * info.flops_per_token) << overrides[0];
    for (int64_t i = 0; i < info.n_layers; ++i) {
      EXPECT_EQ(info.module_flops.count("layers." + std::to_string(i)), 1u) << i;
    }
  }
  auto cfg = JobConfig::parse("", "test", {"model.n_layers=3"});
  const auto info = describe_model(cfg);
  // llama: the embedding is V x D, as the untied head.
  EXPECT_DOUBLE_EQ(info.module_flops.at("lm_head"), 6.0 * static_cast<double>(info.embedding_params));
}

TEST(Models, PartsChainedEqualTheWholeModelBitwise) {
  at::set_num_threads(1);
  for (const char* fam : {"llama", "gpt2"}) {
    auto cfg = JobConfig::parse("", "test", {std::string("model.family=") + fam,
                                          "model.n_layers=4", "model.tie_embeddings=false"});
    auto whole = build_model_part(cfg);
    whole->init_weights(3);
    const auto all = model_module_fqns(cfg);
    // Parts built separately, initialised separately: same bits (init is a
    // function of (seed, FQN) only).
    std::vector<std::vector<std::string>> split = {
        {all.begin(), all.end() - 4}, {all.end() - 4, all.end() - 2}, {all.end() - 2, all.end()}};
    auto tokens = torch::randint(0, 300, {2, 16}, torch::kLong);
    Activations acts{tokens};
    for (const auto& fqns : split) {
      auto part = build_model_part(cfg, fqns);
      part->init_weights(3);
      acts = part->forward(acts);
    }
    auto reference = whole->forward({tokens}).at(0);
    EXPECT_TRUE(torch::equal(acts.at(0), reference)) << fam;
  }
}

TEST(Models, InitMatchesReferenceStatistics) {
  auto cfg = JobConfig::parse("", "test", {"model.dim=256", "model.n_layers=2"});
  auto model = build_model_part(cfg);
  model->init_weights(1);
  auto p = params_of(*model);
  // tok_embeddings ~ N(0, 1); wq ~ TN(0, 0.02); layer 1's wo ~ TN(0, 0.02/sqrt(4)).
  EXPECT_NEAR(p["tok_embeddings.weight"].std().item<double>(), 1.0, 0.02);
  EXPECT_NEAR(p["layers.0.attention.wq.weight"].std().item<double>(), 0.02, 0.001);
  EXPECT_NEAR(p["layers.1.attention.wo.weight"].std().item<double>(), 0.01, 0.0005);
  EXPECT_TRUE(torch::equal(p["norm.weight"], torch::ones({256})));
  const double head_std = 1.0 / 16.0;
  EXPECT_LE(p["lm_head.weight"].abs().max().item<double>(), 3 * head_std + 1e-7);
}

TEST(Models, BadShapesAreConfigErrors) {
  auto expect_error = [](std::vector<std::string> o, const std::string& needle) {
    try {
      auto cfg = JobConfig::parse("", "test", o);
      build_model_part(cfg);
      FAIL() << "no error for " << needle;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error({"model.dim=100", "model.n_heads=8"}, "model.n_heads");
  expect_error({"model.n_kv_heads=3"}, "model.n_kv_heads");
  expect_error({"model.flavor=huge"}, "huge");
  expect_error({"training.seq_len=4096", "model.max_seq_len=1024"}, "model.max_seq_len");
}

// model.family and model.flavor are checked by the family registry
// (model/family.h): an unknown name is refused with the valid ones.
TEST(ModelFamilies, UnknownFamilyOrFlavorNamesTheValidOnes) {
  auto error_of = [](const std::vector<std::string>& o) -> std::string {
    try {
      model_family(JobConfig::parse("", "job.toml", o));
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  auto msg = error_of({"model.family=llma"});
  EXPECT_NE(msg.find("model.family"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'llma'"), std::string::npos) << msg;
  for (const char* fam : {"llama", "gpt2", "kimi_k3", "exact16"}) {
    EXPECT_NE(msg.find(fam), std::string::npos) << msg;
  }
  msg = error_of({"model.family=gpt2", "model.flavor=1B"});
  EXPECT_NE(msg.find("'1B'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("124M"), std::string::npos) << msg;
  msg = error_of({"model.family=kimi_k3", "model.flavor=huge"});
  EXPECT_NE(msg.find("debugmodel_deep"), std::string::npos) << msg;
  for (const auto& f : model_families()) {
    EXPECT_EQ(model_family(JobConfig::parse("", "job.toml", {"model.family=" + f.name})).name,
              f.name);
    // Every family has a debugmodel (the schema's default flavor).
    EXPECT_NE(std::find(f.flavors.begin(), f.flavors.end(), "debugmodel"), f.flavors.end())
        << f.name;
  }
}

TEST(ModelFamilies, AttnResOffIsKimiK3Only) {
  auto load = [](const std::string& toml, const std::vector<std::string>& o = {}) {
    auto cfg = JobConfig::parse(toml, "job.toml", o);
    model_family(cfg);
    return cfg;
  };
  auto c = load("[model]\nfamily = \"kimi_k3\"\n");
  EXPECT_TRUE(c.model.keys.get_bool("model.attn_res"));  // default: AttnRes on
  EXPECT_NO_THROW(load("[model]\nfamily = \"kimi_k3\"\nattn_res = false\n"));
  for (const char* fam : {"llama", "gpt2"}) {
    std::string msg;
    try {
      load(std::string("[model]\nfamily = \"") + fam + "\"\n", {"model.attn_res=false"});
    } catch (const ConfigError& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("model.attn_res"), std::string::npos) << msg;
    EXPECT_NE(msg.find(fam), std::string::npos) << msg;
    EXPECT_NO_THROW(load(std::string("[model]\nfamily = \"") + fam + "\"\nattn_res = true\n"));
  }
}

// What the AttnRes pipeline asks of a family: the block stack its parts
// hand on, none for a chain (kimi_k3 with model.attn_res = false included).
TEST(ModelFamilies, AttnResLayoutOfEachFamily) {
  auto layout = [](const std::vector<std::string>& o) {
    return attn_res_layout(JobConfig::parse("", "job.toml", o));
  };
  EXPECT_FALSE(layout({"model.family=llama"}).has_value());
  EXPECT_FALSE(layout({"model.family=gpt2"}).has_value());
  EXPECT_FALSE(layout({"model.family=kimi_k3", "model.attn_res=false"}).has_value());
  const auto k3 = layout({"model.family=kimi_k3", "model.attn_res_block_size=5"});
  ASSERT_TRUE(k3.has_value());
  EXPECT_EQ(k3->n_layers, 24);
  EXPECT_EQ(k3->block_size, 5);
  EXPECT_EQ(k3->dim, 64);
  const auto e16 = layout({"model.family=exact16"});
  ASSERT_TRUE(e16.has_value());
  EXPECT_EQ(e16->n_layers, 16);
  EXPECT_EQ(e16->block_size, 4);
  EXPECT_EQ(e16->dim, 16);
}

// One forward_loss + backward of a fresh model from `overrides` (init seed
// `seed`) in dtype `dt` on tokens [2, seq]: the loss and every parameter's
// gradient by FQN.
struct LossAndGrads {
  double loss;
  ParamMap grads;
};
LossAndGrads loss_and_grads(const std::vector<std::string>& overrides, at::ScalarType dt,
                            int64_t seq, uint64_t seed) {
  auto model = build_model_part(JobConfig::parse("", "test", overrides));
  model->init_weights(seed);
  model->to(dt);
  model->set_compute_dtype(dt);
  auto tokens = torch::arange(2 * seq, torch::kLong).view({2, seq}) * 7 % 300;
  auto targets = (tokens * 3 + 1) % 300;
  auto loss = model->forward_loss({tokens}, targets);
  loss.backward();
  LossAndGrads r{loss.item<double>(), {}};
  for (auto& [k, v] : params_of(*model)) {
    EXPECT_EQ(v.scalar_type(), dt) << k;
    EXPECT_TRUE(v.grad().defined()) << k;
    r.grads[k] = v.grad().defined() ? v.grad().clone() : at::zeros_like(v);
  }
  return r;
}

TEST(ChunkedHeadLoss, ModelLossAndGradientsMatchThePlainHead) {
  at::set_num_threads(1);
  for (const char* fam : {"llama", "gpt2"}) {
    std::vector<ParamMap> grads;
    std::vector<double> losses;
    for (const char* chunk : {"0", "5"}) {
      auto r = loss_and_grads({std::string("model.family=") + fam, "model.n_layers=2",
                               "training.seq_len=8", std::string("model.loss_chunk_tokens=") + chunk},
                              at::kDouble, 8, 5);
      losses.push_back(r.loss);
      grads.push_back(r.grads);
    }
    EXPECT_NEAR(losses[0], losses[1], 1e-10 * std::abs(losses[0])) << fam;
    for (auto& [k, g] : grads[0]) {
      EXPECT_TRUE(torch::allclose(g, grads[1][k], 1e-9, 1e-11)) << fam << " " << k;
    }
  }
}

// The kimi_k3 model (every read, MLA everywhere, dense FFNs) runs in fp64
// (the GPU kernel tests' reference, KimiK3FusedReadNormMatchesTwoOps) and
// agrees with its fp32 run to fp32 rounding: the fp64 path is the same
// model, not a different one.
TEST(Models, KimiK3RunsInFp64AndAgreesWithFp32) {
  at::set_num_threads(1);
  std::vector<ParamMap> grads;
  std::vector<double> losses;
  for (auto dt : {at::kFloat, at::kDouble}) {
    auto r = loss_and_grads({"model.family=kimi_k3", "model.flavor=debugmodel",
                             "training.seq_len=16", "model.mla_interval=1", "model.moe_ffn=false"},
                            dt, 16, 11);
    for (auto& [k, g] : r.grads) g = g.to(at::kDouble);
    losses.push_back(r.loss);
    grads.push_back(r.grads);
  }
  EXPECT_NEAR(losses[0], losses[1], 1e-5 * std::abs(losses[1]));
  int nonzero = 0;
  for (auto& [k, g] : grads[1]) {
    const double reference = g.norm().item<double>();
    if (reference == 0) {
      // Zero-initialised queries leave the norm weights' gradients at
      // exactly zero (and the first reads' queries: one source), in both.
      EXPECT_EQ(grads[0][k].norm().item<double>(), 0) << k;
      continue;
    }
    ++nonzero;
    const double err = (grads[0][k] - g).norm().item<double>() / reference;
    EXPECT_LT(err, 1e-3) << k;
  }
  EXPECT_GT(nonzero, 50);
}

TEST(RemovedConfigKeys, SettingOneIsAConfigErrorThatSaysWhatNowHappens) {
  for (const std::string key :
       {"model.swiglu_one_gemm", "model.attn_res_fused_norm", "model.attn_res_grad_in_place"}) {
    // On the command line.
    try {
      JobConfig::parse("", "test", {key + "=false"});
      FAIL() << key << " was accepted";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'" + key + "'"), std::string::npos) << what;
      EXPECT_NE(what.find("was removed: "), std::string::npos) << what;
      EXPECT_NE(what.find("always"), std::string::npos) << what;
    }
    // In a file.
    const auto dot = key.find('.');
    try {
      JobConfig::parse("[" + key.substr(0, dot) + "]\n" + key.substr(dot + 1) + " = true\n",
                    "job.toml", {});
      FAIL() << key << " was accepted in a file";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'" + key + "' in job.toml was removed"), std::string::npos) << what;
    }
  }
}
