// block_causal (see Note [Document boundaries], ops/documents.h) against its
// reference, each document alone: a window packing documents A | B | C
// gives B's tokens the logits of B run alone from position 0 (bitwise, but
// for kimi_k3 with AttnRes and MoE together: to a bound), and
// a loss over B's tokens the parameter gradients of B alone (to a stated
// bound: the weight gradients sum the window's tokens, A's and C's zeros
// among them, in another order). Every family and mixer: llama (attention,
// GQA, RoPE), gpt2 (learned positions), kimi_k3 (KDA with its short
// convolutions, MLA with RoPE, MoE, AttnRes).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "config/job_config.h"
#include "core/check.h"
#include "core/strings.h"
#include "model/families.h"
#include "model/model.h"

namespace viaduct {
namespace {

constexpr int64_t kSeparator = 256;  // the byte tokenizer's <|endoftext|>

// A document of `length` tokens: the separator, then printable bytes.
at::Tensor document(int64_t length, uint64_t seed) {
  torch::manual_seed(seed);
  auto d = torch::randint(32, 127, {length}, torch::kLong);
  d[0] = kSeparator;
  return d;
}

// What the byte tokenizer's marker says of `tokens` [B, T].
ops::DocumentsPtr documents_of(const at::Tensor& tokens, bool reset_positions = true) {
  return std::make_shared<const ops::Documents>(tokens == kSeparator, reset_positions);
}

// Targets over a row's document at [offset, offset + L): its next tokens,
// -100 (ignored) everywhere else and at its last token (whose target is the
// next document's first).
void set_document_targets(at::Tensor& targets, int64_t row, const at::Tensor& tokens,
                          int64_t offset, int64_t length) {
  for (int64_t t = offset; t + 1 < offset + length; ++t) {
    targets[row][t] = tokens[row][t + 1].item<int64_t>();
  }
}

struct DocumentRun {
  at::Tensor logits;
  std::vector<std::pair<std::string, at::Tensor>> grads;
};

DocumentRun run_documents(ModelPart& part, const at::Tensor& tokens, const at::Tensor& targets,
        const ops::DocumentsPtr& documents, double scale = 1.0) {
  part.zero_grad();
  part.set_documents(documents);
  DocumentRun r;
  r.logits = part.forward({tokens}).at(0);
  (summed_cross_entropy(r.logits, targets) * scale).backward();
  r.logits = r.logits.detach();
  for (const auto& p : part.named_parameters()) {
    if (p.value().grad().defined()) r.grads.emplace_back(p.key(), p.value().grad().clone());
  }
  return r;
}

// Rows A | B | C and C | B | A: B's logits in both rows against B alone,
// bitwise, or with `logits_bound` > 0 to that bound relative to the largest
// logit; the gradients of the loss over both rows' B against twice B
// alone's, to `bound` relative to each tensor's largest entry.
void expect_b_as_alone(const std::vector<std::string>& overrides, double bound,
                       double logits_bound = 0) {
  at::set_num_threads(1);
  auto cfg = JobConfig::parse("", "test", overrides);
  auto part = build_model_part(cfg);
  part->init_weights(7);
  part->train();
  const int64_t a = 5, b = 11, c = 7;
  const auto A = document(a, 1), B = document(b, 2), C = document(c, 3);
  const auto packed = at::stack({at::cat({A, B, C}), at::cat({C, B, A})});  // [2, T]
  const int64_t offsets[2] = {a, c};
  auto targets = at::full(packed.sizes(), -100, torch::kLong);
  for (int64_t row = 0; row < 2; ++row) set_document_targets(targets, row, packed, offsets[row], b);
  const auto alone = B.unsqueeze(0);
  auto alone_targets = at::full(alone.sizes(), -100, torch::kLong);
  set_document_targets(alone_targets, 0, alone, 0, b);

  // The reference: B alone, one causal sequence from position 0.
  const DocumentRun reference = run_documents(*part, alone, alone_targets, nullptr, 2.0);
  const DocumentRun blocks = run_documents(*part, packed, targets, documents_of(packed));
  for (int64_t row = 0; row < 2; ++row) {
    const auto mine = blocks.logits[row].narrow(0, offsets[row], b);
    const double err = (mine - reference.logits[0]).abs().max().item<double>();
    if (logits_bound == 0) {
      EXPECT_TRUE(at::equal(mine, reference.logits[0]))
          << "row " << row << ": B's logits differ from B alone by up to " << err;
    } else {
      EXPECT_LE(err, logits_bound * reference.logits.abs().max().item<double>()) << "row " << row;
    }
  }
  ASSERT_EQ(blocks.grads.size(), reference.grads.size());
  double worst = 0;
  std::string worst_name;
  for (size_t i = 0; i < reference.grads.size(); ++i) {
    const auto& [name, g] = reference.grads[i];
    ASSERT_EQ(blocks.grads[i].first, name);
    const double scale = g.abs().max().item<double>();
    const double err = (blocks.grads[i].second - g).abs().max().item<double>();
    // Past the relative bound, 1e-8 absolute for a gradient that is zero but
    // for rounding (the key biases': softmax ignores a shift shared by all
    // of a query's scores).
    EXPECT_LE(err, bound * scale + 1e-8) << name << ": " << err << " of " << scale;
    const double rel = scale > 1e-6 ? err / scale : 0.0;
    if (rel > worst) worst = rel, worst_name = name;
  }
  ::testing::Test::RecordProperty("worst_relative_gradient_error", str(worst, " (", worst_name, ")"));

  // The same window as one causal sequence: B sees A (or C) and its
  // logits move, so the comparison above can fail.
  const DocumentRun causal = run_documents(*part, packed, targets, nullptr);
  EXPECT_FALSE(at::equal(causal.logits[0].narrow(0, a, b), reference.logits[0]));
}

std::vector<std::string> with(std::vector<std::string> base, const std::vector<std::string>& more) {
  base.insert(base.end(), more.begin(), more.end());
  return base;
}

const std::vector<std::string> kLlama{"model.family=llama",  "model.n_layers=2",
                                      "model.dim=32",        "model.n_heads=4",
                                      "model.n_kv_heads=2",  "training.seq_len=32",
                                      "model.attn_mask_type=block_causal"};
const std::vector<std::string> kGpt2{"model.family=gpt2",   "model.n_layers=2",
                                     "model.dim=32",        "model.n_heads=4",
                                     "training.seq_len=32", "model.attn_mask_type=block_causal"};
// 4 layers: KDA at 0 and 2, MLA (rotary) at 1 and 3, MoE from layer 1,
// AttnRes blocks of 2; KDA chunks of 4, which no document length divides.
const std::vector<std::string> kKimiK3{"model.family=kimi_k3",     "model.n_layers=4",
                                       "model.dim=32",             "model.kda_head_dim=16",
                                       "model.kda_chunk_size=4",   "model.mla_interval=2",
                                       "model.mla_rope=true",      "model.attn_res_block_size=2",
                                       "model.vision=false",       "training.seq_len=32",
                                       "model.attn_mask_type=block_causal"};

TEST(DocumentBoundaries, LlamaDocumentAsAlone) { expect_b_as_alone(kLlama, 1e-5); }

TEST(DocumentBoundaries, Gpt2DocumentAsAlone) { expect_b_as_alone(kGpt2, 1e-5); }

// With AttnRes's reads and MoE layers together, B's logits differ from B
// alone's in the last bits (2.4e-7 at most here): to a bound. The op that
// rounds a token by its place in the micro-batch is ATen's CPU elementwise
// loop: it runs a tensor's last partial vector through the scalar exp, a
// few ulp from the vector one, so a sigmoid or softmax over a narrow
// per-token width (KDA's beta over the heads, the router's scores over the
// experts) can move B's last bits with B's place in the window. With a
// dense FFN, or without AttnRes, these inputs happen to stay bitwise.
TEST(DocumentBoundaries, KimiK3DocumentAsAlone) { expect_b_as_alone(kKimiK3, 1e-4, 1e-6); }

TEST(DocumentBoundaries, KimiK3DenseDocumentAsAlone) {
  expect_b_as_alone(with(kKimiK3, {"model.moe_ffn=false"}), 1e-4);
}

TEST(DocumentBoundaries, KimiK3PlainResidualsDocumentAsAlone) {
  expect_b_as_alone(with(kKimiK3, {"model.attn_res=false"}), 1e-4);
}

// A checkpointed layer recomputes in the backward, after the part has
// moved on to the next micro-batch's documents: it keeps its own, and the
// gradients are the bits of a run without checkpointing.
TEST(DocumentBoundaries, RecomputeKeepsItsMicrobatchDocuments) {
  at::set_num_threads(1);
  for (const auto& family : {kLlama, kKimiK3}) {
    std::vector<std::vector<at::Tensor>> grads;
    for (const char* mode : {"none", "full"}) {
      auto part = build_model_part(
          JobConfig::parse("", "test", with(family, {str("activation_checkpoint.mode=", mode)})));
      part->init_weights(7);
      part->train();
      const auto first = at::cat({document(6, 1), document(9, 2), document(8, 3)}).unsqueeze(0);
      const auto second = at::cat({document(12, 4), document(11, 5)}).unsqueeze(0);
      auto targets = at::full(first.sizes(), -100, torch::kLong);
      set_document_targets(targets, 0, first, 0, 23);
      part->set_documents(documents_of(first));
      auto loss = summed_cross_entropy(part->forward({first}).at(0), targets);
      part->set_documents(documents_of(second));
      auto other = part->forward({second}).at(0);
      loss.backward();
      std::vector<at::Tensor> g;
      for (const auto& p : part->parameters()) {
        if (p.grad().defined()) g.push_back(p.grad().clone());
      }
      grads.push_back(g);
    }
    ASSERT_EQ(grads[0].size(), grads[1].size());
    for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_TRUE(at::equal(grads[0][i], grads[1][i])) << i;
  }
}

// Under reset_position_ids = false positions run through the window: B's
// logits differ from B alone's (it sits at position a), while the first
// document, at position 0 either way, keeps them.
TEST(DocumentBoundaries, PositionsRunThroughTheWindowWithoutReset) {
  at::set_num_threads(1);
  for (const auto& family : {kLlama, kGpt2}) {
    auto part = build_model_part(JobConfig::parse("", "test", family));
    part->init_weights(7);
    const auto A = document(5, 1), B = document(11, 2);
    const auto packed = at::cat({A, B}).unsqueeze(0);
    torch::NoGradGuard no_grad;
    part->set_documents(documents_of(packed, /*reset_positions=*/false));
    const auto logits = part->forward({packed}).at(0);
    part->set_documents(nullptr);
    const auto a_alone = part->forward({A.unsqueeze(0)}).at(0);
    const auto b_alone = part->forward({B.unsqueeze(0)}).at(0);
    EXPECT_TRUE(at::equal(logits[0].narrow(0, 0, 5), a_alone[0]));
    EXPECT_FALSE(at::equal(logits[0].narrow(0, 5, 11), b_alone[0]));
  }
}

TEST(DocumentBoundaries, KeysAreCheckedAtLoad) {
  EXPECT_THROW(JobConfig::parse("", "test", {"model.attn_mask_type=document"}), ConfigError);
  EXPECT_THROW(JobConfig::parse("", "test", {"model.reset_position_ids=true"}), ConfigError);
  const auto block = JobConfig::parse("", "test", {"model.attn_mask_type=block_causal"});
  EXPECT_TRUE(block.model.block_causal());
  EXPECT_TRUE(block.model.resets_positions());
  EXPECT_FALSE(JobConfig::parse("", "test", {"model.attn_mask_type=block_causal",
                                              "model.reset_position_ids=false"})
                   .model.resets_positions());
  EXPECT_FALSE(JobConfig::defaults().model.block_causal());
  // exact16 has no token mixer that documents could cut.
  EXPECT_THROW(build_model_part(JobConfig::parse(
                   "", "test", {"model.family=exact16", "model.attn_mask_type=block_causal"})),
               ConfigError);
}


}  // namespace
}  // namespace viaduct
