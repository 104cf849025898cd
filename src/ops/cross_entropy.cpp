#include "ops/cross_entropy.h"

#include <algorithm>

#include "core/check.h"
#include "core/torch_compat.h"
#include "kernels/fused.h"
#include "kernels/weight_cache.h"

namespace viaduct::ops {

namespace {

// Forward computes the loss and, while each chunk's logits exist, the
// gradients of h and W; backward only scales them.
class ChunkedHeadCrossEntropy
    : public torch::autograd::Function<ChunkedHeadCrossEntropy> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h,
                            const at::Tensor& weight, const at::Tensor& targets,
                            int64_t chunk, bool fused, const KernelOptions* k) {
    at::NoGradGuard no_grad;
    const auto N = h.size(0);
    const auto acc = h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    // The bf16 head weight from the options' weight cache where the kernels
    // run (see Note [Low-precision weight cache]): no cast per step.
    const auto w = weight.scalar_type() == h.scalar_type() ? weight
                   : fused && weight.dim() == 2
                       ? kernels::cast_weights(k->weight_cache.get(), {weight}, h.scalar_type())
                       : weight.to(h.scalar_type());
    const bool need_h = h.requires_grad(), need_w = weight.requires_grad();
    auto grad_h = need_h ? at::empty(h.sizes(), h.options()) : at::Tensor();  // contiguous
    // The fused path's first chunk writes grad_w (beta 0), so only the ATen
    // form, which adds every chunk, needs it zeroed.
    auto grad_w = !need_w ? at::Tensor()
                  : fused ? at::empty(w.sizes(), w.options().dtype(acc))
                          : at::zeros(w.sizes(), w.options().dtype(acc));
    auto loss = at::zeros({}, h.options().dtype(acc));
    // See Note [The loss's gradient scale known to its forward]
    // (ops/options.h): the kernel form writes the logits' gradient scaled.
    at::Tensor grad_scale;
    if (fused && k->loss_grad_scale && k->loss_grad_scale->value.defined() &&
        k->loss_grad_scale->value.device() == h.device()) {
      grad_scale = k->loss_grad_scale->value;
    }
    for (int64_t start = 0; start < N; start += chunk) {
      const auto end = std::min(N, start + chunk);
      auto hc = h.slice(0, start, end);
      auto tc = targets.slice(0, start, end);
      if (fused) {
        // One kernel: the row losses, and the logits overwritten in place
        // by (softmax - onehot) x the scale (zero on ignored rows); no fp32
        // copy.
        auto g = at::matmul(hc, w.t()).contiguous();  // [n, V]
        loss += kernels::cross_entropy_rows_(g, tc, grad_scale).sum().to(acc);
        if (need_h) {
          auto rows = grad_h.slice(0, start, end);  // contiguous rows of grad_h
          at::mm_out(rows, g, w);
        }
        // One GEMM accumulating in fp32, no [V, D] temporaries (compat).
        if (need_w) {
          compat::matmul_into_fp32_(grad_w, g.t(), hc, /*accumulate=*/start > 0,
                                    k->capabilities.fp32_out_gemm);
        }
        continue;
      }
      auto logits = at::matmul(hc, w.t()).to(acc);  // [n, V]
      auto lse = at::logsumexp(logits, -1);          // [n]
      auto valid = tc != -100;
      auto safe = at::where(valid, tc, at::zeros_like(tc));
      auto picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1);
      loss += at::where(valid, lse - picked, at::zeros_like(lse)).sum();
      if (need_h || need_w) {
        // d loss / d logits = softmax - onehot(target), zero on ignored rows.
        auto g = (logits - lse.unsqueeze(1)).exp_();
        g.scatter_add_(1, safe.unsqueeze(1),
                       -at::ones({end - start, 1}, g.options()));
        g.mul_(valid.unsqueeze(1).to(g.scalar_type()));
        auto gc = g.to(h.scalar_type());
        if (need_h) grad_h.slice(0, start, end).copy_(at::matmul(gc, w));
        if (need_w) grad_w.add_(at::matmul(gc.t(), hc).to(acc));
      }
    }
    // Kept as data, not saved variables: the backward scales them in place
    // and hands them on (see Note [The head's gradients scaled in place]).
    if (need_h) ctx->saved_data["grad_h"] = grad_h;
    if (need_w) ctx->saved_data["grad_w"] = grad_w;
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["fused"] = fused;
    ctx->saved_data["grad_scale"] = grad_scale;  // undefined: not applied
    return loss;
  }

  // Note [The head's gradients scaled in place]
  // The forward computed the head's gradients; the backward only scales them
  // by the loss's incoming gradient; on the kernel path by its ratio to the
  // factor the forward applied, which leaves them untouched where the two
  // are equal (see Note [The loss's gradient scale known to its forward],
  // ops/options.h). Scaling a fresh copy would hold the [V, D] fp32 weight
  // gradient twice at the step's peak (the backward's
  // start), so each is scaled in place and moved out of the node, its one
  // reference, which also lets AccumulateGrad take it as the weight's
  // gradient without a copy. Each is computed only when asked for: a split
  // backward (the zero-bubble schedules' input pass, then the weight pass
  // over the same graph) runs this node twice, once for each.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& go = grads[0];
    const bool fused = ctx->saved_data["fused"].toBool();
    const auto applied = ctx->saved_data["grad_scale"].toTensor();
    auto take = [&](const char* key) {
      VIADUCT_ASSERT(ctx->saved_data.count(key) == 1, "chunked head loss: the backward was "
                     "asked for ", key, " a second time (it hands each gradient on once)");
      auto t = ctx->saved_data[key].toTensor();
      ctx->saved_data.erase(key);
      if (!fused) return t.mul_(go.to(t.scalar_type()));
      kernels::scale_by_ratio_(t, go.to(at::kFloat).reshape({}), applied);
      return t;
    };
    at::Tensor gh, gw;
    if (ctx->needs_input_grad(0)) gh = take("grad_h");
    if (ctx->needs_input_grad(1)) {
      gw = take("grad_w").to(
          static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt()));
    }
    return {gh, gw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor chunked_head_cross_entropy(const at::Tensor& h, const at::Tensor& weight,
                                      const at::Tensor& targets, int64_t chunk_tokens,
                                      const KernelOptions& k) {
  VIADUCT_CHECK(chunk_tokens > 0, "chunked head loss: chunk must be > 0");
  return ChunkedHeadCrossEntropy::apply(h, weight, targets.reshape(-1), chunk_tokens,
                                        fused_runs(h, k), &k);
}

int64_t loss_chunk_tokens(int64_t configured, bool kernels_run) {
  if (configured >= 0) return configured;
  return kernels_run ? kAutoLossChunkTokens : 0;  // auto
}

int64_t loss_chunk_tokens(int64_t configured, const at::Tensor& h, const KernelOptions& k) {
  return loss_chunk_tokens(configured, configured < 0 && fused_runs(h, k));
}

}  // namespace viaduct::ops
