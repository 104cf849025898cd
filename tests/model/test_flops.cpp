// The model's training FLOPs in their two parts (ModelInfo's
// flops_per_token_outside_attention and attention_flops_per_pair) and the
// FLOPs of a micro-batch's documents under block_causal, against closed
// forms written here from each family's shapes: llama and gpt2 (PaLM's
// 6 N + 12 L D T), kimi_k3 (MLA's 6 H (qk + v) per pair; KDA outside
// attention), exact16 (no attention).
// See Notes [FLOPs per token], [FLOPs of a step's documents].
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "config/job_config.h"
#include "model/model.h"

namespace viaduct {
namespace {

// llama: 3 layers, D 64, 4 heads of 16, 2 KV heads, SwiGLU of 96, V 320.
constexpr double kLlamaL = 3, kLlamaD = 64, kLlamaKv = 2 * 16, kLlamaF = 96,
                 kLlamaV = 320;
const std::vector<std::string> kFlopsLlama{
    "model.family=llama",   "model.n_layers=3",   "model.dim=64",
    "model.n_heads=4",      "model.n_kv_heads=2", "model.ffn_hidden_dim=96",
    "model.vocab_size=320", "training.seq_len=16"};

// 6 x the matmuls' parameters: wq and wo (D x D), wk and wv (D x kv), the
// SwiGLU's three D x F, and the head's V x D.
constexpr double kLlamaOutside =
    6 * (kLlamaL * (2 * kLlamaD * kLlamaD + 2 * kLlamaD * kLlamaKv +
                    3 * kLlamaD * kLlamaF) +
         kLlamaV * kLlamaD);
// 12 L D T per token at a window of T: 12 L D per (query, key) pair.
constexpr double kLlamaPair = 12 * kLlamaL * kLlamaD;

ModelInfo describe_for_flops(std::vector<std::string> overrides,
                             const std::string& more = "") {
  if (!more.empty()) overrides.push_back(more);
  return describe_model(JobConfig::parse("", "test", overrides));
}

// Documents of one row per entry of `lengths`, each row the documents of
// those lengths end to end.
ops::Documents documents_of_lengths(
    const std::vector<std::vector<int64_t>>& lengths, int64_t seq_len) {
  auto starts =
      at::zeros({static_cast<int64_t>(lengths.size()), seq_len}, at::kBool);
  for (size_t r = 0; r < lengths.size(); ++r) {
    int64_t start = 0;
    for (const auto l : lengths[r]) {
      starts[static_cast<int64_t>(r)][start] = true;
      start += l;
    }
  }
  return ops::Documents(starts, /*reset_positions=*/true);
}

TEST(ModelFlops, LlamaAttentionPerPairFromShapes) {
  const auto info = describe_for_flops(kFlopsLlama);
  EXPECT_EQ(info.attention_flops_per_pair, kLlamaPair);
  EXPECT_EQ(info.flops_per_token_outside_attention, kLlamaOutside);
  // The full window's count is unchanged: 6 N + 12 L D T.
  EXPECT_EQ(info.flops_per_token, kLlamaOutside + 12 * kLlamaL * kLlamaD * 16);
  const auto longer = describe_for_flops(kFlopsLlama, "training.seq_len=64");
  EXPECT_EQ(longer.attention_flops_per_pair, kLlamaPair);
  EXPECT_EQ(longer.flops_per_token,
            kLlamaOutside + 12 * kLlamaL * kLlamaD * 64);
}

TEST(ModelFlops, Gpt2AttentionPerPairFromShapes) {
  // 2 layers, D 32, MHA, biases, a GELU MLP of 4 D, V 320 (tied: the head's
  // matmul runs all the same).
  const double L = 2, D = 32, V = 320, F = 4 * D, T = 16;
  const auto info = describe_for_flops({"model.family=gpt2", "model.n_layers=2",
                                        "model.dim=32", "model.n_heads=4",
                                        "training.seq_len=16"});
  const double attention_params =
      4 * D * D + 4 * D;                        // wq wk wv wo and their biases
  const double mlp_params = 2 * D * F + F + D;  // two matrices and their biases
  const double outside = 6 * (L * (attention_params + mlp_params) + V * D);
  EXPECT_EQ(info.attention_flops_per_pair, 12 * L * D);
  EXPECT_EQ(info.flops_per_token_outside_attention, outside);
  EXPECT_EQ(info.flops_per_token, outside + 12 * L * D * T);
}

// 4 layers: KDA at 0 and 2, MLA at 1 and 3 (mla_interval 2), 2 heads;
// KDA heads of 16 in chunks of 4; MLA heads qk 16 + 8, v 16; no AttnRes,
// dense FFN.
const std::vector<std::string> kFlopsKimiK3{"model.family=kimi_k3",
                                            "model.n_layers=4",
                                            "model.dim=32",
                                            "model.n_heads=2",
                                            "model.kda_head_dim=16",
                                            "model.kda_chunk_size=4",
                                            "model.mla_interval=2",
                                            "model.mla_qk_nope_head_dim=16",
                                            "model.mla_qk_rope_head_dim=8",
                                            "model.mla_v_head_dim=16",
                                            "model.attn_res=false",
                                            "model.moe_ffn=false",
                                            "model.vision=false",
                                            "training.seq_len=16"};

TEST(ModelFlops, KimiK3AttentionPerPairIsMlasAlone) {
  const double H = 2, qk = 16 + 8, v = 16;
  const double mla_pair = 6 * H * (qk + v);  // one MLA layer, fwd + bwd
  const auto info = describe_for_flops(kFlopsKimiK3);
  EXPECT_EQ(info.attention_flops_per_pair, 2 * mla_pair);
  // KDA (chunk C 4, head d 16, per head forward: 4 C d + 2 C d + 2 C d +
  // 6 d^2; training 3 x) is a per-token cost: outside attention, with the
  // matmuls' 6 (N_active - N_embedding).
  const double C = 4, d = 16;
  const double kda = 3 * H * (4 * C * d + 2 * C * d + 2 * C * d + 6 * d * d);
  const double matmuls =
      6 * static_cast<double>(info.active_params - info.embedding_params);
  EXPECT_EQ(info.flops_per_token_outside_attention, matmuls + 2 * kda);
  EXPECT_EQ(info.flops_per_token, matmuls + 2 * kda + 2 * mla_pair * 16);
  // The window changes the attention part alone.
  const auto longer = describe_for_flops(kFlopsKimiK3, "training.seq_len=48");
  EXPECT_EQ(longer.flops_per_token_outside_attention,
            info.flops_per_token_outside_attention);
  EXPECT_EQ(longer.flops_per_token - info.flops_per_token,
            2 * mla_pair * (48 - 16));
  // mla_interval 4: MLA at the last layer only.
  EXPECT_EQ(describe_for_flops(kFlopsKimiK3, "model.mla_interval=4")
                .attention_flops_per_pair,
            mla_pair);
}

TEST(ModelFlops, KimiK3WithAttnResSplitsTheSameCount) {
  // AttnRes reads and MoE count outside attention; the parts still add up
  // to the full window's count.
  const auto info =
      describe_for_flops({"model.family=kimi_k3", "model.flavor=debugmodel",
                          "model.vision=false", "training.seq_len=64"});
  // debugmodel: 24 layers, MLA at every fourth (3, 7, ..., 23), 2 heads.
  EXPECT_EQ(info.attention_flops_per_pair, 6 * (6 * 2 * (16 + 8 + 16)));
  EXPECT_EQ(info.flops_per_token, info.flops_per_token_outside_attention +
                                      info.attention_flops_per_pair * 64);
}

TEST(ModelFlops, Exact16HasNoAttentionPart) {
  const auto info = describe_for_flops({"model.family=exact16"});
  EXPECT_EQ(info.attention_flops_per_pair, 0.0);
  EXPECT_GT(info.flops_per_token, 0.0);
  EXPECT_EQ(info.flops_per_token_outside_attention, info.flops_per_token);
}

TEST(ModelFlops, DocumentsCountPairsWithinEachDocument) {
  const auto info = describe_for_flops(kFlopsLlama);
  // One window of 16: documents of 3, 5 and 8 tokens; each token counts the
  // keys of its own document, 3^2 + 5^2 + 8^2 pairs.
  EXPECT_EQ(training_flops(info, documents_of_lengths({{3, 5, 8}}, 16)),
            kLlamaOutside * 16 + kLlamaPair * (9 + 25 + 64));
  // Two windows: that one and a window of one document of 16.
  EXPECT_EQ(training_flops(info, documents_of_lengths({{3, 5, 8}, {16}}, 16)),
            kLlamaOutside * 32 + kLlamaPair * (9 + 25 + 64 + 16 * 16));
  // Sixteen one-token documents: one pair each.
  EXPECT_EQ(training_flops(
                info, documents_of_lengths({std::vector<int64_t>(16, 1)}, 16)),
            (kLlamaOutside + kLlamaPair) * 16);
}

TEST(ModelFlops, OneDocumentPerWindowCostsTheFullWindow) {
  // A window that is one document costs what "causal" counts: flops_per_token
  // per token, exactly.
  for (const auto& overrides :
       {kFlopsLlama, kFlopsKimiK3,
        std::vector<std::string>{"model.family=gpt2", "model.n_layers=2",
                                 "model.dim=32", "model.n_heads=4",
                                 "training.seq_len=16"}}) {
    const auto info = describe_for_flops(overrides);
    EXPECT_EQ(
        training_flops(info, documents_of_lengths({{16}, {16}, {16}}, 16)),
        info.flops_per_token * 3 * 16)
        << overrides[0];
  }
  EXPECT_EQ(describe_for_flops(kFlopsLlama).flops_per_token * 3 * 16,
            (kLlamaOutside + kLlamaPair * 16) * 3 * 16);
}

}  // namespace
}  // namespace viaduct
