// The chain's blocks (see Note [Deferred residual add], model/chain_transformer.h)
// against the per-block form written out here with explicit adds from the
// part's own submodules: x -> h = x + attention(attention_norm(x)) ->
// h + feed_forward(ffn_norm(h)), then norm and lm_head on the part with the
// head. Parts with and without the head (a stage boundary), with and
// without the embedding, in fp32 and bf16 on the CPU, with every
// activation checkpointing mode: output (or loss), the input's gradient and
// every parameter gradient bitwise.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "config/job_config.h"
#include "core/check.h"
#include "core/strings.h"
#include "model/chain_transformer.h"
#include "model/layers.h"
#include "model/model.h"

namespace viaduct {
namespace {

constexpr int64_t kChainBatch = 2, kChainSeq = 12, kChainDim = 32, kChainVocab = 300;

JobConfig chain_config(const std::string& family, const std::vector<std::string>& extra) {
  std::vector<std::string> o = {"model.family=" + family, "model.flavor=debugmodel",
                                "model.n_layers=3", str("model.dim=", kChainDim),
                                "model.n_heads=4", "model.tie_embeddings=false",
                                str("model.vocab_size=", kChainVocab),
                                str("training.seq_len=", kChainSeq),
                                "model.loss_chunk_tokens=0"};
  if (family == "llama") o.push_back("model.n_kv_heads=2");
  o.insert(o.end(), extra.begin(), extra.end());
  return JobConfig::parse("", "test", o);
}

template <typename M>
std::shared_ptr<M> chain_submodule(torch::nn::Module& part, const std::string& name) {
  auto m = std::dynamic_pointer_cast<M>(part.named_modules()[name]);
  VIADUCT_CHECK(m != nullptr, "no module ", name, " of the expected type");
  return m;
}

// The norm `name` of `part`, RMSNorm or LayerNorm.
at::Tensor chain_norm(torch::nn::Module& part, const std::string& name, const at::Tensor& x) {
  auto m = part.named_modules()[name];
  if (auto rms = std::dynamic_pointer_cast<RMSNormImpl>(m)) return rms->forward(x);
  return chain_submodule<LayerNormImpl>(part, name)->forward(x);
}

at::Tensor chain_ffn(torch::nn::Module& part, const std::string& name, const at::Tensor& x) {
  auto m = part.named_modules()[name];
  if (auto swiglu = std::dynamic_pointer_cast<SwiGLUImpl>(m)) return swiglu->forward(x);
  return chain_submodule<GeluMLPImpl>(part, name)->forward(x);
}

bool chain_has(const std::vector<std::string>& fqns, const std::string& m) {
  return std::find(fqns.begin(), fqns.end(), m) != fqns.end();
}

// The part's output (hidden, or the summed loss with the head) from its
// own submodules, every residual add explicit.
at::Tensor explicit_chain(ModelPart& part, const std::vector<std::string>& fqns,
                          const at::Tensor& input, const at::Tensor& targets,
                          at::ScalarType dtype) {
  at::Tensor x = input;
  if (chain_has(fqns, "tok_embeddings")) {
    x = at::embedding(chain_submodule<torch::nn::EmbeddingImpl>(part, "tok_embeddings")->weight,
                      input);
    if (chain_has(fqns, "pos_embeddings")) {
      x = x + chain_submodule<torch::nn::EmbeddingImpl>(part, "pos_embeddings")
                  ->weight.slice(0, 0, input.size(1))
                  .unsqueeze(0);
    }
    x = x.to(dtype);
  }
  for (const auto& m : fqns) {
    if (m.rfind("layers.", 0) != 0) continue;
    auto attention = chain_submodule<AttentionImpl>(part, m + ".attention");
    auto h = x + attention->forward(chain_norm(part, m + ".attention_norm", x));
    x = h + chain_ffn(part, m + ".feed_forward", chain_norm(part, m + ".ffn_norm", h));
  }
  if (!chain_has(fqns, "lm_head")) return x;
  auto k = dynamic_cast<ops::KernelUser&>(part).kernel_options();
  auto logits = linear(chain_norm(part, "norm", x),
                       torch::nn::Linear(chain_submodule<torch::nn::LinearImpl>(part, "lm_head")),
                       k);
  return summed_cross_entropy(logits, targets);
}

struct ChainRun {
  at::Tensor out, input_grad;
  std::map<std::string, at::Tensor> grads;
};

// Forward and backward of `part` (explicit: through explicit_chain) on
// fresh copies of the inputs; without the head, the output's gradient is
// `grad_out`.
ChainRun run_chain(ModelPart& part, const std::vector<std::string>& fqns, bool explicit_adds,
                   const at::Tensor& input, const at::Tensor& targets,
                   const at::Tensor& grad_out, at::ScalarType dtype) {
  part.zero_grad();
  auto in = input.is_floating_point() ? input.detach().clone().requires_grad_(true) : input;
  ChainRun r;
  if (explicit_adds) {
    r.out = explicit_chain(part, fqns, in, targets, dtype);
  } else if (chain_has(fqns, "lm_head")) {
    r.out = part.forward_loss({in}, targets);
  } else {
    r.out = part.forward({in}).at(0);
  }
  if (chain_has(fqns, "lm_head")) {
    r.out.backward();
  } else {
    r.out.backward(grad_out);
  }
  if (in.is_floating_point()) r.input_grad = in.grad();
  for (const auto& p : part.named_parameters()) r.grads[p.key()] = p.value().grad();
  return r;
}

TEST(ChainTransformer, BlocksEqualTheExplicitResidualAddsBitwise) {
  at::set_num_threads(1);
  const std::vector<std::vector<std::string>> modes = {
      {},
      {"activation_checkpoint.mode=full"},
      {"activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=2"},
      {"activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=3"},
      {"activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=op"}};
  const std::vector<std::string> layers = {"layers.0", "layers.1", "layers.2"};
  auto with = [&](std::vector<std::string> front, std::vector<std::string> back) {
    front.insert(front.end(), layers.begin(), layers.end());
    front.insert(front.end(), back.begin(), back.end());
    return front;
  };
  torch::manual_seed(5);
  const auto tokens = torch::randint(0, kChainVocab, {kChainBatch, kChainSeq}, torch::kLong);
  const auto targets = torch::randint(0, kChainVocab, {kChainBatch, kChainSeq}, torch::kLong);
  const auto hidden = torch::randn({kChainBatch, kChainSeq, kChainDim});
  const auto grad_out = torch::randn({kChainBatch, kChainSeq, kChainDim});
  for (const std::string family : {"llama", "gpt2"}) {
    const std::vector<std::string> emb =
        family == "gpt2" ? std::vector<std::string>{"tok_embeddings", "pos_embeddings"}
                         : std::vector<std::string>{"tok_embeddings"};
    // First stage (no head), middle stage, last stage, the whole model.
    const std::vector<std::vector<std::string>> parts = {
        with(emb, {}), with({}, {}), with({}, {"norm", "lm_head"}), with(emb, {"norm", "lm_head"})};
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      for (const auto& fqns : parts) {
        const bool first = chain_has(fqns, "tok_embeddings");
        const auto input = first ? tokens : hidden.to(dtype);
        auto reference_part = build_model_part(chain_config(family, {}), fqns);
        reference_part->init_weights(3);
        reference_part->set_compute_dtype(dtype);
        const auto reference = run_chain(*reference_part, fqns, true, input, targets,
                                         grad_out.to(dtype), dtype);
        for (const auto& mode : modes) {
          SCOPED_TRACE(::testing::Message() << family << " " << dtype << " " << fqns.front()
                                          << ".." << fqns.back() << " "
                                          << (mode.empty() ? "none" : mode.back()));
          auto part = build_model_part(chain_config(family, mode), fqns);
          part->init_weights(3);
          part->set_compute_dtype(dtype);
          const auto r = run_chain(*part, fqns, false, input, targets, grad_out.to(dtype), dtype);
          EXPECT_EQ(r.out.scalar_type(), reference.out.scalar_type());
          EXPECT_TRUE(torch::equal(r.out, reference.out));
          EXPECT_EQ(r.input_grad.defined(), !first);
          if (!first) EXPECT_TRUE(torch::equal(r.input_grad, reference.input_grad));
          ASSERT_EQ(r.grads.size(), reference.grads.size());
          for (const auto& [name, g] : r.grads) {
            ASSERT_TRUE(g.defined()) << name;
            EXPECT_TRUE(torch::equal(g, reference.grads.at(name))) << name;
          }
        }
      }
    }
  }
}

// A block hands its FFN output on unadded, llama's (RMSNorm) and gpt2's
// (LayerNorm) alike; a checkpointed block one tensor (see Note [Deferred
// residual add]).
TEST(ChainTransformer, OnlyUncheckpointedBlocksLeaveTheirFfnOutputPending) {
  const auto x = torch::randn({kChainBatch, kChainSeq, kChainDim});
  auto block_output = [&](const std::string& family, const std::vector<std::string>& mode) {
    auto part = build_model_part(chain_config(family, mode), {"layers.0", "layers.1"});
    part->init_weights(3);
    auto b0 = chain_submodule<ChainBlockImpl>(*part, "layers.0");
    auto b1 = chain_submodule<ChainBlockImpl>(*part, "layers.1");
    auto y = b0->forward({x, {}});
    EXPECT_TRUE(y.stream.defined());
    return std::make_pair(y, b1->forward(y));
  };
  for (const std::string family : {"llama", "gpt2"}) {
    SCOPED_TRACE(family);
    auto [plain0, plain1] = block_output(family, {});
    EXPECT_TRUE(plain0.pending.defined());
    EXPECT_TRUE(plain1.pending.defined());
    // Every second layer checkpointed: layer 0 leaves its output pending,
    // layer 1 adds it before its checkpoint and hands on one tensor.
    auto [sel0, sel1] = block_output(
        family,
        {"activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=2"});
    EXPECT_TRUE(sel0.pending.defined());
    EXPECT_FALSE(sel1.pending.defined());
  }
}

}  // namespace
}  // namespace viaduct
