// An integer AttnRes model under AttnResStage, ranks as threads over Gloo:
// its block gradients are small integers, so the rank cache's regrouped sums
// are exact and every transport must give one process's bits -- and the
// closed form.
//
// The model follows Note [Kimi-K3 part activations] with one read per layer:
// layer j pushes `hidden` when it opens a block, reads h = sum(sources) (the
// AttnRes read with all weights 1), and returns partial + w_j * h, w_j a
// fixed 0/1 vector. The head's logits are [sum_d agg, detach(.) - 200] with
// every target 1, so d loss / d agg = 1 exactly. The model is linear in its
// activations, so every activation gradient is an integer independent of the
// values; only the embedding trains (SGD, lr 2^-10), which moves the values
// but no gradient.
#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>

#include "core/check.h"
#include "dist/dist.h"
#include "dist/launcher.h"
#include "model/model.h"
#include "pipeline/attn_res/attn_res_stage.h"
#include "pipeline/runtime/executor.h"
#include "pipeline/schedule/plan.h"

namespace viaduct::pipeline {
namespace {

constexpr int64_t kLayers = 16, kBlock = 4, kDim = 8, kVocab = 11;
constexpr double kLr = 1.0 / 1024;

bool opens(int64_t j) { return j % kBlock == 0; }
int64_t block_of(int64_t j) { return j / kBlock; }
// w_j[d] in {0, 1}.
float weight(int64_t j, int64_t d) { return (j + d) % 3 == 0 ? 1.0f : 0.0f; }

class IntegerPart : public ModelPart {
 public:
  IntegerPart(int64_t first, int64_t end, bool has_first, bool has_last)
      : first_(first), end_(end) {
    has_first_ = has_first;
    has_last_ = has_last;
    if (has_first) {
      // Small integers, fixed.
      emb = register_parameter(
          "emb",
          (at::arange(kVocab * kDim, at::kFloat).view({kVocab, kDim}).remainder(5) - 2));
    }
    for (int64_t j = first; j < end; ++j) {
      auto w = at::empty({kDim});
      for (int64_t d = 0; d < kDim; ++d) w[d] = weight(j, d);
      w_.push_back(register_buffer("w" + std::to_string(j), w));
    }
  }
  void init_weights(uint64_t) override {}
  Activations forward(const Activations& in) override {
    at::Tensor hidden;
    std::vector<at::Tensor> stack;
    if (has_first_) {
      hidden = at::embedding(emb, in.at(0));  // [B, T, D]
    } else {
      hidden = in.at(0);
      stack.assign(in.begin() + 1, in.end());
    }
    for (int64_t j = first_; j < end_; ++j) {
      VIADUCT_CHECK(static_cast<int64_t>(stack.size()) == block_of(j) + (opens(j) ? 0 : 1),
                    "integer part: layer ", j, " got ", stack.size(), " entries");
      at::Tensor partial;
      if (opens(j)) {
        stack.push_back(hidden);
      } else {
        partial = hidden;
      }
      at::Tensor h = stack[0];
      for (size_t n = 1; n < stack.size(); ++n) h = h + stack[n];
      if (partial.defined()) h = h + partial;
      auto out = h * w_[static_cast<size_t>(j - first_)];
      hidden = partial.defined() ? partial + out : out;
    }
    if (has_last_) {
      at::Tensor agg = hidden;
      for (const auto& e : stack) agg = agg + e;
      auto l0 = agg.sum(-1, /*keepdim=*/true);  // [B, T, 1]
      return {at::cat({l0, l0.detach() - 200.0}, -1)};
    }
    Activations out{hidden};
    out.insert(out.end(), stack.begin(), stack.end());
    return out;
  }

  at::Tensor emb;

 private:
  int64_t first_, end_;
  std::vector<at::Tensor> w_;
};

// d loss / d emb-row per occurrence: the integer recurrence of the backward
// (every token position has the same gradient vector).
std::vector<int64_t> closed_form_embedding_grad() {
  std::vector<int64_t> out(kDim);
  for (int64_t d = 0; d < kDim; ++d) {
    const int64_t N = (kLayers + kBlock - 1) / kBlock;
    std::vector<int64_t> ge(static_cast<size_t>(N), 1);  // the final read
    int64_t gh = 1;                                      // hidden into the head
    for (int64_t j = kLayers - 1; j >= 0; --j) {
      const int64_t g_out = gh;
      const int64_t g_h = static_cast<int64_t>(weight(j, d)) * g_out;
      const int64_t b = block_of(j);
      // Every source -- entries 0..b, the partial when not opening -- gets g_h.
      for (int64_t n = 0; n <= b; ++n) ge[static_cast<size_t>(n)] += g_h;
      if (opens(j)) {
        gh = ge[static_cast<size_t>(b)];  // hidden_in was pushed as entry b
      } else {
        gh = g_out + g_h;  // the partial passes through and is read
      }
    }
    out[static_cast<size_t>(d)] = gh;
  }
  return out;
}

struct Batch {
  std::vector<at::Tensor> inputs, targets;
};
Batch batch(int step, int64_t micro) {
  Batch b;
  for (int64_t m = 0; m < micro; ++m) {
    b.inputs.push_back(
        (at::arange(2 * 8, at::kLong).view({2, 8}) * (3 + step) + m * 7).remainder(kVocab));
    b.targets.push_back(at::ones({2, 8}, at::kLong));
  }
  return b;
}

PipelinePlan plan_for(int64_t stages, const std::vector<std::pair<int64_t, int64_t>>& layers) {
  std::vector<std::string> fqns{"tok_embeddings"};
  for (int64_t i = 0; i < kLayers; ++i) fqns.push_back("layers." + std::to_string(i));
  fqns.insert(fqns.end(), {"norm", "lm_head"});
  PlanSpec spec;
  spec.split.model = model_layout_from_fqns(fqns);
  spec.split.pp = 4;
  spec.split.first_stage_weight = 0;
  spec.split.last_stage_weight = 0;
  if (layers.empty()) {
    spec.split.stages_per_rank = stages / 4;
  } else {
    std::vector<std::vector<std::string>> per;
    for (size_t s = 0; s < layers.size(); ++s) {
      std::vector<std::string> m;
      if (s == 0) m.push_back("tok_embeddings");
      for (int64_t j = layers[s].first; j < layers[s].second; ++j) {
        m.push_back("layers." + std::to_string(j));
      }
      if (s + 1 == layers.size()) m.insert(m.end(), {"norm", "lm_head"});
      per.push_back(m);
    }
    spec.split.module_fqns_per_stage = per;
  }
  spec.schedule = "Interleaved1F1B";
  spec.microbatches = 4;
  return make_pipeline_plan(spec);
}

// Three SGD steps; returns the embedding after each step (rank 0's).
std::vector<at::Tensor> run_pipeline(const PipelinePlan& plan, AttnResTransport transport) {
  const auto tables = std::make_shared<const BlockLayoutTables>(
      make_block_layout_tables(plan.split, kBlock, transport));
  const int port = dist::find_free_port();
  std::vector<at::Tensor> embs;
  std::vector<std::string> errors(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      try {
        dist::RendezvousInfo info;
        info.rank = r;
        info.world_size = 4;
        info.local_rank = r;
        info.local_world_size = 4;
        info.master_addr = "127.0.0.1";
        info.master_port = port;
        info.source = "env";
        auto store = dist::make_store(info, std::chrono::milliseconds(20000));
        dist::ProcessGroup pg(dist::make_group_store(store, "pp"), r, 4, at::kCPU,
                              std::chrono::milliseconds(20000), "pp", {}, "127.0.0.1");
        auto block_store = std::make_shared<RankBlockStore>(r, *tables, false);
        std::vector<std::unique_ptr<PipelineStage>> stages;
        std::shared_ptr<IntegerPart> first;
        for (int64_t s : plan.split.rank_to_stages[static_cast<size_t>(r)]) {
          auto [f, e] = plan.split.stage_layers[static_cast<size_t>(s)];
          auto part = std::make_shared<IntegerPart>(f, e, s == 0,
                                                    s == plan.split.num_stages - 1);
          if (s == 0) first = part;
          stages.push_back(make_stage(s, plan.split.num_stages, part, tables, block_store));
        }
        PipelineExecutor ex(plan, r, std::move(stages), &pg, at::kCPU);
        ex.infer_metadata(batch(0, 4).inputs[0]);
        for (int step = 0; step < 3; ++step) {
          auto b = batch(step, 4);
          ex.run_step(b.inputs, b.targets, 1.0);
          if (first) {
            torch::NoGradGuard g;
            first->emb.add_(first->emb.grad(), -kLr);
            first->emb.mutable_grad() = at::Tensor();
            embs.push_back(first->emb.detach().clone());
          }
        }
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  return embs;
}

std::vector<at::Tensor> run_one_process() {
  IntegerPart part(0, kLayers, true, true);
  std::vector<at::Tensor> embs;
  for (int step = 0; step < 3; ++step) {
    auto b = batch(step, 4);
    for (size_t m = 0; m < b.inputs.size(); ++m) {
      summed_cross_entropy(part.forward({b.inputs[m]}).at(0), b.targets[m]).backward();
    }
    torch::NoGradGuard g;
    part.emb.add_(part.emb.grad(), -kLr);
    part.emb.mutable_grad() = at::Tensor();
    embs.push_back(part.emb.detach().clone());
  }
  return embs;
}

std::vector<at::Tensor> closed_form() {
  const auto g = closed_form_embedding_grad();
  auto emb = at::arange(kVocab * kDim, at::kFloat).view({kVocab, kDim}).remainder(5) - 2;
  std::vector<at::Tensor> embs;
  for (int step = 0; step < 3; ++step) {
    auto counts = at::zeros({kVocab}, at::kLong);
    for (const auto& t : batch(step, 4).inputs) counts += at::bincount(t.flatten(), {}, kVocab);
    auto grad = at::empty({kVocab, kDim}, at::kFloat);
    for (int64_t v = 0; v < kVocab; ++v) {
      for (int64_t d = 0; d < kDim; ++d) {
        grad[v][d] = static_cast<float>(counts[v].item<int64_t>() * g[static_cast<size_t>(d)]);
      }
    }
    emb = emb - grad * kLr;
    embs.push_back(emb.clone());
  }
  return embs;
}

void expect_bitwise(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                    const std::string& what) {
  ASSERT_EQ(a.size(), 3u) << what;
  ASSERT_EQ(b.size(), 3u) << what;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(a[i].equal(b[i])) << what << ", step " << i + 1 << ": max abs diff "
                                  << (a[i] - b[i]).abs().max().item<double>();
  }
}

TEST(AttnResExact, IntegerGradientsAgreeBitwiseAcrossTransportsAndLayouts) {
  if (!dist::backend_available(at::kCPU)) GTEST_SKIP() << "no Gloo";
  at::set_num_threads(1);
  const auto g = closed_form_embedding_grad();
  std::printf("[exact16] d loss / d embedding row per occurrence:");
  for (int64_t d = 0; d < kDim; ++d) {
    std::printf(" %lld", static_cast<long long>(g[static_cast<size_t>(d)]));
    ASSERT_LT(std::abs(g[static_cast<size_t>(d)]), 1 << 20);  // exact in fp32 sums
  }
  std::printf("\n");
  const auto one = run_one_process();
  expect_bitwise(one, closed_form(), "one process vs closed form");
  const std::vector<std::pair<std::string, PipelinePlan>> layouts{
      {"16 stages", plan_for(16, {})},
      {"8 stages", plan_for(8, {})},
      {"uneven 8 stages",
       plan_for(8, {{0, 1}, {1, 5}, {5, 9}, {9, 13}, {13, 14}, {14, 15}, {15, 16}, {16, 16}})}};
  for (const auto& [name, plan] : layouts) {
    for (auto tr : {AttnResTransport::kRankCache, AttnResTransport::kWholeStack}) {
      expect_bitwise(one, run_pipeline(plan, tr), name + ", " + transport_name(tr));
    }
  }
}

}  // namespace
}  // namespace viaduct::pipeline
