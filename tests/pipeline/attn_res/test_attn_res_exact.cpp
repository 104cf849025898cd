// The exact16 model family (model/exact16.h) under AttnResStage, ranks as
// threads over Gloo with the real executor: its gradients are small integers
// times the loss scale, so the rank cache's regrouped sums are exact and
// every transport (the rank cache with either backward) and layout must give
// one process's bits -- and the closed form below, an integer recurrence
// written from see Note [exact16: integer gradients] independently of the model
// code. Also the family's refusals.
#include <gtest/gtest.h>

#include <cctype>

#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "config/job_config.h"
#include "core/check.h"
#include "distributed/distributed.h"
#include "distributed/launcher.h"
#include "model/exact16.h"
#include "model/families.h"
#include "model/model.h"
#include "pipeline/attn_res/attn_res_stage.h"
#include "pipeline/runtime/executor.h"
#include "pipeline/schedule/plan.h"
#include "common/thread_ranks.h"
#include "train/plan_spec.h"

namespace viaduct::pipeline {
namespace {

constexpr int kSteps = 3;
constexpr int64_t kMicro = 4, kMicroBatch = 2, kSeq = 8;
constexpr double kScale = 1.0 / 64;  // the trainer's 1 / tokens for 4 x 2 x 8
constexpr double kLr = 1.0 / 1024;
constexpr uint64_t kSeed = 7;

JobConfig exact16_config(std::vector<std::string> overrides = {}) {
  std::vector<std::string> o{"model.family=exact16",
                             "training.local_batch_size=8", "training.seq_len=8"};
  o.insert(o.end(), overrides.begin(), overrides.end());
  return JobConfig::parse("", "test", o);
}

std::shared_ptr<Exact16Part> build(const JobConfig& cfg, const std::vector<std::string>& fqns = {}) {
  auto part = std::dynamic_pointer_cast<Exact16Part>(build_model_part(cfg, fqns));
  VIADUCT_CHECK(part != nullptr, "exact16 did not build an Exact16Part");
  part->init_weights(kSeed);
  return part;
}

// Micro-batch m of step s: tokens with repeats (embedding rows collect
// several positions) and a few ignored targets (-100), the rest arbitrary.
struct Batch {
  std::vector<at::Tensor> inputs, targets;
};
Batch batch(int step) {
  Batch b;
  for (int64_t m = 0; m < kMicro; ++m) {
    auto pos = at::arange(kMicroBatch * kSeq, at::kLong).view({kMicroBatch, kSeq});
    b.inputs.push_back((pos * (3 + step) + m * 7).remainder(23));
    b.targets.push_back(at::where((pos + step + m).remainder(5).eq(0), at::full_like(pos, -100),
                                  (pos * 11 + m).remainder(257)));
  }
  return b;
}

// ------------------------------------------------------------ closed form

// Per counted token and channel, in units of the loss scale: the gradient
// of each stack entry and of each layer's two biases.
struct ClosedForm {
  std::vector<std::vector<int64_t>> entry;      // [entry][d]
  std::vector<std::vector<int64_t>> attn_bias;  // [layer][d]
  std::vector<std::vector<int64_t>> ffn_bias;   // [layer][d]
};

ClosedForm closed_form(const Exact16Options& o) {
  const auto L = static_cast<size_t>(o.n_layers), D = static_cast<size_t>(o.dim);
  ClosedForm cf;
  cf.entry.assign(static_cast<size_t>(o.n_entries()), std::vector<int64_t>(D));
  cf.attn_bias.assign(L, std::vector<int64_t>(D));
  cf.ffn_bias.assign(L, std::vector<int64_t>(D));
  for (size_t d = 0; d < D; ++d) {
    // d loss / d agg = 1: the final read gives every entry and the hidden 1.
    std::vector<int64_t> ge(static_cast<size_t>(o.n_entries()), 1);
    int64_t gh = 1;
    for (int64_t j = o.n_layers - 1; j >= 0; --j) {
      const auto sj = static_cast<size_t>(j);
      const auto a = static_cast<int64_t>(exact16_scale(j, static_cast<int64_t>(d), false));
      const auto f = static_cast<int64_t>(exact16_scale(j, static_cast<int64_t>(d), true));
      const auto c = static_cast<size_t>(j / o.block_size);
      // out = p2 + f * read(stack + p2) + bf; p2 = [p1 +] a * read(stack [+ p1]) + ba
      const int64_t g_out = gh;
      cf.ffn_bias[sj][d] = g_out;
      const int64_t g_read2 = f * g_out;
      const int64_t g_p2 = g_out + g_read2;
      cf.attn_bias[sj][d] = g_p2;
      const int64_t g_read1 = a * g_p2;
      for (size_t n = 0; n <= c; ++n) ge[n] += g_read2 + g_read1;
      gh = j % o.block_size == 0 ? ge[c]  // the input was pushed as entry c
                                 : g_p2 + g_read1;
    }
    for (size_t n = 0; n < ge.size(); ++n) cf.entry[n][d] = ge[n];
  }
  return cf;
}

at::Tensor row(const std::vector<int64_t>& v) {
  auto t = at::empty({static_cast<int64_t>(v.size())}, at::kFloat);
  for (size_t i = 0; i < v.size(); ++i) t[static_cast<int64_t>(i)] = static_cast<float>(v[i]);
  return t;
}

// ------------------------------------------------------------ runs

using BlockKey = std::tuple<int, int64_t, int64_t>;  // step, micro-batch, entry

// What a run produces: everything the comparisons look at.
struct Record {
  std::mutex mu;
  std::map<BlockKey, at::Tensor> block_grads;
  std::map<std::pair<int, int64_t>, double> losses;  // (step, micro-batch)
  std::vector<std::map<std::string, at::Tensor>> grads =
      std::vector<std::map<std::string, at::Tensor>>(kSteps);
  std::vector<std::map<std::string, at::Tensor>> params =
      std::vector<std::map<std::string, at::Tensor>>(kSteps);
  std::map<std::string, at::Tensor> initial;
  std::vector<std::string> errors;

  void probe(Exact16Part& part) {
    part.set_block_gradient_probe([this](int64_t index, int64_t entry, const at::Tensor& g) {
      const BlockKey key{static_cast<int>(index / kMicro), index % kMicro, entry};
      std::lock_guard<std::mutex> lock(mu);
      if (!block_grads.emplace(key, g.detach().clone()).second) {
        errors.push_back("block gradient of entry " + std::to_string(entry) +
                         " reported twice");
      }
    });
  }
  // SGD on `part` after recording its gradients and, after the update, its
  // parameters under `step`.
  void sgd(Exact16Part& part, int step) {
    torch::NoGradGuard g;
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& p : part.named_parameters()) {
      auto& param = p.value();
      if (!param.grad().defined()) {
        errors.push_back(p.key() + " has no gradient");
        continue;
      }
      grads[static_cast<size_t>(step)][p.key()] = param.grad().clone();
      param.add_(param.grad(), -kLr);
      param.mutable_grad() = at::Tensor();
      params[static_cast<size_t>(step)][p.key()] = param.detach().clone();
    }
  }
  void keep_initial(Exact16Part& part) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& p : part.named_parameters()) initial[p.key()] = p.value().detach().clone();
  }
};

void run_one_process(const JobConfig& cfg, Record& rec) {
  auto part = build(cfg);
  rec.keep_initial(*part);
  rec.probe(*part);
  for (int step = 0; step < kSteps; ++step) {
    const auto b = batch(step);
    for (int64_t m = 0; m < kMicro; ++m) {
      auto loss = part->forward_loss({b.inputs[static_cast<size_t>(m)]},
                                     b.targets[static_cast<size_t>(m)]);
      rec.losses[{step, m}] = loss.item<double>();
      (loss * kScale).backward();  // as the trainer does
    }
    rec.sgd(*part, step);
  }
}

void run_pipeline(const JobConfig& cfg, const PipelinePlan& plan, AttnResTransport transport,
                  AttnResCacheBackward backward, Record& rec) {
  const auto tables = std::make_shared<const BlockLayoutTables>(make_block_layout_tables(
      plan.split, exact16_options(cfg).block_size, transport, backward));
  const int port = distributed::find_free_port();
  const int pp = static_cast<int>(plan.split.pp);
  std::vector<std::thread> threads;
  for (int r = 0; r < pp; ++r) {
    threads.emplace_back([&, r] {
      try {
        const auto info = distributed::testing::loopback(r, pp, port);
        auto store = distributed::make_store(info, std::chrono::milliseconds(20000));
        distributed::ProcessGroup pg(distributed::make_group_store(store, "pp"), r, pp, at::kCPU,
                              std::chrono::milliseconds(20000), "pp", {}, "127.0.0.1");
        auto block_store = std::make_shared<RankBlockStore>(r, *tables, false);
        std::vector<std::unique_ptr<PipelineStage>> stages;
        std::vector<std::shared_ptr<Exact16Part>> parts;
        for (int64_t s : plan.split.rank_to_stages[static_cast<size_t>(r)]) {
          auto part = build(cfg, plan.split.stage_modules[static_cast<size_t>(s)]);
          rec.probe(*part);
          parts.push_back(part);
          stages.push_back(make_stage(s, plan.split.num_stages, part, tables, block_store));
        }
        PipelineExecutor ex(plan, r, std::move(stages), &pg, at::kCPU);
        ex.infer_metadata(batch(0).inputs[0]);
        for (int step = 0; step < kSteps; ++step) {
          const auto b = batch(step);
          ex.run_step(b.inputs, b.targets, kScale);
          if (ex.holds_last_stage()) {
            auto& last = *ex.stages().back();
            std::lock_guard<std::mutex> lock(rec.mu);
            for (int64_t m = 0; m < kMicro; ++m) rec.losses[{step, m}] = last.loss_sum(m).item<double>();
          }
          for (auto& p : parts) rec.sgd(*p, step);
        }
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(rec.mu);
        rec.errors.push_back("rank " + std::to_string(r) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
}

// 4 ranks, Interleaved1F1B, 4 micro-batches; the embedding and the head
// count as no unit, so 16 stages hold one layer each.
PipelinePlan plan_for(const JobConfig& cfg, int64_t stages_per_rank,
                      const std::vector<std::vector<std::string>>& per_stage = {}) {
  auto p = cfg.parallelism;
  p.pipeline_parallel_degree = 4;
  p.pipeline_parallel_schedule = "Interleaved1F1B";
  p.pipeline_parallel_microbatches = kMicro;
  p.pipeline_parallel_first_stage_less_layers = 0;
  p.pipeline_parallel_last_stage_less_layers = 0;
  if (per_stage.empty()) {
    p.pipeline_parallel_stages_per_rank = stages_per_rank;
  } else {
    p.module_fqns_per_model_part = per_stage;
  }
  return make_pipeline_plan(viaduct::plan_spec_from_config(p, model_module_fqns(cfg)));
}

std::string diff(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return "missing";
  if (a.sizes() != b.sizes()) return "shapes differ";
  return "max abs diff " + std::to_string((a - b).abs().max().item<double>());
}

// Every loss, block gradient, parameter gradient and parameter bitwise.
void expect_bitwise(const Record& reference, const Record& got, const std::string& what) {
  EXPECT_TRUE(got.errors.empty()) << what << ": " << (got.errors.empty() ? "" : got.errors[0]);
  ASSERT_EQ(got.losses.size(), static_cast<size_t>(kSteps * kMicro)) << what;
  for (const auto& [key, loss] : reference.losses) {
    EXPECT_EQ(got.losses.at(key), loss)
        << what << ": loss of step " << key.first + 1 << " micro-batch " << key.second;
  }
  ASSERT_EQ(got.block_grads.size(), reference.block_grads.size()) << what;
  for (const auto& [key, g] : reference.block_grads) {
    const auto& [step, mb, entry] = key;
    auto it = got.block_grads.find(key);
    ASSERT_NE(it, got.block_grads.end()) << what << ": no gradient for entry " << entry;
    EXPECT_TRUE(it->second.equal(g)) << what << ": step " << step + 1 << " micro-batch " << mb
                                     << " entry " << entry << ": " << diff(it->second, g);
  }
  for (int s = 0; s < kSteps; ++s) {
    const auto st = static_cast<size_t>(s);
    ASSERT_EQ(got.params[st].size(), reference.params[st].size()) << what;
    for (const auto& [fqn, p] : reference.params[st]) {
      EXPECT_TRUE(got.grads[st].at(fqn).equal(reference.grads[st].at(fqn)))
          << what << ": step " << s + 1 << " gradient of " << fqn << ": "
          << diff(got.grads[st].at(fqn), reference.grads[st].at(fqn));
      EXPECT_TRUE(got.params[st].at(fqn).equal(p))
          << what << ": step " << s + 1 << " " << fqn << ": " << diff(got.params[st].at(fqn), p);
    }
  }
}

// One process against the closed form: block and parameter gradients
// bitwise; each micro-batch loss, by linearity sum over counted tokens of
// (entry-0 gradient . embedding row + bias gradients . biases), to rounding.
void expect_closed_form(const Exact16Options& o, const Record& one) {
  const auto cf = closed_form(o);
  const int64_t D = o.dim;
  ASSERT_EQ(one.block_grads.size(), static_cast<size_t>(kSteps * kMicro * o.n_entries()));
  auto params = one.initial;
  for (int step = 0; step < kSteps; ++step) {
    const auto b = batch(step);
    auto emb_grad = at::zeros({o.vocab_size, D}, at::kFloat);
    std::vector<at::Tensor> ga, gf;  // distinct tensors: they grow in place
    for (int64_t j = 0; j < o.n_layers; ++j) {
      ga.push_back(at::zeros({D}));
      gf.push_back(at::zeros({D}));
    }
    for (int64_t m = 0; m < kMicro; ++m) {
      const auto& tokens = b.inputs[static_cast<size_t>(m)];
      const auto counted = (b.targets[static_cast<size_t>(m)] != -100).to(at::kFloat);
      for (int64_t n = 0; n < o.n_entries(); ++n) {
        const auto reference =
            counted.unsqueeze(-1) * row(cf.entry[static_cast<size_t>(n)]).view({1, 1, D}) * kScale;
        const auto& got = one.block_grads.at({step, m, n});
        EXPECT_TRUE(got.equal(reference)) << "closed form: step " << step + 1 << " micro-batch " << m
                                     << " entry " << n << ": " << diff(got, reference);
      }
      // The loss as the linear form of the inputs, in double.
      const double n_counted = counted.sum().item<double>();
      double loss = 0;
      auto e0 = row(cf.entry[0]).to(at::kDouble);
      auto rows = params.at("tok_embeddings.weight").to(at::kDouble).index_select(0, tokens.flatten());
      loss += (rows.matmul(e0) * counted.flatten().to(at::kDouble)).sum().item<double>();
      for (int64_t j = 0; j < o.n_layers; ++j) {
        const auto sj = static_cast<size_t>(j);
        const auto pre = "layers." + std::to_string(j);
        loss += n_counted * (params.at(pre + ".attention.bias").to(at::kDouble)
                                 .dot(row(cf.attn_bias[sj]).to(at::kDouble))
                                 .item<double>() +
                             params.at(pre + ".feed_forward.bias").to(at::kDouble)
                                 .dot(row(cf.ffn_bias[sj]).to(at::kDouble))
                                 .item<double>());
        ga[sj] += row(cf.attn_bias[sj]) * n_counted;
        gf[sj] += row(cf.ffn_bias[sj]) * n_counted;
      }
      EXPECT_NEAR(one.losses.at({step, m}), loss, 1e-6 * std::abs(loss) + 1e-3)
          << "closed form: loss of step " << step + 1 << " micro-batch " << m;
      emb_grad.index_add_(0, tokens.flatten(), counted.flatten().unsqueeze(1) * row(cf.entry[0]));
    }
    std::map<std::string, at::Tensor> reference{{"tok_embeddings.weight", emb_grad * kScale}};
    for (int64_t j = 0; j < o.n_layers; ++j) {
      const auto pre = "layers." + std::to_string(j);
      reference[pre + ".attention.bias"] = ga[static_cast<size_t>(j)] * kScale;
      reference[pre + ".feed_forward.bias"] = gf[static_cast<size_t>(j)] * kScale;
    }
    const auto& got = one.grads[static_cast<size_t>(step)];
    ASSERT_EQ(got.size(), reference.size());
    for (const auto& [fqn, g] : reference) {
      EXPECT_TRUE(got.at(fqn).equal(g))
          << "closed form: step " << step + 1 << " gradient of " << fqn << ": " << diff(got.at(fqn), g);
      params[fqn] = one.params[static_cast<size_t>(step)].at(fqn);
    }
  }
}

TEST(AttnResExact, Exact16OneProcessEqualsTheClosedForm) {
  if (!distributed::backend_available(at::kCPU)) GTEST_SKIP() << "no Gloo";
  at::set_num_threads(1);
  const auto cfg = exact16_config();
  const auto o = exact16_options(cfg);
  ASSERT_EQ(o.n_layers, 16);
  ASSERT_EQ(o.block_size, 4);
  const auto cf = closed_form(o);
  std::printf("[exact16] d loss / d entry per counted token (units of the loss scale):\n");
  for (size_t n = 0; n < cf.entry.size(); ++n) {
    std::printf("  e_%zu:", n);
    for (auto v : cf.entry[n]) std::printf(" %lld", static_cast<long long>(v));
    std::printf("\n");
  }
  Record one;
  run_one_process(cfg, one);
  ASSERT_TRUE(one.errors.empty()) << one.errors[0];
  expect_closed_form(o, one);
}

// One pipeline layout and AttnRes transport (with its backward for the rank
// cache, see Note [AttnRes cache backward]) of the exact16 model on 4 ranks.
struct ExactCase {
  std::string layout;  // "16_stages", "8_stages" or "uneven_8_stages"
  AttnResTransport transport;
  AttnResCacheBackward backward;
};

PipelinePlan exact_layout_plan(const JobConfig& cfg, const std::string& layout) {
  if (layout == "16_stages") return plan_for(cfg, 4);
  if (layout == "8_stages") return plan_for(cfg, 2);
  // Stages 1-3 open a block at their last layer, not their first; the last
  // stage holds the head alone.
  return plan_for(cfg, 0,
                  {{"tok_embeddings", "layers.0"},
                   {"layers.1", "layers.2", "layers.3", "layers.4"},
                   {"layers.5", "layers.6", "layers.7", "layers.8"},
                   {"layers.9", "layers.10", "layers.11", "layers.12"},
                   {"layers.13"},
                   {"layers.14"},
                   {"layers.15"},
                   {"lm_head", "attn_res_final"}});
}

class Exact16Layouts : public ::testing::TestWithParam<ExactCase> {};

TEST_P(Exact16Layouts, AgreeBitwiseWithOneProcess) {
  if (!distributed::backend_available(at::kCPU)) GTEST_SKIP() << "no Gloo";
  at::set_num_threads(1);
  const auto& c = GetParam();
  const auto cfg = exact16_config();
  // The one-process reference, once per test process.
  static Record one;
  static const bool ran = (run_one_process(cfg, one), true);
  ASSERT_TRUE(ran);
  ASSERT_TRUE(one.errors.empty()) << one.errors[0];
  const auto plan = exact_layout_plan(cfg, c.layout);
  ASSERT_EQ(plan.split.num_stages, c.layout == "16_stages" ? 16 : 8) << c.layout;
  Record rec;
  run_pipeline(cfg, plan, c.transport, c.backward, rec);
  expect_bitwise(one, rec,
                 c.layout + ", " + transport_name(c.transport) + " (backward " +
                     cache_backward_name(c.backward) + ")");
}

std::vector<ExactCase> exact_cases() {
  using B = AttnResCacheBackward;
  std::vector<ExactCase> out;
  for (const char* layout : {"16_stages", "8_stages", "uneven_8_stages"}) {
    out.push_back({layout, AttnResTransport::kRankCache, B::kDeposit});
    out.push_back({layout, AttnResTransport::kRankCache, B::kWholeStack});
    out.push_back({layout, AttnResTransport::kWholeStack, B::kWholeStack});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(
    TransportsAndLayouts, Exact16Layouts, ::testing::ValuesIn(exact_cases()),
    [](const ::testing::TestParamInfo<ExactCase>& i) {
      std::string name = i.param.layout + "_" + transport_name(i.param.transport);
      if (i.param.transport == AttnResTransport::kRankCache) {
        name += std::string("_") + cache_backward_name(i.param.backward);
      }
      for (auto& ch : name) {
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      }
      return name;
    });

// ------------------------------------------------------------ the family

TEST(Exact16Family, ModulesDescriptionAndBound) {
  const auto cfg = exact16_config();
  const auto fqns = model_module_fqns(cfg);
  ASSERT_EQ(fqns.size(), 19u);
  EXPECT_EQ(fqns.front(), "tok_embeddings");
  EXPECT_EQ(fqns[16], "layers.15");
  EXPECT_EQ(fqns[17], "lm_head");
  EXPECT_EQ(fqns.back(), "attn_res_final");
  const auto info = describe_model(cfg);
  EXPECT_EQ(info.family, "exact16");
  EXPECT_EQ(info.flavor, "debugmodel");
  EXPECT_EQ(info.params, count_parameters(*build(cfg)));
  EXPECT_EQ(info.params, 320 * 16 + 2 * 16 * 16);
  EXPECT_EQ(info.pinned_last, std::vector<std::string>{"attn_res_final"});
  EXPECT_TRUE(info.layers[12].opens_block);
  EXPECT_EQ(info.layers[15].block, 3);
  // The trainer's tables read the block size through the family registry.
  ASSERT_TRUE(attn_res_layout(cfg).has_value());
  EXPECT_EQ(attn_res_layout(cfg)->block_size, 4);
  EXPECT_EQ(attn_res_layout(exact16_config({"model.attn_res_block_size=2"}))->block_size,
            exact16_options(exact16_config({"model.attn_res_block_size=2"})).block_size);
  EXPECT_EQ(attn_res_layout(exact16_config({"model.attn_res_block_size=2"}))->block_size, 2);
  // The bound covers the closed form's values and is far below 2^24.
  const auto o = exact16_options(cfg);
  const double bound = exact16_gradient_bound(o);
  EXPECT_EQ(bound, 464.0);
  for (const auto& e : closed_form(o).entry) {
    for (auto v : e) EXPECT_LE(std::abs(static_cast<double>(v)), bound);
  }
  // The configs/kimi_k3_debug.toml job takes the family as an override, and
  // the old spelling (a kimi_k3 flavor) still builds the same model.
  const auto job = JobConfig::load("configs/kimi_k3_debug.toml", {"model.family=exact16"});
  EXPECT_NO_THROW(build_model_part(job));
  const auto old = JobConfig::load("configs/kimi_k3_debug.toml", {"model.flavor=exact16"});
  EXPECT_EQ(model_module_fqns(old), model_module_fqns(job));
  EXPECT_NO_THROW(build_model_part(old));
}

void expect_config_error(const std::vector<std::string>& overrides, const std::string& needle) {
  try {
    auto cfg = exact16_config(overrides);
    build_model_part(cfg);
    ADD_FAILURE() << "accepted: " << overrides[0];
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Exact16Family, RefusesWhatWouldBreakIntegerGradients) {
  expect_config_error({"training.seq_len=12"}, "power-of-two token count");
  expect_config_error({"training.gradient_accumulation_steps=3"}, "= 192");
  expect_config_error({"training.dtype=bfloat16"}, "float32");
  expect_config_error({"model.kda_head_dim=8"}, "model.kda_head_dim");
  expect_config_error({"model.vision=true"}, "model.vision = true");
  expect_config_error({"model.loss_chunk_tokens=64"}, "model.loss_chunk_tokens");
  expect_config_error({"model.n_layers=64"}, "2^24");
  EXPECT_NO_THROW(build_model_part(exact16_config({"model.n_layers=48", "model.vision=false"})));
  // "auto" is bf16 on CUDA: the part itself refuses a bf16 compute dtype.
  auto part = build(exact16_config());
  part->set_compute_dtype(at::kBFloat16);
  EXPECT_THROW(part->forward({batch(0).inputs[0]}), ConfigError);
}

}  // namespace
}  // namespace viaduct::pipeline
