// The MoE layer under expert parallelism, ranks as threads exchanging rows
// in memory (see Note [Expert parallelism], model/moe.h): the dispatch against
// its closed form (every token copy reaches its expert's rank once, grouped
// by source then expert, in the source's slot order), and each rank's
// outputs, token gradients and per-source expert gradients against the
// unsharded layer run on that rank's tokens alone: bitwise on the CPU; on a
// GPU (fp32, where a GEMM library may pick its kernel by the operands'
// addresses) the forward within 1e-6 of it, the bits reported. (On a GPU
// the ranks' backwards would share the autograd engine's one device
// thread, where a rank waiting in the exchange stops the others: in a real
// job each rank is a process.)
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <barrier>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <thread>

#include "common/cuda_test.h"
#include "model/moe.h"

namespace viaduct {
namespace {

// Ranks as threads: exchange() deposits this rank's rows, waits for every
// rank, and cuts its rows out of every deposit.
class ThreadHub {
 public:
  explicit ThreadHub(int size)
      : size_(size), sync_(size), rows_(static_cast<size_t>(size)), sends_(rows_.size()) {}
  at::Tensor exchange(int rank, const at::Tensor& rows, const std::vector<int64_t>& send,
                      const std::vector<int64_t>& recv) {
    rows_[static_cast<size_t>(rank)] = rows.contiguous();
    sends_[static_cast<size_t>(rank)] = send;
    sync_.arrive_and_wait();
    std::vector<at::Tensor> parts;
    for (int s = 0; s < size_; ++s) {
      const auto& from = sends_[static_cast<size_t>(s)];
      int64_t off = 0;
      for (int q = 0; q < rank; ++q) off += from[static_cast<size_t>(q)];
      const int64_t n = from[static_cast<size_t>(rank)];
      EXPECT_EQ(n, recv[static_cast<size_t>(s)]) << "rank " << rank << " from " << s;
      parts.push_back(rows_[static_cast<size_t>(s)].narrow(0, off, n));
    }
    auto out = at::cat(parts, 0).clone();
    sync_.arrive_and_wait();  // every rank has read every deposit
    return out;
  }
  int size() const { return size_; }

 private:
  int size_;
  std::barrier<> sync_;
  std::vector<at::Tensor> rows_;
  std::vector<std::vector<int64_t>> sends_;
};

class ThreadExchange : public ExpertExchange {
 public:
  ThreadExchange(ThreadHub& hub, int rank) : hub_(hub), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return hub_.size(); }
  at::Tensor exchange(const at::Tensor& rows, const std::vector<int64_t>& send,
                      const std::vector<int64_t>& recv) override {
    auto out = hub_.exchange(rank_, rows, send, recv);
    received.push_back(out);
    return out;
  }
  std::vector<at::Tensor> received;  // every call's rows, in call order

 private:
  ThreadHub& hub_;
  int rank_;
};

MoeOptions options() { return MoeOptions{16, 8, 2, 24, 1, 1.5, 0.01}; }

struct RankResult {
  at::Tensor y, dx, drouter;
  std::vector<std::vector<at::Tensor>> source_grads;  // [source][w]
  std::vector<at::Tensor> received;                   // the exchanges' rows
  at::Tensor w1;                                      // the local rows
};

// Rank r's tokens: x_r [B, T, D], and the weights of its loss.
at::Tensor tokens(int rank, int64_t n) {
  torch::manual_seed(100 + static_cast<uint64_t>(rank));
  return torch::randn({1, n, options().dim});
}
at::Tensor loss_weights(int rank, int64_t n) {
  torch::manual_seed(200 + static_cast<uint64_t>(rank));
  return torch::randn({1, n, options().dim});
}

// `bias`: added to expert_bias on every rank (steers the routing).
std::vector<RankResult> run_sharded(int ep, int64_t n, const at::Tensor& bias,
                                    const at::Device& device, const MoeOptions& opts) {
  // Drawn here: the global generator is not for threads.
  std::vector<at::Tensor> xs, cs;
  for (int r = 0; r < ep; ++r) {
    xs.push_back(tokens(r, n));
    cs.push_back(loss_weights(r, n));
  }
  ThreadHub hub(ep);
  std::vector<RankResult> out(static_cast<size_t>(ep));
  std::vector<std::thread> threads;
  for (int r = 0; r < ep; ++r) {
    threads.emplace_back([&, r] {
      at::set_num_threads(1);
      Moe moe(opts);
      auto ex = std::make_shared<ThreadExchange>(hub, r);
      moe->shard_experts(ex);
      moe->init_weights(7, "moe.", 0.3, 0.3);
      moe->to(device);
      {
        torch::NoGradGuard g;
        moe->expert_bias.add_(bias.to(device));
      }
      auto& res = out[static_cast<size_t>(r)];
      if (!device.is_cpu()) {
        torch::NoGradGuard g;
        res.y = moe->forward(xs[static_cast<size_t>(r)].to(device));
        res.received = ex->received;
        return;
      }
      auto x = xs[static_cast<size_t>(r)].to(device).requires_grad_(true);
      auto y = moe->forward(x);
      (y * cs[static_cast<size_t>(r)].to(device)).sum().backward();
      res.y = y.detach();
      res.dx = x.grad();
      res.drouter = moe->router->weight.grad();
      res.source_grads = moe->take_source_grads();
      res.received = ex->received;
      res.w1 = moe->experts->w1.detach().clone();
      EXPECT_FALSE(moe->experts->w1.grad().defined()) << "rank " << r;
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// See Note [Expert capacity] by a plain loop: slot s = n K + j is kept when
// fewer than C earlier slots chose its expert.
at::Tensor capacity_keep_by_loop(const at::Tensor& idx, const MoeOptions& o) {
  const auto flat = idx.reshape({-1}).cpu();
  const int64_t S = flat.numel(), E = o.n_routed_experts;
  const int64_t C = o.capacity_factor > 0
                        ? std::max<int64_t>(1, static_cast<int64_t>(std::ceil(
                                                   o.capacity_factor * static_cast<double>(S) /
                                                   static_cast<double>(E))))
                        : S;
  std::vector<int64_t> taken(static_cast<size_t>(E), 0);
  auto keep = torch::zeros({S}, torch::kBool);
  for (int64_t s = 0; s < S; ++s) {
    const auto e = flat[s].item<int64_t>();
    keep[s] = taken[static_cast<size_t>(e)]++ < C;
  }
  return keep;
}

struct Reference {
  at::Tensor y, dx, drouter, idx;
  std::vector<at::Tensor> dw;  // w1, w2, w3, whole
  at::Tensor w1, slots;        // slots: x's rows repeated k times, [N K, D]
  at::Tensor keep;             // [N K]: the copies an expert takes
};

Reference run_one(int rank, int64_t n, const at::Tensor& bias, const at::Device& device,
                  const MoeOptions& opts) {
  at::set_num_threads(1);
  Moe moe(opts);
  moe->init_weights(7, "moe.", 0.3, 0.3);
  moe->to(device);
  {
    torch::NoGradGuard g;
    moe->expert_bias.add_(bias.to(device));
  }
  auto x = tokens(rank, n).to(device).requires_grad_(true);
  auto y = moe->forward(x);
  (y * loss_weights(rank, n).to(device)).sum().backward();
  Reference reference;
  reference.y = y.detach();
  reference.dx = x.grad();
  reference.drouter = moe->router->weight.grad();
  for (auto* w : {&moe->experts->w1, &moe->experts->w2, &moe->experts->w3}) {
    reference.dw.push_back(w->grad());
  }
  reference.w1 = moe->experts->w1.detach().clone();
  torch::NoGradGuard g;
  auto xf = x.detach().reshape({-1, options().dim});
  reference.idx = moe->route(xf).first;
  const int64_t K = options().n_activated_experts;
  reference.slots = xf.unsqueeze(1).expand({n, K, options().dim}).reshape({n * K, options().dim});
  reference.keep = capacity_keep_by_loop(reference.idx, opts);
  return reference;
}

// Bitwise on the CPU; on a GPU within `tol` (relative), the bits counted.
struct Compare {
  bool cpu = true;
  double tol = 1e-6;
  int same_bits = 0, compared = 0;
  bool operator()(const at::Tensor& a, const at::Tensor& b) {
    const bool bits = a.sizes() == b.sizes() && torch::equal(a.cpu(), b.cpu());
    ++compared;
    same_bits += bits ? 1 : 0;
    if (cpu || bits) return bits;
    return a.sizes() == b.sizes() && testing_cuda::rel_err(a, b) < tol;
  }
};

void expect_matches_one_rank(int ep, int64_t n, const at::Tensor& bias,
                             const at::Device& device = at::kCPU,
                             const MoeOptions& opts = options()) {
  const auto sharded = run_sharded(ep, n, bias, device, opts);
  const int64_t E = opts.n_routed_experts, El = E / ep;
  std::vector<Reference> references;
  for (int r = 0; r < ep; ++r) references.push_back(run_one(r, n, bias, device, opts));
  Compare same{device.is_cpu()};
  for (int r = 0; r < ep; ++r) {
    const auto& got = sharded[static_cast<size_t>(r)];
    const auto& reference = references[static_cast<size_t>(r)];
    SCOPED_TRACE("ep " + std::to_string(ep) + " rank " + std::to_string(r));
    EXPECT_TRUE(same(got.y, reference.y));
    // The dispatch's closed form: the counts, then for every source in rank
    // order the copies of this rank's experts, expert by expert, each in
    // the source's slot order.
    ASSERT_GE(got.received.size(), 3u);
    std::vector<at::Tensor> reference_rows;
    std::vector<int64_t> reference_counts;
    for (int s = 0; s < ep; ++s) {
      const auto& src = references[static_cast<size_t>(s)];
      const auto flat = src.idx.reshape({-1});
      for (int64_t e = r * El; e < (r + 1) * El; ++e) {
        const auto slots = ((flat == e) & src.keep.to(flat.device())).nonzero().reshape({-1});
        reference_counts.push_back(slots.numel());
        reference_rows.push_back(src.slots.index_select(0, slots));
      }
    }
    EXPECT_TRUE(torch::equal(got.received[0].reshape({-1}).cpu(), torch::tensor(reference_counts)));
    EXPECT_TRUE(torch::equal(got.received[1].cpu(), at::cat(reference_rows, 0).cpu()));
    if (!device.is_cpu()) {
      // The forward's exchanges alone: the counts, the rows, the outputs.
      EXPECT_EQ(got.received.size(), 3u);
      continue;
    }
    EXPECT_TRUE(torch::equal(got.w1, reference.w1.narrow(0, r * El, El)));
    EXPECT_TRUE(same(got.dx, reference.dx));
    EXPECT_TRUE(same(got.drouter, reference.drouter));
    // Each source's gradient of this rank's experts: the rows of the
    // unsharded layer's gradient on that source's tokens.
    ASSERT_EQ(got.source_grads.size(), static_cast<size_t>(ep));
    for (int s = 0; s < ep; ++s) {
      for (size_t w = 0; w < 3; ++w) {
        const auto reference_dw = references[static_cast<size_t>(s)].dw[w].narrow(0, r * El, El);
        const auto& g = got.source_grads[static_cast<size_t>(s)][w];
        if (!g.defined()) {
          EXPECT_TRUE(torch::equal(reference_dw.cpu(), torch::zeros_like(reference_dw).cpu())) << "source " << s;
          continue;
        }
        EXPECT_TRUE(same(g, reference_dw)) << "source " << s << " weight " << w;
      }
    }
  }
  if (!device.is_cpu()) {
    std::printf("[ expert layer on %s, ep %d ] %d of %d tensors bitwise the unsharded layer's\n",
                device.str().c_str(), ep, same.same_bits, same.compared);
  }
}

// Each expert's rows come from (seed, FQN, expert): a sharded rank's experts
// are the whole layer's rows bit for bit, and no two experts share a draw.
TEST(ExpertLayer, ShardedInitIsTheWholeLayersRows) {
  Moe whole(options());
  whole->init_weights(7, "moe.", 0.3, 0.3);
  const int64_t E = options().n_routed_experts;
  for (const auto& w : {whole->experts->w1, whole->experts->w2, whole->experts->w3}) {
    for (int64_t e = 1; e < E; ++e) EXPECT_FALSE(at::equal(w[e], w[0])) << e;
  }
  for (const int ep : {2, 4}) {
    ThreadHub hub(ep);
    for (int r = 0; r < ep; ++r) {
      Moe moe(options());
      moe->shard_experts(std::make_shared<ThreadExchange>(hub, r));
      moe->init_weights(7, "moe.", 0.3, 0.3);
      const int64_t local = E / ep;
      EXPECT_TRUE(at::equal(moe->experts->w1, whole->experts->w1.narrow(0, r * local, local)));
      EXPECT_TRUE(at::equal(moe->experts->w2, whole->experts->w2.narrow(0, r * local, local)));
      EXPECT_TRUE(at::equal(moe->experts->w3, whole->experts->w3.narrow(0, r * local, local)));
      EXPECT_TRUE(at::equal(moe->router->weight, whole->router->weight));
    }
  }
}

TEST(ExpertLayer, TwoRanksHaveTheBitsOfOneRankPerSource) {
  expect_matches_one_rank(2, 13, torch::zeros({options().n_routed_experts}));
}

TEST(ExpertLayer, FourRanksWithFewTokensHaveTheBitsOfOneRank) {
  // Three tokens, six copies over eight experts: most (source, expert)
  // groups are empty.
  expect_matches_one_rank(4, 3, torch::zeros({options().n_routed_experts}));
}

TEST(ExpertLayer, RanksThatReceiveNothingStillAnswerTheExchanges) {
  // Every token picks experts 0 and 1 (rank 0's at ep 4): ranks 1-3 get no
  // rows but join every all-to-all of the forward and the backward.
  auto bias = torch::zeros({options().n_routed_experts});
  bias[0] = 10.0;
  bias[1] = 9.0;
  expect_matches_one_rank(4, 5, bias);
}

// See Note [Expert capacity]: the output is the shared expert plus each kept
// copy's gated expert output, from the layer's own weights slot by slot;
// the dropped count is the loop's.
TEST(ExpertCapacity, DropsTheCopiesPastEachExpertsCapacityInSlotOrder) {
  auto o = options();
  o.capacity_factor = 0.5;  // 13 tokens x 2 copies over 8 experts: C = 2
  at::set_num_threads(1);
  Moe moe(o);
  moe->init_weights(7, "moe.", 0.3, 0.3);
  const int64_t n = 13, K = o.n_activated_experts;
  const auto x = tokens(0, n);
  const auto y = moe->forward(x).reshape({n, o.dim});
  torch::NoGradGuard g;
  const auto xf = x.reshape({n, o.dim});
  const auto [idx, w] = moe->route(xf);
  const auto keep = capacity_keep_by_loop(idx, o);
  const int64_t dropped = (keep.logical_not()).sum().item<int64_t>();
  ASSERT_GT(dropped, 0) << "the capacity should drop some copies of this routing";
  ASSERT_LT(dropped, n * K);
  EXPECT_EQ(moe->tokens_dropped.item<int64_t>(), dropped);
  auto reference = moe->shared_expert(xf);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      if (!keep[t * K + j].item<bool>()) continue;
      const auto e = idx[t][j].item<int64_t>();
      const auto xt = xf[t];
      const auto h = at::silu(at::matmul(moe->experts->w1[e], xt)) *
                     at::matmul(moe->experts->w3[e], xt);
      reference[t] += w[t][j] * at::matmul(moe->experts->w2[e], h);
    }
  }
  EXPECT_LT((y - reference).abs().max().item<double>(), 1e-5);
  // A capacity nothing reaches keeps the dropless layer's bits.
  auto wide = options();
  wide.capacity_factor = 100.0;
  Moe a(options()), b(wide);
  a->init_weights(7, "moe.", 0.3, 0.3);
  b->init_weights(7, "moe.", 0.3, 0.3);
  EXPECT_TRUE(torch::equal(a->forward(x), b->forward(x)));
}

TEST(ExpertCapacity, ShardedExpertsDropTheSameCopiesWithTheBitsOfOneRank) {
  auto o = options();
  o.capacity_factor = 0.75;
  expect_matches_one_rank(2, 13, torch::zeros({o.n_routed_experts}), at::kCPU, o);
  expect_matches_one_rank(4, 7, torch::zeros({o.n_routed_experts}), at::kCPU, o);
}

TEST(ExpertLayer, OnTheGpuMatchesOneRank) {
  if (!testing_cuda::have_gpu()) GTEST_SKIP() << "no GPU";
  auto bias = torch::zeros({options().n_routed_experts});
  expect_matches_one_rank(2, 13, bias, at::Device(at::kCUDA, 0));
  bias[0] = 10.0;
  bias[1] = 9.0;
  expect_matches_one_rank(4, 5, bias, at::Device(at::kCUDA, 0));
}

// parallelism.expert_gradient_sum = local on a GPU: the local experts run as
// grouped GEMMs over the received rows (bf16). One rank, so its backward
// needs no peer: the outputs, token gradients and expert gradients against
// the unsharded layer's grouped path.
TEST(ExpertLayer, OnTheGpuTheLocalSumRunsTheGroupedExperts) {
  if (!testing_cuda::have_gpu()) GTEST_SKIP() << "no GPU";
  const at::Device dev(at::kCUDA, 0);
  auto o = options();
  o.dim = 64;
  o.hidden_dim = 32;
  ThreadHub hub(1);
  Moe whole(o), sharded(o);
  auto ex = std::make_shared<ThreadExchange>(hub, 0);
  sharded->shard_experts(ex, /*per_source=*/false);
  for (auto* m : {&whole, &sharded}) {
    (*m)->init_weights(7, "moe.", 0.3, 0.3);
    (*m)->to(dev);
  }
  torch::manual_seed(5);
  const auto x0 = torch::randn({2, 24, o.dim}).to(dev, at::kBFloat16);
  const auto c = torch::randn({2, 24, o.dim}).to(dev, at::kBFloat16);
  auto run = [&](Moe& m) {
    auto x = x0.clone().requires_grad_(true);
    auto y = m->forward(x);
    (y.to(at::kFloat) * c.to(at::kFloat)).sum().backward();
    return std::make_pair(y.detach(), x.grad());
  };
  const auto [yw, dxw] = run(whole);
  const auto [ys, dxs] = run(sharded);
  const auto grads = sharded->take_source_grads();
  ASSERT_EQ(grads.size(), 1u);
  Compare same{false, 1e-2};  // bf16
  EXPECT_TRUE(same(ys, yw));
  EXPECT_TRUE(same(dxs, dxw));
  const std::vector<at::Tensor> reference{whole->experts->w1.grad(), whole->experts->w2.grad(),
                                     whole->experts->w3.grad()};
  for (size_t w = 0; w < 3; ++w) {
    ASSERT_TRUE(grads[0][w].defined()) << "weight " << w;
    EXPECT_TRUE(same(grads[0][w], reference[w])) << "weight " << w;
  }
  std::printf("[ grouped local experts on %s ] %d of %d tensors bitwise the unsharded layer's\n",
              dev.str().c_str(), same.same_bits, same.compared);
}

TEST(ExpertLayer, ShardingRefusesAnExpertCountItDoesNotDivide) {
  ThreadHub hub(3);
  Moe moe(options());
  try {
    moe->shard_experts(std::make_shared<ThreadExchange>(hub, 0));
    FAIL() << "sharding 8 experts over 3 ranks was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("must divide model.n_routed_experts (8)"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace viaduct
