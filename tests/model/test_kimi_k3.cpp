// The kimi_k3 family: block-start reads, the part activation contract, parts
// chained by hand against the whole model (bitwise), layout-independent
// init, flavors and the description.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "config/job_config.h"
#include "core/check.h"
#include "model/families.h"
#include "model/kimi_k3.h"

namespace viaduct {
namespace {

JobConfig k3_config(const std::string& flavor,
                 const std::vector<std::string>& overrides = {}) {
  std::vector<std::string> o{"model.family=kimi_k3", "model.flavor=" + flavor};
  o.insert(o.end(), overrides.begin(), overrides.end());
  return JobConfig::parse("", "test", o);
}

// 8 layers in blocks of 3 (0-2, 3-5, 6-7): MLA at 3 and 7, MoE from layer 1.
JobConfig small_config(bool vision = false) {
  return k3_config("debugmodel",
                   {"model.n_layers=8", "model.attn_res_block_size=3",
                    "model.dim=32", "model.kda_head_dim=16",
                    "model.kda_chunk_size=8", "training.seq_len=24",
                    std::string("model.vision=") + (vision ? "true" : "false")});
}

std::shared_ptr<KimiK3Part> build(const JobConfig& cfg,
                                  const std::vector<std::string>& fqns = {}) {
  auto p = std::dynamic_pointer_cast<KimiK3Part>(build_model_part(cfg, fqns));
  p->init_weights(42);
  return p;
}

at::Tensor random_tokens(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randint(0, 257, {B, T}, torch::kLong).clamp_max(vocab - 1);
}

TEST(KimiK3Layer, BlockStartReadsSeeTheSameStack) {
  auto cfg = small_config();
  auto opts = kimi_k3_options(cfg);
  torch::manual_seed(1);
  std::vector<at::Tensor> blocks{torch::randn({1, 4, 32})};  // b_0
  auto incoming = torch::randn({1, 4, 32});                   // block 0, done
  KimiK3Layer opener(opts, 3);
  ASSERT_TRUE(opener->opens_block_);
  std::vector<std::vector<at::Tensor>> trace;
  opener->trace_ = &trace;
  auto partial = opener(incoming, blocks);
  ASSERT_EQ(trace.size(), 2u);
  ASSERT_EQ(blocks.size(), 2u);  // the incoming block was pushed
  EXPECT_TRUE(blocks[1].is_same(incoming));
  // First read: the stack alone; second: the same stack plus the partial.
  ASSERT_EQ(trace[0].size(), 2u);
  ASSERT_EQ(trace[1].size(), 3u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(trace[0][i].is_same(blocks[i]));
    EXPECT_TRUE(trace[1][i].is_same(blocks[i]));
  }
  EXPECT_FALSE(trace[1][2].is_same(incoming));

  // A layer inside the block: stack + incoming partial, then stack + new one.
  KimiK3Layer inner(opts, 4);
  ASSERT_FALSE(inner->opens_block_);
  std::vector<std::vector<at::Tensor>> trace2;
  inner->trace_ = &trace2;
  auto out = inner(partial, blocks);
  EXPECT_EQ(blocks.size(), 2u);
  ASSERT_EQ(trace2[0].size(), 3u);
  EXPECT_TRUE(trace2[0][2].is_same(partial));
  ASSERT_EQ(trace2[1].size(), 3u);
  EXPECT_TRUE(trace2[1][0].is_same(blocks[0]));
  EXPECT_TRUE(trace2[1][1].is_same(blocks[1]));
}

TEST(KimiK3Model, FlavorsAndFullAttentionRule) {
  auto mlas = [](const ModelInfo& info) {
    std::vector<int64_t> v;
    for (const auto& l : info.layers) {
      if (l.attention == "mla") v.push_back(l.layer);
    }
    return v;
  };
  auto full = describe_model(k3_config("full"));
  ASSERT_EQ(full.n_layers, 93);
  auto m = mlas(full);
  ASSERT_EQ(m.size(), 24u);  // 3, 7, ..., 91 and 92
  EXPECT_EQ(m.front(), 3);
  EXPECT_EQ(m[22], 91);
  EXPECT_EQ(m.back(), 92);
  EXPECT_EQ(full.layers[92].block, 7);
  EXPECT_TRUE(full.layers[84].opens_block);
  EXPECT_EQ(full.layers[0].ffn, "dense");
  EXPECT_EQ(full.layers[1].ffn, "moe");
  EXPECT_EQ(full.pinned_last, std::vector<std::string>{"attn_res_final"});
  EXPECT_GT(full.params, full.active_params);

  auto deep = describe_model(k3_config("debugmodel_deep"));
  EXPECT_EQ(deep.n_layers, 33);
  EXPECT_EQ(deep.layers[32].block, 2);
  EXPECT_TRUE(deep.layers[24].opens_block);
  EXPECT_EQ(describe_model(k3_config("debugmodel")).n_layers, 24);
  // The integer-gradient model is its own family (model/exact16.h).
  auto ex = describe_model(JobConfig::parse("", "test", {"model.family=exact16"}));
  EXPECT_EQ(ex.n_layers, 16);
  EXPECT_TRUE(ex.layers[12].opens_block);
  EXPECT_EQ(ex.layers[15].block, 3);
  EXPECT_THROW(describe_model(k3_config("nope")), ConfigError);

  auto fqns = model_module_fqns(small_config(true));
  EXPECT_EQ(fqns.front(), "tok_embeddings");
  EXPECT_EQ(fqns[1], "vision_tower");
  EXPECT_EQ(fqns[2], "layers.0");
  EXPECT_EQ(fqns.back(), "attn_res_final");
  EXPECT_EQ(fqns[fqns.size() - 3], "norm");
}

TEST(KimiK3Model, MlaIntervalPicksTheFullAttentionLayers) {
  auto kinds = [](const JobConfig& cfg) {
    std::string s;
    for (const auto& l : describe_model(cfg).layers) s += l.attention == "mla" ? 'M' : 'k';
    return s;
  };
  // debugmodel_deep: 33 layers. Default every fourth (3, 7, ...) and the last.
  EXPECT_EQ(kinds(k3_config("debugmodel_deep")), "kkkMkkkMkkkMkkkMkkkMkkkMkkkMkkkMM");
  EXPECT_EQ(kinds(k3_config("debugmodel_deep", {"model.mla_interval=1"})),
            std::string(33, 'M'));
  EXPECT_EQ(kinds(k3_config("debugmodel_deep", {"model.mla_interval=3"})),
            "kkMkkMkkMkkMkkMkkMkkMkkMkkMkkMkkM");
  // The built model follows the same rule (parameter counts differ by kind).
  auto cfg = k3_config("debugmodel", {"model.mla_interval=2"});
  EXPECT_EQ(describe_model(cfg).params, count_parameters(*build(cfg)));
  EXPECT_NE(describe_model(cfg).params, describe_model(k3_config("debugmodel")).params);
  EXPECT_THROW(describe_model(k3_config("debugmodel", {"model.mla_interval=0"})), ConfigError);
}

TEST(KimiK3Model, DescribeCountsMatchBuiltModel) {
  for (bool vision : {false, true}) {
    auto cfg = small_config(vision);
    auto info = describe_model(cfg);
    auto model = build(cfg);
    EXPECT_EQ(info.params, count_parameters(*model)) << "vision " << vision;
  }
  auto cfg = k3_config("debugmodel", {"model.mla_q_lora_rank=16",
                                      "model.n_shared_experts=2"});
  EXPECT_EQ(describe_model(cfg).params, count_parameters(*build(cfg)));
}

TEST(KimiK3Model, PartActivationContract) {
  auto cfg = small_config();
  auto tokens = random_tokens(2, 24, 320, 2);
  auto first = build(cfg, {"tok_embeddings"});
  auto a0 = first->forward({tokens});
  ASSERT_EQ(a0.size(), 1u);  // the embedding, no stack yet
  EXPECT_EQ(a0[0].sizes(), (std::vector<int64_t>{2, 24, 32}));
  // layers 0..4: block 0 (layers 0-2) complete, block 1 open after 3, 4.
  auto mid = build(cfg, {"layers.0", "layers.1", "layers.2", "layers.3", "layers.4"});
  EXPECT_FALSE(mid->has_first());
  EXPECT_FALSE(mid->has_last());
  auto a1 = mid->forward(a0);
  ASSERT_EQ(a1.size(), 3u);  // hidden, b_0 (embedding), b_1
  // The embedding passes through unchanged: the same tensor, or (while
  // autograd records, see Note [AttnRes block gradients in place]) a view of it.
  EXPECT_TRUE(a1[1].is_same(a0[0]) || (a1[1].is_alias_of(a0[0]) && a1[1].equal(a0[0])));
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(mid->forward(a0)[1].is_same(a0[0]));
  }
  // layers 0..2 end on a block boundary: hidden is the completed block 1,
  // not yet pushed.
  auto blk = build(cfg, {"layers.0", "layers.1", "layers.2"});
  auto a2 = blk->forward(a0);
  ASSERT_EQ(a2.size(), 2u);
  // A wrong stack is refused with the layer named.
  auto late = build(cfg, {"layers.5"});
  EXPECT_THROW(late->forward(a2), Error);
  EXPECT_THROW(build(cfg, {"norm", "lm_head"}), ConfigError);
}

// Whole model vs parts chained by hand: logits and every gradient bitwise.
void expect_chain_matches(const JobConfig& cfg,
                          const std::vector<std::vector<std::string>>& split,
                          const Activations& input) {
  auto whole = build(cfg);
  std::vector<std::shared_ptr<KimiK3Part>> parts;
  for (const auto& s : split) parts.push_back(build(cfg, s));
  auto logits = whole->forward(input)[0];
  Activations act = input;
  for (auto& p : parts) act = p->forward(act);
  ASSERT_EQ(act.size(), 1u);
  EXPECT_TRUE(torch::equal(act[0], logits));
  auto targets = input[0].roll(-1, 1);
  summed_cross_entropy(logits, targets).backward();
  summed_cross_entropy(act[0], targets).backward();
  std::map<std::string, at::Tensor> reference;
  for (const auto& p : whole->named_parameters()) reference[p.key()] = p.value().grad();
  size_t seen = 0;
  for (auto& part : parts) {
    for (const auto& p : part->named_parameters()) {
      ASSERT_TRUE(reference.count(p.key())) << p.key();
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_TRUE(torch::equal(p.value().grad(), reference[p.key()])) << p.key();
      ++seen;
    }
  }
  EXPECT_EQ(seen, reference.size());
}

TEST(KimiK3Model, PartsChainedGiveTheWholeModelBitwise) {
  auto cfg = small_config();
  auto tokens = random_tokens(2, 24, 320, 3);
  // Boundaries inside block 1 (after layer 4) and at a block end (after 2).
  expect_chain_matches(
      cfg,
      {{"tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "layers.4"},
       {"layers.5", "layers.6", "layers.7", "norm", "lm_head", "attn_res_final"}},
      {tokens});
  expect_chain_matches(
      cfg,
      {{"tok_embeddings"},
       {"layers.0", "layers.1", "layers.2"},
       {"layers.3"},
       {"layers.4", "layers.5", "layers.6"},
       {"layers.7"},
       {"norm", "lm_head", "attn_res_final"}},
      {tokens});
}

// See Note [AttnRes block gradients in place]: the slots (the blocks' and the
// partial sums') give every parameter and every input gradient the bits of
// autograd's own sums, through three
// parts (the seed at both boundaries) and through a rerun of a part's
// backward from the same received gradients (zero-bubble's W pass).
TEST(KimiK3Model, BlockGradientsInPlaceHaveAutogradsBits) {
  auto tokens = random_tokens(2, 24, 320, 5);
  const std::vector<std::vector<std::string>> split{
      {"tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"},
      {"layers.4", "layers.5", "layers.6"},
      {"layers.7", "norm", "lm_head", "attn_res_final"}};
  struct Run {
    std::vector<at::Tensor> grads;  // every part's parameters, then the middle inputs'
    std::vector<std::string> output_nodes;
    std::string hidden_producer;  // the middle part's hidden output, past the seed
  };
  auto run = [&](bool in_place) {
    auto cfg = small_config();
    cfg = JobConfig::parse("", "test",
                        {"model.family=kimi_k3", "model.flavor=debugmodel", "model.n_layers=8",
                         "model.attn_res_block_size=3", "model.dim=32", "model.kda_head_dim=16",
                         "model.kda_chunk_size=8", "training.seq_len=24"});
    // The reference: autograd's own sums (no slots), an option of the
    // model rather than a config key.
    auto opts = kimi_k3_options(cfg);
    opts.attn_res_grad_in_place = in_place;
    std::vector<std::shared_ptr<KimiK3Part>> parts;
    for (const auto& fqns : split) {
      parts.push_back(std::make_shared<KimiK3Part>(opts, fqns));
      parts.back()->init_weights(42);
    }
    Run r;
    auto a0 = parts[0]->forward({tokens});
    std::vector<at::Tensor> in1, in2;
    for (auto& t : a0) in1.push_back(t.detach().requires_grad_(true));
    auto a1 = parts[1]->forward(in1);
    {
      auto node = a1[0].grad_fn();
      if (node && node->name().find("SeedFn") != std::string::npos) {
        node = node->next_edges().at(0).function;
      }
      r.hidden_producer = node ? node->name() : "leaf";
    }
    for (auto& t : a1) {
      r.output_nodes.push_back(t.grad_fn() ? t.grad_fn()->name() : "leaf");
      in2.push_back(t.detach().requires_grad_(true));
    }
    auto logits = parts[2]->forward(in2)[0];
    torch::manual_seed(9);
    auto w = torch::randn(logits.sizes());
    (logits * w).sum().backward();
    std::vector<at::Tensor> g2;
    for (auto& t : in2) g2.push_back(t.grad().clone());
    // The middle part twice from the same gradients, as I then W would.
    torch::autograd::backward(a1, g2, /*retain_graph=*/true);
    std::vector<at::Tensor> first;
    for (auto& t : in1) first.push_back(t.grad().clone());
    for (auto& p : parts[1]->parameters()) first.push_back(p.grad().clone());
    for (auto& t : in1) t.mutable_grad() = at::Tensor();
    for (auto& p : parts[1]->parameters()) p.mutable_grad() = at::Tensor();
    torch::autograd::backward(a1, g2);
    std::vector<at::Tensor> g1;
    for (size_t i = 0; i < in1.size(); ++i) {
      EXPECT_TRUE(torch::equal(in1[i].grad(), first[i])) << "rerun, input " << i;
      g1.push_back(in1[i].grad());
    }
    torch::autograd::backward(a0, g1);
    for (auto& part : parts) {
      for (auto& p : part->parameters()) r.grads.push_back(p.grad());
    }
    r.grads.insert(r.grads.end(), g1.begin(), g1.end());
    r.grads.insert(r.grads.end(), g2.begin(), g2.end());
    return r;
  };
  auto on = run(true), off = run(false);
  // Not vacuous: the middle part's block outputs go through the seed only
  // when the slots are on.
  ASSERT_EQ(on.output_nodes.size(), 4u);  // hidden, b_0 (embedding), b_1, b_2
  // ... and its partial sum through the partial add (see Note [AttnRes
  // partial sums in place]).
  EXPECT_NE(on.hidden_producer.find("PartialAddFn"), std::string::npos) << on.hidden_producer;
  EXPECT_EQ(off.hidden_producer.find("PartialAddFn"), std::string::npos) << off.hidden_producer;
  for (size_t i = 1; i < 4; ++i) {
    EXPECT_NE(on.output_nodes[i].find("SeedFn"), std::string::npos) << on.output_nodes[i];
    EXPECT_EQ(off.output_nodes[i].find("SeedFn"), std::string::npos) << off.output_nodes[i];
  }
  ASSERT_EQ(on.grads.size(), off.grads.size());
  for (size_t i = 0; i < on.grads.size(); ++i) {
    ASSERT_TRUE(on.grads[i].defined() && off.grads[i].defined()) << i;
    EXPECT_TRUE(torch::equal(on.grads[i], off.grads[i])) << "gradient " << i;
  }
}

TEST(KimiK3Model, VisionPartsAndImagesBitwise) {
  auto cfg = small_config(true);
  auto opts = kimi_k3_options(cfg);
  const int64_t P = opts.vis.patches();  // (16 / 8)^2 = 4 per image
  auto tokens = random_tokens(2, 24, 320, 4);
  tokens.narrow(1, 2, P).fill_(opts.image_token_id);
  torch::manual_seed(5);
  auto images = torch::randn({2, 1, 3, 16, 16});
  expect_chain_matches(
      cfg,
      {{"tok_embeddings", "vision_tower", "layers.0", "layers.1"},
       {"layers.2", "layers.3", "layers.4", "layers.5", "layers.6", "layers.7",
        "norm", "lm_head", "attn_res_final"}},
      {tokens, images});
  // The images matter.
  auto whole = build(cfg);
  torch::NoGradGuard g;
  auto a = whole->forward({tokens, images})[0];
  auto b = whole->forward({tokens, images * 2})[0];
  EXPECT_FALSE(torch::equal(a, b));
  // Synthetic demo images need no image input.
  auto syn = build(k3_config("debugmodel", {"model.n_layers=2", "model.vision=true",
                                            "model.synthetic_images=true"}));
  auto out = syn->forward({random_tokens(2, 16, 320, 6)})[0];
  EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
}

// Image-text data hands the tower uint8 pixels: they are the float images
// (pixel / 127.5 - 1), bitwise, whole and split into parts.
TEST(KimiK3Model, Uint8PixelsAreTheScaledFloatImages) {
  auto cfg = small_config(true);
  auto opts = kimi_k3_options(cfg);
  const int64_t P = opts.vis.patches();
  auto tokens = random_tokens(2, 24, 320, 9);
  tokens.narrow(1, 0, P).fill_(opts.image_token_id);
  torch::manual_seed(6);
  auto pixels = torch::randint(0, 256, {2, 1, 3, 16, 16}).to(at::kByte);
  auto reference = pixels.to(at::kFloat) / 127.5 - 1.0;
  {
    auto whole = build(cfg);
    torch::NoGradGuard g;
    EXPECT_TRUE(torch::equal(whole->forward({tokens, pixels})[0],
                             whole->forward({tokens, reference})[0]));
  }
  expect_chain_matches(
      cfg,
      {{"tok_embeddings", "vision_tower", "layers.0"},
       {"layers.1", "layers.2", "layers.3", "layers.4", "layers.5", "layers.6", "layers.7",
        "norm", "lm_head", "attn_res_final"}},
      {tokens, pixels});
}

TEST(KimiK3Model, InitIsLayoutIndependent) {
  auto cfg = small_config(true);
  auto whole = build(cfg);
  std::map<std::string, at::Tensor> reference;
  for (const auto& p : whole->named_parameters()) reference[p.key()] = p.value();
  for (const auto& b : whole->named_buffers()) reference[b.key()] = b.value();
  const std::vector<std::vector<std::string>> split{
      {"tok_embeddings", "vision_tower", "layers.0"},
      {"layers.1", "layers.2", "layers.3"},
      {"layers.4", "layers.5", "layers.6", "layers.7"},
      {"norm", "lm_head", "attn_res_final"}};
  size_t seen = 0;
  for (const auto& s : split) {
    auto part = build(cfg, s);
    for (const auto& p : part->named_parameters()) {
      ASSERT_TRUE(reference.count(p.key())) << p.key();
      EXPECT_TRUE(torch::equal(p.value(), reference[p.key()])) << p.key();
      ++seen;
    }
  }
  EXPECT_EQ(seen, whole->named_parameters().size());
  EXPECT_GT(seen, 50u);
  EXPECT_TRUE(reference.count("layers.1.moe.expert_bias"));
  EXPECT_TRUE(reference.count("layers.3.attention.wkv_a.weight"));
  EXPECT_TRUE(reference.count("layers.0.attention.q_conv.weight"));
  EXPECT_TRUE(reference.count("attn_res_final.query"));
}

TEST(KimiK3Model, AfterOptimizerStepMovesTheMoeBias) {
  auto cfg = small_config();
  auto model = build(cfg);
  auto tokens = random_tokens(2, 24, 320, 7);
  auto logits = model->forward({tokens})[0];
  summed_cross_entropy(logits, tokens.roll(-1, 1)).backward();
  auto layer1 = model->layers()[1];
  ASSERT_TRUE(layer1->moe);
  EXPECT_EQ(layer1->moe->tokens_per_expert.sum().item<int64_t>(), 2 * 24 * 2);
  model->after_optimizer_step();
  EXPECT_GT(layer1->moe->expert_bias.abs().sum().item<double>(), 0.0);
  EXPECT_EQ(layer1->moe->tokens_per_expert.sum().item<int64_t>(), 0);
}

// The tiny shape the exact16 flavor had before it became the integer-gradient
// model (model/exact16.h): 16 layers in blocks of 4, one head, dense FFNs.
TEST(KimiK3Model, TinyModelTrainsAndIsDeterministic) {
  auto cfg = k3_config(
      "debugmodel",
      {"model.n_layers=16", "model.attn_res_block_size=4", "model.dim=16", "model.n_heads=1",
       "model.ffn_hidden_dim=32", "model.moe_ffn=false", "model.kda_head_dim=8",
       "model.kda_chunk_size=8", "model.mla_kv_lora_rank=8", "model.mla_qk_nope_head_dim=8",
       "model.mla_qk_rope_head_dim=4", "model.mla_v_head_dim=8"});
  auto run = [&] {
    auto model = build(cfg);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(3e-3));
    auto tokens = random_tokens(2, 16, 320, 8);
    std::vector<double> losses;
    for (int step = 0; step < 12; ++step) {
      opt.zero_grad();
      auto loss = summed_cross_entropy(model->forward({tokens})[0],
                                       tokens.roll(-1, 1)) / 32.0;
      loss.backward();
      opt.step();
      model->after_optimizer_step();
      losses.push_back(loss.item<double>());
    }
    return losses;
  };
  auto a = run();
  auto b = run();
  EXPECT_EQ(a, b);
  EXPECT_LT(a.back(), a.front() - 0.2);
}

// model.attn_res = false: the same layers with plain residual adds. The
// reference is the chain composed here by hand from the model's own
// sublayers: h = emb; h += attention(attention_norm(h)); h += ffn(ffn_norm(h));
// logits = lm_head(norm(h)). Logits, loss and every gradient bitwise.
JobConfig plain_config() {
  return k3_config("debugmodel",
                   {"model.n_layers=8", "model.attn_res_block_size=3",
                    "model.dim=32", "model.kda_head_dim=16",
                    "model.kda_chunk_size=8", "training.seq_len=24",
                    "model.attn_res=false"});
}

TEST(KimiK3Plain, LossEqualsAHandComposedPlainResidualChain) {
  auto cfg = plain_config();
  ASSERT_FALSE(kimi_k3_options(cfg).attn_res);
  auto model = build(cfg);
  auto reference_model = build(cfg);  // the same (seed, FQN) weights
  for (const auto& p : model->named_parameters()) {
    EXPECT_EQ(p.key().find("attn_res"), std::string::npos) << p.key();
  }
  auto tokens = random_tokens(2, 24, 320, 11);
  auto targets = tokens.roll(-1, 1);
  auto loss = summed_cross_entropy(model->forward({tokens})[0], targets);

  auto h = at::embedding(reference_model->tok_embeddings->weight, tokens);  // [B, T, D]
  for (auto layer : reference_model->layers()) {  // holders: shared_ptr copies
    auto n = layer->attention_norm(h);
    h = h + (layer->mla ? layer->mla(n) : layer->kda(n));
    n = layer->ffn_norm(h);
    h = h + (layer->moe ? layer->moe(n) : layer->feed_forward(n));
  }
  auto reference_loss =
      summed_cross_entropy(linear(reference_model->norm(h), reference_model->lm_head, ops::KernelOptions{}), targets);
  EXPECT_TRUE(torch::equal(loss, reference_loss))
      << loss.item<double>() << " vs " << reference_loss.item<double>();
  loss.backward();
  reference_loss.backward();
  std::map<std::string, at::Tensor> reference;
  for (const auto& p : reference_model->named_parameters()) reference[p.key()] = p.value().grad();
  for (const auto& p : model->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_TRUE(torch::equal(p.value().grad(), reference.at(p.key()))) << p.key();
  }
  // AttnRes really is gone: the same weights with AttnRes give another loss.
  auto with = build(small_config());
  torch::NoGradGuard g;
  auto loss_with = summed_cross_entropy(with->forward({tokens})[0], targets);
  EXPECT_FALSE(torch::equal(loss_with, reference_loss.detach()));
}

TEST(KimiK3Plain, ModulesParamsAndInitAgreeWithTheAttnResModel) {
  auto cfg = plain_config();
  auto fqns = model_module_fqns(cfg);
  EXPECT_EQ(fqns.back(), "lm_head");  // no attn_res_final
  auto info = describe_model(cfg);
  auto model = build(cfg);
  EXPECT_EQ(info.params, count_parameters(*model));
  EXPECT_TRUE(info.pinned_last.empty());
  EXPECT_EQ(info.layers[3].block, -1);
  auto with_info = describe_model(small_config());
  EXPECT_LT(info.flops_per_token, with_info.flops_per_token);
  // Weights depend on (seed, FQN) alone: every shared tensor is the same.
  std::map<std::string, at::Tensor> with;
  for (const auto& p : build(small_config())->named_parameters()) {
    with[p.key()] = p.value();
  }
  for (const auto& p : model->named_parameters()) {
    ASSERT_TRUE(with.count(p.key())) << p.key();
    EXPECT_TRUE(torch::equal(p.value(), with[p.key()])) << p.key();
  }
  EXPECT_EQ(with.size() - model->named_parameters().size(), 2u * 2 * 8 + 2);
}

TEST(KimiK3Plain, PartsHandOnTheHiddenAloneAndChainBitwise) {
  auto cfg = plain_config();
  auto tokens = random_tokens(2, 24, 320, 12);
  auto mid = build(cfg, {"tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"});
  auto a = mid->forward({tokens});
  ASSERT_EQ(a.size(), 1u);  // {hidden}: a chain
  EXPECT_EQ(a[0].sizes(), (std::vector<int64_t>{2, 24, 32}));
  auto next = build(cfg, {"layers.4"});
  EXPECT_THROW(next->forward({a[0], a[0]}), Error);
  EXPECT_THROW(build(cfg, {"norm"}), ConfigError);
  expect_chain_matches(
      cfg,
      {{"tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"},
       {"layers.4"},
       {"layers.5", "layers.6", "layers.7", "norm", "lm_head"}},
      {tokens});
}

}  // namespace
}  // namespace viaduct
