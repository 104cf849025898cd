// Forward + backward time of each layer kind at one realistic shape
// (default B=1, T=4096, D=2048, bf16 on CUDA), against a FLOP floor.
//
// The floor: 6 x (the layer's parameters) x tokens for its projections (a
// matmul's forward and two backward products), plus for the attention kinds
// 3 x 2 x 2 x T^2/2 x H x d per sequence (causal scores and values, fwd+bwd),
// over the H200's 989.4 TFLOP/s dense bf16 peak. KDA's chunked core is not in
// the floor (it is below the projections' cost at C=64 in exact arithmetic
// counts but runs as many small batched products).
//
// usage: layer_bench [--tokens T] [--dim D] [--batch B] [--iters N] [--cpu] [--only SUBSTRING]
//                    [--blocks K] [--doc-mean L]
// --doc-mean: each token mixer (attention, MLA, KDA and its core at chunk
// 64) runs a second time over packed documents, as under
// model.attn_mask_type = block_causal: each row cut into documents of
// lengths drawn from an exponential law of mean L (seeded; at least one
// token), the attention floor over the documents' own causal pairs. The
// two rows of a mixer, in one process, are block_causal's cost against
// causal at the layer.
// --blocks: the AttnRes reads' completed blocks (default 8; the read has
// K + 1 sources). "attn_res read (K blocks, slots)" is the same read with a
// slot per block already holding a gradient (Note [AttnRes block gradients
// in place]): the backward adds into the slots, as in the model's step.
// --cpu, or model.cuda_kernels' choice on a GPU without viaduct's kernels,
// runs the ATen forms.
// --only "bias grad": the bias gradient's forms alone (ATen's sum over the
// tokens, in dy's dtype and fp32 out, against cuBLAS's product with ones,
// the same two ways), at widths D, 3D and 4D of B x T tokens, e.g. gpt2's:
// --batch 8 --tokens 1024 --dim 768.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.h"
#include "core/device.h"
#include "core/torch_compat.h"
#include "kernels/fused.h"
#include "kernels/weight_cache.h"
#include "model/attn_res.h"
#include "model/kda.h"
#include "model/layers.h"
#include "model/mla.h"
#include "model/moe.h"
#include "ops/documents.h"
#include "ops/kda.h"
#include "ops/l2_norm.h"

using namespace viaduct;

namespace {

struct Result {
  std::string name;
  int64_t params;
  double ms;
  double floor_ms;
};

double time_fwd_bwd(torch::nn::Module& m, const std::function<at::Tensor(const at::Tensor&)>& fn,
                    const at::Tensor& x, int iters, const at::Device& dev) {
  return bench::median_ms(
      [&] {
        auto y = fn(x.detach().requires_grad_(true));
        y.backward(at::ones_like(y));
      },
      iters, dev, [&] { m.zero_grad(); });
}

}  // namespace

int main(int argc, char** argv) {
  int64_t T = 4096, D = 2048, B = 1, K = 8;
  int iters = 10;
  double doc_mean = 0;
  bool cpu = false;
  std::string only;  // run only the layers whose name contains this
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return std::stoll(argv[++i]); };
    if (a == "--tokens") T = next();
    else if (a == "--dim") D = next();
    else if (a == "--batch") B = next();
    else if (a == "--iters") iters = static_cast<int>(next());
    else if (a == "--blocks") K = next();
    else if (a == "--cpu") cpu = true;
    else if (a == "--doc-mean" && i + 1 < argc) doc_mean = std::stod(argv[++i]);
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
  }
  const auto dev = cpu ? at::Device(at::kCPU) : resolve_device("auto");
  const auto dtype = dev.is_cuda() ? at::kBFloat16 : at::kFloat;
  const double peak = peak_flops(dev, dtype).value_or(989.4e12);
  const int64_t H = std::max<int64_t>(4, D / 128), hd = D / H;
  auto x = at::randn({B, T, D}, at::TensorOptions().device(dev)).to(dtype);
  std::vector<Result> rows;
  // What a rank's model gives its modules: the GEMM path probed on the
  // device and one weight cache (train/rank_model.cpp).
  ops::KernelOptions layer_options;
  layer_options.capabilities = ops::probe_capabilities(dev);
  layer_options.weight_cache = std::make_shared<kernels::WeightCache>();
  auto run = [&](const std::string& name, torch::nn::Module& m,
                 const std::function<at::Tensor(const at::Tensor&)>& fn, double core_flops) {
    if (!only.empty() && name.find(only) == std::string::npos) return;
    ops::set_kernel_options(m, layer_options);
    m.to(dev);
    int64_t params = 0;
    for (const auto& p : m.parameters()) params += p.numel();
    const double floor = (6.0 * params * B * T + core_flops) / peak * 1e3;
    rows.push_back({name, params, time_fwd_bwd(m, fn, x, iters, dev), floor});
    std::printf("%-28s %10.3f ms\n", name.c_str(), rows.back().ms);
    std::fflush(stdout);
  };
  const double attn_core = 3.0 * 2 * 2 * (double(T) * T / 2) * H * hd * B;
  std::unique_ptr<ops::Documents> docs;
  double doc_pairs = 0;  // the causal pairs inside documents, all rows
  if (doc_mean > 0) {
    docs = std::make_unique<ops::Documents>(bench::document_starts(B, T, doc_mean), true);
    for (const auto& sp : docs->spans()) doc_pairs += double(sp.length) * sp.length / 2;
    std::printf("documents: %zu over %lld rows, mean length %.1f\n", docs->spans().size(),
                (long long)B, double(B * T) / docs->spans().size());
  }
  // The mixer once causal, and again over the documents when asked.
  auto mixer = [&](const std::string& name, torch::nn::Module& m,
                   const std::function<at::Tensor(const at::Tensor&, const ops::Documents*)>& fn,
                   double causal_flops, double doc_flops) {
    run(name, m, [&](const at::Tensor& in) { return fn(in, nullptr); }, causal_flops);
    if (docs) {
      run(name + ", documents", m, [&](const at::Tensor& in) { return fn(in, docs.get()); },
          doc_flops);
    }
  };
  const double attn_docs = 3.0 * 2 * 2 * doc_pairs * H * hd;

  {
    AttentionOptions o;
    o.dim = D; o.n_heads = H; o.n_kv_heads = H / 4; o.max_seq_len = T; o.rope_theta = 500000;
    Attention m(o);
    m->init_weights(1, "a.", 0.02, 0.02, true);
    mixer("gqa attention (llama)", *m,
          [&](const at::Tensor& in, const ops::Documents* d) { return m->forward(in, d); },
          attn_core, attn_docs);
  }
  {
    // gpt2's attention: biases, no rotation, a key head per query head (its
    // q, k and v are the qkv product's slices as they are).
    AttentionOptions o;
    o.dim = D; o.n_heads = H; o.n_kv_heads = H; o.max_seq_len = T; o.bias = true; o.rope = false;
    Attention m(o);
    m->init_weights(1, "g.", 0.02, 0.02, true);
    mixer("mha attention (gpt2)", *m,
          [&](const at::Tensor& in, const ops::Documents* d) { return m->forward(in, d); },
          attn_core, attn_docs);
  }
  {
    MlaOptions o;
    o.dim = D; o.n_heads = H; o.q_lora_rank = D / 2; o.kv_lora_rank = std::min<int64_t>(512, D / 4);
    o.qk_nope_head_dim = hd; o.qk_rope_head_dim = hd / 2; o.v_head_dim = hd;
    o.rope = true; o.max_seq_len = T;
    Mla m(o);
    m->init_weights(1, "m.", 0.02, 0.02);
    const double per_pair = 3.0 * 2 * 2 * H * (hd + hd / 2 + hd) / 2;
    mixer("mla", *m,
          [&](const at::Tensor& in, const ops::Documents* d) { return m->forward(in, d); },
          per_pair * (double(T) * T / 2) * B, per_pair * doc_pairs);
  }
  for (int64_t chunk : {16, 64}) {
    KdaOptions o;
    o.dim = D; o.n_heads = H; o.head_dim = hd; o.chunk_size = chunk;
    Kda m(o);
    m->init_weights(1, "k.", 0.02, 0.02);
    const std::string name = "kda (chunk " + std::to_string(chunk) + ")";
    if (chunk == 64) {
      mixer(name, *m,
            [&](const at::Tensor& in, const ops::Documents* d) { return m->forward(in, d); }, 0.0,
            0.0);
    } else {
      run(name, *m, [&](const at::Tensor& in) { return m->forward(in); }, 0.0);
    }
  }
  // The chunked gated delta rule alone, on the inputs flash-linear-
  // attention's chunk_kda takes in its "core" timing (../shared/anchors/
  // kda/bench_kda.py): q, k, v and beta in the compute dtype, g an fp32
  // per-channel log-decay, all leaves; q and k L2-normalised by the op (as
  // fla's kernel does in its first pass, and as the layer calls it: ops::
  // l2_normalize, then ops::kda on fp32 values). viaduct's kernels run at
  // chunk 64 on a GPU they were built for, the ATen form otherwise.
  for (int64_t chunk : {16, 64}) {
    auto none_holder = std::make_shared<torch::nn::Module>();  // set_kernel_options walks modules()
    auto& none = *none_holder;
    const auto o = at::TensorOptions().device(dev);
    auto q = at::randn({B, T, H, hd}, o).to(dtype).requires_grad_(true);
    auto k = at::randn({B, T, H, hd}, o).to(dtype).requires_grad_(true);
    auto v = at::randn({B, T, H, hd}, o).to(dtype).requires_grad_(true);
    auto g = (-at::softplus(at::randn({B, T, H, hd}, o))).requires_grad_(true);
    auto beta = at::sigmoid(at::randn({B, T, H}, o)).to(dtype).requires_grad_(true);
    auto core = [&, chunk](const at::Tensor&, const ops::Documents* d) {
      for (auto* l : {&q, &k, &v, &g, &beta}) l->mutable_grad().reset();
      ops::KernelOptions ko;
      auto qn = ops::l2_normalize(q, 1e-6, 1.0 / std::sqrt(double(hd)), ko);
      auto kn = ops::l2_normalize(k, 1e-6, 1.0, ko);
      return ops::kda(qn, kn, v.to(at::kFloat), g, beta.to(at::kFloat), chunk, ko, {}, d);
    };
    const std::string name = "kda core (chunk " + std::to_string(chunk) + ")";
    if (chunk == 64) {
      mixer(name, none, core, 0.0, 0.0);
    } else {
      run(name, none, [&](const at::Tensor& in) { return core(in, nullptr); }, 0.0);
    }
  }
  {
    SwiGLU m(D, 4 * D);
    m->init_weights(1, "f.", 0.02, 0.02);
    run("swiglu ffn (4D)", *m, [&](const at::Tensor& in) { return m->forward(in); }, 0.0);
  }
  const std::pair<int64_t, int64_t> moe_shapes[] = {{16, 2}, {64, 2}, {128, 8}};
  for (const auto& [experts, topk] : moe_shapes) {
    MoeOptions o;
    o.dim = D; o.n_routed_experts = experts; o.n_activated_experts = topk; o.hidden_dim = D / 2;
    o.n_shared_experts = 1; o.bias_update_rate = 0;
    Moe m(o);
    m->init_weights(1, "e.", 0.02, 0.02);
    // Only the activated experts' work counts toward the floor.
    const double expert = 3.0 * D * (D / 2);
    const double inactive = static_cast<double>(experts - topk) * expert;
    run("moe (" + std::to_string(experts) + " experts, top-" + std::to_string(topk) + ")", *m,
        [&](const at::Tensor& in) { return m->forward(in); }, -6.0 * inactive * B * T);
  }
  {
    // The stack's blocks take gradients too, as in the model.
    std::vector<at::Tensor> stack, prior;
    for (int64_t i = 0; i < K; ++i) {
      stack.push_back(at::randn_like(x).requires_grad_(true));
      prior.push_back(at::randn_like(x));
    }
    const std::string blocks = std::to_string(K) + " blocks";
    AttnResRead m(D, 1e-6);
    m->init_weights();
    run("attn_res read (" + blocks + ")", *m,
        [&](const at::Tensor& in) {
          auto s = stack;
          s.push_back(in);
          return m->forward(s);
        },
        0.0);
    run("attn_res read (" + blocks + ", slots)", *m,
        [&](const at::Tensor& in) {
          auto s = stack;
          s.push_back(in);
          std::vector<at::Tensor> slots;
          for (int64_t i = 0; i < K; ++i) {  // each holding a gradient (no copy: set_)
            slots.push_back(attn_res_new_slot(stack[static_cast<size_t>(i)]));
            kernels::attn_res_slot_add(slots.back(), prior[static_cast<size_t>(i)]);
          }
          slots.emplace_back();  // none for the partial sum
          return m->forward(s, &slots);
        },
        0.0);
    // The read and the RMSNorm after it: as two ops, and as the model runs
    // them (one kernel each way where the kernels take them, Note [AttnRes
    // read with its norm]; the same two ops elsewhere).
    RMSNorm next(D, 1e-6);
    next->to(x.device());
    for (const bool fused : {false, true}) {
      run("attn_res read+norm (" + blocks + ", slots" + (fused ? ", fused)" : ")"), *m,
          [&, fused](const at::Tensor& in) {
            auto s = stack;
            s.push_back(in);
            std::vector<at::Tensor> slots;
            for (int64_t i = 0; i < K; ++i) {
              slots.push_back(attn_res_new_slot(stack[static_cast<size_t>(i)]));
              kernels::attn_res_slot_add(slots.back(), prior[static_cast<size_t>(i)]);
            }
            slots.emplace_back();
            return fused ? m->forward_normed(s, &slots, *next) : next->forward(m->forward(s, &slots));
          },
          0.0);
    }
    // The same read in its keys form (Note [AttnRes read without keys]):
    // RMSNorm over the fp32 stack [N, B, T, D], then the query; autograd
    // keeps the stack and the keys.
    AttnResRead k(D, 1e-6);
    k->init_weights();
    run("attn_res read, keys form", *k,
        [&](const at::Tensor& in) {
          auto s = stack;
          s.push_back(in);
          auto v = at::stack(s, 0).to(at::kFloat);
          auto logits = at::matmul(k->norm->forward(v), k->query);
          auto alpha = at::softmax(logits, 0);
          return (alpha.unsqueeze(-1) * v).sum(0).to(in.scalar_type());
        },
        0.0);
  }
  // A linear's bias gradient, the sum of dy over the tokens (gpt2's 48 a
  // step: qkv 3D, wo D, the MLP's 4D and D wide), four ways: ATen's sum
  // over the rows in dy's dtype and with an fp32 result (what MixedLinear's
  // backward runs), and cuBLAS's product with a ones vector, in dy's dtype
  // and as one GEMM writing fp32 (compat::matmul_into_fp32_; its fallback
  // where the build has none). Each timed over 20 calls in a row (one call
  // is a few microseconds, under the synchronisation around a timing), with
  // each one's largest relative error against the fp64 sum and the bytes
  // the gradient's one read takes, left to the reader.
  if (only.empty() || std::string("bias grad").find(only) != std::string::npos) {
    std::printf("\n| bias grad ([%lld tokens, width], %s, %s) | bytes read | sum(0) us | sum(0) fp32 out us | ones @ dy us | ones @ dy fp32 out us | max rel: sum, sum fp32, ones, ones fp32 |\n",
                (long long)(B * T), c10::toString(dtype), device_name(dev).c_str());
    std::printf("|---|---|---|---|---|---|---|\n");
    const bool fp32_out = !compat::fp32_out_gemm_refusal(dev).has_value();
    for (const int64_t width : {D, 3 * D, 4 * D}) {
      const auto o = at::TensorOptions().device(dev);
      const auto dy = at::randn({B * T, width}, o).to(dtype);
      const auto ones = at::ones({1, B * T}, o).to(dtype);
      const auto ref = dy.to(at::kCPU, at::kDouble).sum(0);
      auto rel = [&](const at::Tensor& got) {
        return ((got.reshape({-1}).to(at::kCPU, at::kDouble) - ref).abs().max() /
                ref.abs().max())
            .item<double>();
      };
      constexpr int kCalls = 20;
      at::Tensor by_sum, by_sum32, by_gemv, by_gemm32 = at::empty({1, width}, o.dtype(at::kFloat));
      auto time = [&](const std::function<void()>& f) {
        return 1e3 * bench::median_ms(
                         [&] {
                           for (int c = 0; c < kCalls; ++c) f();
                         },
                         iters, dev) /
               kCalls;
      };
      const double sum_us = time([&] { by_sum = dy.sum(0); });
      const double sum32_us = time([&] { by_sum32 = dy.sum(0, false, at::kFloat); });
      const double gemv_us = time([&] { by_gemv = at::mm(ones, dy); });
      const double gemm32_us =
          time([&] { compat::matmul_into_fp32_(by_gemm32, ones, dy, false, fp32_out); });
      std::printf("| width %lld | %.1f MB | %.1f | %.1f | %.1f | %.1f | %.1e, %.1e, %.1e, %.1e |\n",
                  (long long)width, static_cast<double>(dy.numel() * dy.element_size()) / 1e6,
                  sum_us, sum32_us, gemv_us, gemm32_us, rel(by_sum), rel(by_sum32), rel(by_gemv),
                  rel(by_gemm32));
    }
  }
  std::printf("\n| layer (B=%lld, T=%lld, D=%lld, %s, %s) | params | fwd+bwd ms | floor ms | floor/measured |\n",
              (long long)B, (long long)T, (long long)D, c10::toString(dtype),
              device_name(dev).c_str());
  std::printf("|---|---|---|---|---|\n");
  for (const auto& r : rows) {
    std::printf("| %s | %.1fM | %.3f | %.3f | %.1f%% |\n", r.name.c_str(), r.params / 1e6, r.ms,
                r.floor_ms, 100.0 * r.floor_ms / r.ms);
  }
  return 0;
}
