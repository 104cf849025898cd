#include "kernels/fused.h"
#include "kernels/weight_cache.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <set>
#include <string>

#include "core/check.h"
#include "core/torch_compat.h"

#ifdef VIADUCT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/launchers.h"
#endif

namespace viaduct::kernels {

namespace {
std::atomic<bool> g_enabled{true};
std::atomic<bool> g_swiglu_recompute{false};
std::atomic<bool> g_swiglu_one_gemm{true};
std::atomic<bool> g_read_v2{true};
std::atomic<bool> g_read_norm_2pass{true};
const char* const kSwitchableKernels[] = {
    "rms_norm_bwd_reg", "rope_repeat",  "attn_res_read", "attn_res_read_v2",
    "attn_res_read_norm", "attn_res_read_norm_2pass", "mixed_linear", "weight_cache",
    "add_rms_norm", "adamw_clip", "adamw_batch", "clip_on_device", "kda_scan_node"};
}  // namespace

void attn_res_slot_add(const at::Tensor& slot, const at::Tensor& grad) {
  at::Tensor s = slot;  // the same TensorImpl as every holder of the slot
  if (s.numel() == 0) {
    s.set_(grad);
  } else {
    s.add_(grad);
  }
}

void save_read_slots(torch::autograd::AutogradContext* ctx,
                     const std::vector<at::Tensor>* slots) {
  if (slots == nullptr) return;
  for (size_t i = 0; i < slots->size(); ++i) {
    if ((*slots)[i].defined()) ctx->saved_data["slot" + std::to_string(i)] = (*slots)[i];
  }
}

at::Tensor saved_read_slot(torch::autograd::AutogradContext* ctx, size_t i) {
  auto it = ctx->saved_data.find("slot" + std::to_string(i));
  return it == ctx->saved_data.end() ? at::Tensor() : it->second.toTensor();
}

void set_enabled(bool on) { g_enabled = on; }
void set_swiglu_recompute(bool on) { g_swiglu_recompute = on; }
void set_swiglu_one_gemm(bool on) { g_swiglu_one_gemm = on; }
bool swiglu_one_gemm() { return g_swiglu_one_gemm; }
void set_attn_res_read_v2(bool on) { g_read_v2 = on; }
void set_attn_res_read_norm_two_pass(bool on) { g_read_norm_2pass = on; }

std::set<std::string> parse_kernel_list(const std::string& csv) {
  std::set<std::string> out;
  size_t start = 0;
  while (start <= csv.size()) {
    const auto end = std::min(csv.find(',', start), csv.size());
    if (end > start) {
      auto name = csv.substr(start, end - start);
      if (std::find(std::begin(kSwitchableKernels), std::end(kSwitchableKernels), name) ==
          std::end(kSwitchableKernels)) {
        std::string known;
        for (const char* k : kSwitchableKernels) known += (known.empty() ? "" : ", ") + std::string(k);
        throw Error(str("VIADUCT_DISABLE_KERNELS: unknown kernel '", name, "' (", known, ")"));
      }
      out.insert(std::move(name));
    }
    start = end + 1;
  }
  return out;
}

bool disabled(const std::string& name) {
  static const std::set<std::string> off = [] {
    const char* e = std::getenv("VIADUCT_DISABLE_KERNELS");
    return parse_kernel_list(e ? e : "");
  }();
  return off.count(name) > 0;
}
bool enabled() { return g_enabled; }

#ifdef VIADUCT_WITH_CUDA

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

cuda::DType dtype_of(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat ? cuda::DType::kFloat32 : cuda::DType::kBFloat16;
}

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

void check_launch(cudaError_t err, const char* what) {
  VIADUCT_CHECK(err == cudaSuccess, "CUDA kernel ", what, " failed: ", cudaGetErrorString(err));
}

// res2 defined: normalises h = x2 + res2, written to h (same shape).
at::Tensor norm_forward(const at::Tensor& x2, const at::Tensor& w, double eps, at::Tensor& rstd,
                        const at::Tensor& res2 = at::Tensor(), at::Tensor* h = nullptr) {
  auto y = at::empty_like(x2);
  rstd = at::empty({x2.size(0)}, x2.options().dtype(at::kFloat));
  if (res2.defined()) *h = at::empty_like(x2);
  check_launch(cuda::rms_norm_forward(dtype_of(x2), x2.data_ptr(),
                                      res2.defined() ? res2.data_ptr() : nullptr,
                                      w.data_ptr<float>(), res2.defined() ? h->data_ptr() : nullptr,
                                      y.data_ptr(), rstd.data_ptr<float>(), x2.size(0),
                                      x2.size(1), static_cast<float>(eps), stream_of(x2)),
               "rms_norm_forward");
  return y;
}

// The norm's backward; dres2 defined: added to dx (Note [Residual add
// inside the norm]). Returns dx and dw.
std::pair<at::Tensor, at::Tensor> norm_backward(const at::Tensor& dy2, const at::Tensor& x2,
                                                const at::Tensor& w, const at::Tensor& rstd,
                                                const at::Tensor& dres2) {
  const auto rows = x2.size(0), D = x2.size(1);
  auto dx = at::empty_like(x2);
  auto partial = at::empty({cuda::rms_norm_backward_parts(rows), D},
                           x2.options().dtype(at::kFloat));
  check_launch(cuda::rms_norm_backward(dtype_of(x2), dy2.data_ptr(), x2.data_ptr(),
                                       w.data_ptr<float>(), rstd.data_ptr<float>(),
                                       dres2.defined() ? dres2.data_ptr() : nullptr,
                                       dx.data_ptr(), partial.data_ptr<float>(), rows, D,
                                       !disabled("rms_norm_bwd_reg"), stream_of(x2)),
               "rms_norm_backward");
  return {dx, partial.sum(0)};
}

class RMSNormFn : public torch::autograd::Function<RMSNormFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps) {
    const auto D = x.size(-1);
    auto x2 = x.contiguous().view({-1, D});
    auto wc = w.contiguous();  // the backward reads the same pointer
    at::Tensor rstd;
    auto y = norm_forward(x2, wc, eps, rstd);
    ctx->save_for_backward({x2, wc, rstd});
    return y.view(x.sizes());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x2 = saved[0], &w = saved[1], &rstd = saved[2];
    const auto rows = x2.size(0), D = x2.size(1);
    auto dy = grads[0].contiguous().view({rows, D}).to(x2.scalar_type());
    auto [dx, dw] = norm_backward(dy, x2, w, rstd, at::Tensor());
    return {dx.view(grads[0].sizes()), dw, at::Tensor()};
  }
};

// Note [Residual add inside the norm]: a block's h = x + attn(...) is
// normalised for the FFN and also carried on the residual. As two ops, the
// forward wrote h and read it back for the norm, and the backward wrote
// the norm's dx, then autograd added the residual's gradient in another
// kernel (two reads and a write). Here one kernel adds and normalises
// (h written once), and the norm's backward adds the residual's gradient
// as it writes dx. Each sum is rounded to the activation type at the point
// where the two ops rounded it, so the bits are those of the two ops.
class AddRMSNormFn : public torch::autograd::Function<AddRMSNormFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& res,
                               const at::Tensor& w, double eps) {
    const auto D = x.size(-1);
    auto x2 = x.contiguous().view({-1, D});
    auto r2 = res.contiguous().view({-1, D});
    auto wc = w.contiguous();
    at::Tensor rstd, h2;
    auto y = norm_forward(x2, wc, eps, rstd, r2, &h2);
    ctx->save_for_backward({h2, wc, rstd});
    return {h2.view(x.sizes()), y.view(x.sizes())};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &h2 = saved[0], &w = saved[1], &rstd = saved[2];
    const auto rows = h2.size(0), D = h2.size(1);
    const auto sizes = grads[1].defined() ? grads[1].sizes() : grads[0].sizes();
    auto as_rows = [&](const at::Tensor& g) {
      return g.defined() ? g.contiguous().view({rows, D}).to(h2.scalar_type()) : g;
    };
    auto dres = as_rows(grads[0]);
    auto dy = grads[1].defined() ? as_rows(grads[1]) : at::zeros_like(h2);
    auto [dx, dw] = norm_backward(dy, h2, w, rstd, dres);
    auto out = dx.view(sizes);
    return {out, out, dw, at::Tensor()};
  }
};

// repeat > 0: each head of x written `repeat` times (the forward of a
// grouped-KV rotation); repeat < 0: each run of -repeat heads summed (its
// backward); 1: a plain rotation.
at::Tensor rope_launch(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       bool inverse, int64_t repeat) {
  // Strided input (SDPA's transposed gradients, q/k sliced from one qkv
  // projection) is read in place; only a non-unit last stride is copied.
  auto xc = x.stride(3) == 1 ? x : x.contiguous();
  const int64_t rep = repeat > 0 ? repeat : -repeat;
  const int64_t H_out = repeat > 0 ? xc.size(2) * rep : xc.size(2) / rep;
  auto y = at::empty({xc.size(0), xc.size(1), H_out, xc.size(3)},
                     xc.options().memory_format(at::MemoryFormat::Contiguous));
  // Undefined tables: no rotation (repeat_heads).
  check_launch(cuda::rope(dtype_of(xc), xc.data_ptr(),
                          cos.defined() ? cos.data_ptr<float>() : nullptr,
                          sin.defined() ? sin.data_ptr<float>() : nullptr, y.data_ptr(), xc.size(0), xc.size(1), H_out,
                          xc.size(3), xc.stride(0), xc.stride(1), xc.stride(2), inverse,
                          /*div=*/repeat > 0 ? rep : 1, /*mul=*/repeat > 0 ? 1 : rep,
                          /*cnt=*/repeat > 0 ? 1 : rep, stream_of(xc)),
               "rope");
  return y;
}

class RopeFn : public torch::autograd::Function<RopeFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin, int64_t repeat) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["repeat"] = repeat;
    return rope_launch(x, cos, sin, /*inverse=*/false, repeat);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto repeat = ctx->saved_data["repeat"].toInt();
    return {rope_launch(grads[0], saved[0], saved[1], /*inverse=*/true,
                        repeat == 1 ? 1 : -repeat),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Note [Repeated heads without a gather]: v's grouped heads repeated for
// SDPA went through repeat_interleave, a strided gather from the qkv GEMM's
// output at ~0.6 TB/s (1.7 ms of the llama-1B forward, bench/NOTES.md), and
// its backward through a reduction kernel. The RoPE kernel already writes
// and sums repeated heads through strides; without tables it does so with
// no rotation, vectorised.
class RepeatHeadsFn : public torch::autograd::Function<RepeatHeadsFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t repeat) {
    ctx->saved_data["repeat"] = repeat;
    return rope_launch(x, at::Tensor(), at::Tensor(), /*inverse=*/false, repeat);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto repeat = ctx->saved_data["repeat"].toInt();
    return {rope_launch(grads[0], at::Tensor(), at::Tensor(), /*inverse=*/false, -repeat),
            at::Tensor()};
  }
};

at::Tensor swiglu_launch(const at::Tensor& a, const at::Tensor& b) {
  auto y = at::empty_like(a);
  check_launch(cuda::swiglu_forward(dtype_of(a), a.data_ptr(), b.data_ptr(), y.data_ptr(),
                                    a.numel(), stream_of(a)),
               "swiglu_forward");
  return y;
}

std::pair<at::Tensor, at::Tensor> swiglu_grads(const at::Tensor& dy, const at::Tensor& a,
                                               const at::Tensor& b) {
  auto g = dy.contiguous().to(a.scalar_type());
  auto da = at::empty_like(a), db = at::empty_like(b);
  check_launch(cuda::swiglu_backward(dtype_of(a), g.data_ptr(), a.data_ptr(), b.data_ptr(),
                                     da.data_ptr(), db.data_ptr(), a.numel(), stream_of(a)),
               "swiglu_backward");
  return {da, db};
}

class SwiGLUFn : public torch::autograd::Function<SwiGLUFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    auto ac = a.contiguous(), bc = b.contiguous();
    ctx->save_for_backward({ac, bc});
    return swiglu_launch(ac, bc);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [da, db] = swiglu_grads(grads[0], saved[0], saved[1]);
    return {da, db};
  }
};

// silu(ab[..., :F]) * ab[..., F:] for the [..., 2F] output of one w1/w3
// GEMM (Note [One w1/w3 projection]), and its gradient as one [..., 2F]
// tensor: the halves read and written in place, no split copies.
at::Tensor swiglu_launch_packed(const at::Tensor& ab) {
  const auto F = ab.size(-1) / 2;
  auto sizes = ab.sizes().vec();
  sizes.back() = F;
  auto y = at::empty(sizes, ab.options());
  const auto elem = static_cast<int64_t>(ab.element_size());
  const auto* a = static_cast<const char*>(ab.data_ptr());
  check_launch(cuda::swiglu_forward(dtype_of(ab), a, a + F * elem, y.data_ptr(), y.numel(),
                                    stream_of(ab), F, 2 * F),
               "swiglu_forward");
  return y;
}
at::Tensor swiglu_grads_packed(const at::Tensor& dy, const at::Tensor& ab) {
  const auto F = ab.size(-1) / 2;
  auto g = dy.contiguous().to(ab.scalar_type());
  auto dab = at::empty_like(ab);
  const auto elem = static_cast<int64_t>(ab.element_size());
  const auto* a = static_cast<const char*>(ab.data_ptr());
  auto* da = static_cast<char*>(dab.data_ptr());
  check_launch(cuda::swiglu_backward(dtype_of(ab), g.data_ptr(), a, a + F * elem, da,
                                     da + F * elem, g.numel(), stream_of(ab), F, 2 * F),
               "swiglu_backward");
  return dab;
}

// packed: a is the [..., 2F] output of one w1/w3 GEMM and b a 0-size
// stand-in (custom functions take no undefined inputs on LibTorch 2.x).
class SwiGLULinearFn : public torch::autograd::Function<SwiGLULinearFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b,
                            const at::Tensor& w, bool packed) {
    auto ac = a.contiguous(), bc = packed ? b : b.contiguous();
    // Kept: the backward needs the same cast (from the weight cache, Note
    // [Low-precision weight cache]).
    auto wc = w.scalar_type() == a.scalar_type() ? w : weight_cache::get({w}, a.scalar_type());
    auto h = packed ? swiglu_launch_packed(ac) : swiglu_launch(ac, bc);
    const bool recompute = g_swiglu_recompute;
    ctx->save_for_backward({ac, bc, w, wc, recompute ? at::Tensor() : h});
    ctx->saved_data["packed"] = packed;
    return at::linear(h, wc);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &a = saved[0], &b = saved[1], &w = saved[2], &wc = saved[3];
    const bool packed = ctx->saved_data["packed"].toBool();
    const auto F = w.size(1);
    const auto D = w.size(0);
    // Note [SwiGLU recompute]: without model.swiglu_recompute the product
    // was kept by the forward; with it, recomputed here (one [tokens x F]
    // activation less per layer, one more elementwise pass).
    auto h = (saved[4].defined() ? saved[4]
              : packed         ? swiglu_launch_packed(a)
                               : swiglu_launch(a, b))
                 .view({-1, F});
    auto dy = grads[0].contiguous().view({-1, D}).to(a.scalar_type());
    // fp32 straight from the GEMM (Note [Linear with an fp32 weight gradient]).
    auto dw = at::empty(w.sizes(), w.options());
    compat::matmul_into_fp32_(dw, dy.t(), h, /*accumulate=*/false);
    auto dh = at::mm(dy, wc);
    h.reset();
    if (packed) return {swiglu_grads_packed(dh, a), at::Tensor(), dw, at::Tensor()};
    auto [da, db] = swiglu_grads(dh.view(a.sizes()), a, b);
    return {da, db, dw, at::Tensor()};
  }
};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Note [Fused AttnRes read] in fused_kernels.cu; the equations of Note
// [AttnRes read without keys] (model/attn_res.cpp), whose ATen form runs
// everywhere else. With out_weight not empty, the read and the RMSNorm
// after it (Note [AttnRes read with its norm]): the output is norm(h).
class AttnResReadKernelFn : public torch::autograd::Function<AttnResReadKernelFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, at::TensorList sources,
                            const at::Tensor& query, const at::Tensor& norm_weight, double eps,
                            const std::vector<at::Tensor>* slots, const at::Tensor& out_weight,
                            double out_eps) {
    const auto n = static_cast<int>(sources.size());
    save_read_slots(ctx, slots);
    const auto D = sources[0].size(-1);
    const auto rows = sources[0].numel() / D;
    std::vector<at::Tensor> src;
    cuda::ReadSources ptrs{};
    for (int i = 0; i < n; ++i) {
      src.push_back(sources[static_cast<size_t>(i)].contiguous());
      ptrs.p[i] = src.back().data_ptr();
    }
    auto u = (norm_weight.to(at::kFloat) * query.to(at::kFloat)).contiguous();
    auto out = at::empty(src[0].sizes(), src[0].options());
    const bool with_norm = out_weight.numel() > 0;  // else the 0-size stand-in
    auto stats = at::empty({3 * n + (with_norm ? 1 : 0), rows},
                           src[0].options().dtype(at::kFloat));
    auto rstd = stats.narrow(0, 0, n), dot = stats.narrow(0, n, n),
         alpha = stats.narrow(0, 2 * n, n);
    // Note [Fused AttnRes read, warp per row]; the backward takes the same
    // pair of kernels. The norm runs only in that form.
    const bool warp_per_row = with_norm || (g_read_v2 && !disabled("attn_res_read_v2"));
    ctx->saved_data["warp_per_row"] = warp_per_row;
    cuda::ReadNorm nrm;
    at::Tensor out_rstd;
    if (with_norm) {
      out_rstd = stats[3 * n];
      nrm.w = out_weight.data_ptr<float>();
      nrm.eps = static_cast<float>(out_eps);
      nrm.rstd = out_rstd.data_ptr<float>();
    }
    check_launch(cuda::attn_res_read_forward(dtype_of(src[0]), ptrs, n, u.data_ptr<float>(),
                                             out.data_ptr(), rstd.data_ptr<float>(),
                                             dot.data_ptr<float>(), alpha.data_ptr<float>(), rows,
                                             D, static_cast<float>(eps), warp_per_row,
                                             stream_of(src[0]), with_norm ? &nrm : nullptr),
                 with_norm ? "attn_res_read_norm_forward" : "attn_res_read_forward");
    src.insert(src.end(), {query, norm_weight, rstd, dot, alpha, u});
    if (with_norm) src.insert(src.end(), {out_weight, out_rstd});
    ctx->save_for_backward(src);
    ctx->saved_data["n"] = static_cast<int64_t>(n);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto n = static_cast<int>(ctx->saved_data["n"].toInt());
    const auto &query = saved[n], &norm_weight = saved[n + 1];
    const auto &rstd = saved[n + 2], &dot = saved[n + 3], &alpha = saved[n + 4],
               &u = saved[n + 5];
    const bool with_norm = saved.size() > static_cast<size_t>(n) + 6;
    const auto D = saved[0].size(-1);
    const auto rows = saved[0].numel() / D;
    auto g = grads[0].contiguous().to(saved[0].scalar_type());
    if (with_norm && !aligned16(g.data_ptr())) g = g.clone();
    const bool warp_per_row = ctx->saved_data["warp_per_row"].toBool();
    cuda::ReadSources ptrs{}, accs{};  // accs: the slot to add into, per source
    cuda::ReadGrads dptrs{};
    variable_list out;
    std::vector<std::pair<at::Tensor, at::Tensor>> to_add;  // (slot, gradient) after the kernel
    for (int i = 0; i < n; ++i) {
      const auto& v = saved[static_cast<size_t>(i)];
      ptrs.p[i] = v.data_ptr();
      const at::Tensor slot = saved_read_slot(ctx, static_cast<size_t>(i));
      if (slot.defined() && slot.numel() > 0 && warp_per_row && slot.is_contiguous() &&
          slot.sizes() == v.sizes() && slot.scalar_type() == v.scalar_type() &&
          (!with_norm || aligned16(slot.data_ptr()))) {
        accs.p[i] = slot.data_ptr();  // added into in place
        dptrs.p[i] = slot.data_ptr();
        out.emplace_back();
        continue;
      }
      auto dv = at::empty(v.sizes(), v.options());
      dptrs.p[i] = dv.data_ptr();
      if (slot.defined()) {  // the first gradient becomes the slot; others added after
        to_add.emplace_back(slot, dv);
        out.emplace_back();
      } else {
        out.push_back(dv);
      }
    }
    // No rows: the kernels launch nothing, so the parts must start at zero.
    const auto parts = cuda::attn_res_read_backward_parts(rows, warp_per_row);
    auto partial = at::empty({with_norm ? 2 * parts : parts, D}, u.options());
    if (rows == 0) partial.zero_();
    cuda::ReadNorm nrm;
    if (with_norm) {
      nrm.w = saved[static_cast<size_t>(n) + 6].data_ptr<float>();
      nrm.rstd = saved[static_cast<size_t>(n) + 7].data_ptr<float>();
      nrm.dy = g.data_ptr();
      nrm.dw_partial = partial[parts].data_ptr<float>();
      // Note [Read with its norm in two passes] (fused_kernels.cu).
      nrm.two_pass = g_read_norm_2pass && !disabled("attn_res_read_norm_2pass");
    }
    check_launch(cuda::attn_res_read_backward(dtype_of(saved[0]), ptrs, accs, dptrs, n,
                                              g.data_ptr(), u.data_ptr<float>(),
                                              rstd.data_ptr<float>(), dot.data_ptr<float>(),
                                              alpha.data_ptr<float>(), partial.data_ptr<float>(),
                                              rows, D, warp_per_row, stream_of(g),
                                              with_norm ? &nrm : nullptr),
                 with_norm ? "attn_res_read_norm_backward" : "attn_res_read_backward");
    for (auto& [slot, dv] : to_add) attn_res_slot_add(slot, dv);
    // Note [Summing the read's partial rows]: one launch sums the parts and
    // forms d query = du * w and d norm.weight = du * q, when both are the
    // fp32 parameters they are in the model; ATen otherwise.
    const int sets = with_norm ? 2 : 1;
    auto sums = at::empty({sets, D}, u.options());
    const bool fp32_params = query.scalar_type() == at::kFloat &&
                             norm_weight.scalar_type() == at::kFloat &&
                             query.is_contiguous() && norm_weight.is_contiguous();
    at::Tensor dq, dw;
    cuda::PartsProducts prod;
    if (fp32_params) {
      dq = at::empty_like(query);
      dw = at::empty_like(norm_weight);
      prod = {norm_weight.data_ptr<float>(), query.data_ptr<float>(), dq.data_ptr<float>(),
              dw.data_ptr<float>()};
    }
    check_launch(cuda::sum_parts(partial.data_ptr<float>(), parts, D, sets,
                                 sums.data_ptr<float>(), stream_of(g),
                                 fp32_params ? &prod : nullptr),
                 "sum_parts");
    if (!fp32_params) {
      dq = (sums[0] * norm_weight.to(at::kFloat)).to(query.scalar_type());
      dw = (sums[0] * query.to(at::kFloat)).to(norm_weight.scalar_type());
    }
    out.push_back(dq);                                     // d query
    out.push_back(dw);                                     // d norm.weight
    out.emplace_back();                                    // eps
    out.emplace_back();                                    // slots
    out.push_back(with_norm ? sums[1] : at::Tensor());     // d out_weight
    out.emplace_back();                                    // out_eps
    return out;
  }
};

}  // namespace

bool usable(const at::Tensor& x) {
  if (!g_enabled || !x.defined() || !x.is_cuda()) return false;
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16) return false;
  return cuda::device_supported(x.device().index());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("viaduct::rms_norm", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                    weight.size(0) == x.size(-1),
                "fused rms_norm: weight must be fp32 [", x.size(-1), "], got ",
                weight.scalar_type(), " ", weight.sizes());
  return RMSNormFn::apply(x, weight, eps);
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                int64_t repeat) {
  RECORD_FUNCTION("viaduct::rope", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(x.dim() == 4 && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                    cos.is_contiguous() && sin.is_contiguous() && cos.size(0) >= x.size(1) &&
                    2 * cos.size(1) == x.size(3),
                "fused rope: x must be [B, T, H, hd] and cos/sin contiguous fp32 [>= T, hd/2]");
  VIADUCT_CHECK(repeat >= 1, "fused rope: repeat must be >= 1, got ", repeat);
  return RopeFn::apply(x, cos, sin, repeat);
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& res,
                                               const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("viaduct::add_rms_norm", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(x.sizes() == res.sizes() && x.scalar_type() == res.scalar_type() &&
                    weight.dim() == 1 && weight.size(0) == x.size(-1) &&
                    weight.scalar_type() == at::kFloat,
                "fused add_rms_norm: x and res must have one shape and type, weight fp32 [D]");
  auto out = AddRMSNormFn::apply(x, res, weight, eps);
  return {out[0], out[1]};
}

at::Tensor repeat_heads(const at::Tensor& x, int64_t repeat) {
  RECORD_FUNCTION("viaduct::repeat_heads", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(x.dim() == 4 && repeat >= 1,
                "fused repeat_heads: x must be [B, T, H, hd] and repeat >= 1");
  if (repeat == 1) return x;
  return RepeatHeadsFn::apply(x, repeat);
}

at::Tensor swiglu(const at::Tensor& a, const at::Tensor& b) {
  RECORD_FUNCTION("viaduct::swiglu", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(),
                "fused swiglu: a and b differ in shape or dtype");
  return SwiGLUFn::apply(a, b);
}

at::Tensor swiglu_linear(const at::Tensor& a, const at::Tensor& b, const at::Tensor& w) {
  RECORD_FUNCTION("viaduct::swiglu_linear", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && w.dim() == 2 &&
                    w.size(1) == a.size(-1),
                "fused swiglu_linear: a, b must match and w be [D, ", a.size(-1), "]");
  return SwiGLULinearFn::apply(a, b, w, false);
}

at::Tensor swiglu_linear_packed(const at::Tensor& ab, const at::Tensor& w) {
  RECORD_FUNCTION("viaduct::swiglu_linear", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(ab.dim() >= 1 && ab.size(-1) % 2 == 0 && w.dim() == 2 &&
                    2 * w.size(1) == ab.size(-1),
                "fused swiglu_linear_packed: ab must be [..., 2F] and w [D, F], got ",
                ab.sizes(), " and ", w.sizes());
  return SwiGLULinearFn::apply(ab, at::empty({0}, ab.options()), w, true);
}

namespace {
// 1 to kMaxReadSources sources of one shape, dtype and device.
bool read_sources_fit(const std::vector<at::Tensor>& sources) {
  if (sources.empty() || static_cast<int64_t>(sources.size()) > cuda::kMaxReadSources) {
    return false;
  }
  for (const auto& v : sources) {
    if (v.sizes() != sources[0].sizes() || v.scalar_type() != sources[0].scalar_type() ||
        v.device() != sources[0].device()) {
      return false;
    }
  }
  return true;
}
}  // namespace

bool attn_res_read_usable(const std::vector<at::Tensor>& sources) {
  return !sources.empty() && usable(sources[0]) && !disabled("attn_res_read") &&
         read_sources_fit(sources);
}

at::Tensor attn_res_read(const std::vector<at::Tensor>& sources, const at::Tensor& query,
                         const at::Tensor& norm_weight, double eps,
                         const std::vector<at::Tensor>* slots) {
  RECORD_FUNCTION("viaduct::attn_res_read_kernel", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(read_sources_fit(sources), "fused attn_res_read: 1 to ", cuda::kMaxReadSources,
                " sources of one shape, dtype and device, got ", sources.size());
  VIADUCT_CHECK(query.dim() == 1 && query.size(0) == sources[0].size(-1) &&
                    norm_weight.sizes() == query.sizes(),
                "fused attn_res_read: query and norm weight must be [", sources[0].size(-1), "]");
  VIADUCT_CHECK(slots == nullptr || slots->size() == sources.size(),
                "fused attn_res_read: one slot entry per source");
  // No norm: a 0-size stand-in (an undefined tensor cannot be an input of
  // a custom autograd function in LibTorch 2.x).
  return AttnResReadKernelFn::apply(at::TensorList(sources), query, norm_weight, eps, slots,
                                    at::empty({0}, query.options()), 0.0);
}

bool attn_res_read_norm_usable(const std::vector<at::Tensor>& sources,
                               const at::Tensor& out_weight) {
  if (!attn_res_read_usable(sources) || disabled("attn_res_read_norm") ||
      disabled("attn_res_read_v2") || !g_read_v2) {
    return false;
  }
  const auto D = sources[0].size(-1);
  if (!out_weight.defined() || out_weight.scalar_type() != at::kFloat || out_weight.dim() != 1 ||
      out_weight.size(0) != D || !out_weight.is_contiguous() ||
      out_weight.device() != sources[0].device() || !aligned16(out_weight.data_ptr())) {
    return false;
  }
  cuda::ReadSources ptrs{};
  for (size_t i = 0; i < sources.size(); ++i) {
    if (!sources[i].is_contiguous()) return false;
    ptrs.p[i] = sources[i].data_ptr();
  }
  return cuda::attn_res_read_norm_fits(dtype_of(sources[0]), ptrs,
                                       static_cast<int>(sources.size()), D);
}

at::Tensor attn_res_read_norm(const std::vector<at::Tensor>& sources, const at::Tensor& query,
                              const at::Tensor& norm_weight, double eps,
                              const std::vector<at::Tensor>* slots, const at::Tensor& out_weight,
                              double out_eps) {
  RECORD_FUNCTION("viaduct::attn_res_read_norm_kernel", std::vector<c10::IValue>());
  VIADUCT_CHECK(attn_res_read_norm_usable(sources, out_weight),
                "fused attn_res_read_norm: these sources and norm weight do not fit the kernel "
                "(attn_res_read_norm_usable)");
  VIADUCT_CHECK(query.dim() == 1 && query.size(0) == sources[0].size(-1) &&
                    norm_weight.sizes() == query.sizes(),
                "fused attn_res_read_norm: query and norm weight must be [", sources[0].size(-1),
                "]");
  VIADUCT_CHECK(slots == nullptr || slots->size() == sources.size(),
                "fused attn_res_read_norm: one slot entry per source");
  return AttnResReadKernelFn::apply(at::TensorList(sources), query, norm_weight, eps, slots,
                                    out_weight, out_eps);
}

namespace {
const float* scale_ptr(const at::Tensor& scale_dev, const at::Tensor& like) {
  if (!scale_dev.defined()) return nullptr;
  VIADUCT_CHECK(scale_dev.device() == like.device() && scale_dev.scalar_type() == at::kFloat &&
                    scale_dev.numel() == 1,
                "fused adamw: the device scale must be one fp32 value on the parameters' device");
  return scale_dev.data_ptr<float>();
}
}  // namespace

void adamw_(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, double lr,
            double beta1, double beta2, double eps, double weight_decay, double bias_corr1,
            double bias_corr2, const at::Tensor& low, double grad_scale,
            const at::Tensor& scale_dev) {
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&p), &g, static_cast<const at::Tensor*>(&m),
                               static_cast<const at::Tensor*>(&v)}) {
    VIADUCT_CHECK(t->is_cuda() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                      t->numel() == p.numel(),
                  "fused adamw: parameter, gradient and moments must be contiguous fp32 CUDA "
                  "tensors of one size");
  }
  VIADUCT_CHECK(!low.defined() || (low.device() == p.device() &&
                                   low.scalar_type() == at::kBFloat16 && low.is_contiguous() &&
                                   low.numel() == p.numel()),
                "fused adamw: the low-precision copy must be a contiguous bf16 tensor of the "
                "parameter's size on its device");
  check_launch(cuda::adamw(p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(),
                           v.data_ptr<float>(), low.defined() ? low.data_ptr() : nullptr,
                           p.numel(), static_cast<float>(lr),
                           static_cast<float>(beta1), static_cast<float>(beta2),
                           static_cast<float>(eps), static_cast<float>(weight_decay),
                           static_cast<float>(bias_corr1), static_cast<float>(bias_corr2),
                           static_cast<float>(grad_scale), stream_of(p),
                           scale_ptr(scale_dev, p)),
               "adamw");
}

namespace {
cuda::AdamWItem adamw_item(const AdamWTensors& t) {
  cuda::AdamWItem it;
  it.p = t.p.data_ptr<float>();
  it.g = t.g.data_ptr<float>();
  it.m = t.m.data_ptr<float>();
  it.v = t.v.data_ptr<float>();
  it.low_bf16 = t.low.defined() ? t.low.data_ptr() : nullptr;
  it.n = t.p.numel();
  it.weight_decay = static_cast<float>(t.weight_decay);
  return it;
}
}  // namespace

bool adamw_many_takes(const AdamWTensors& t) {
  if (!t.p.defined() || !t.p.is_cuda() || t.p.scalar_type() != at::kFloat) return false;
  for (const at::Tensor* x : {&t.p, &t.g, &t.m, &t.v}) {
    if (!x->defined() || x->device() != t.p.device() || x->scalar_type() != at::kFloat ||
        !x->is_contiguous() || x->numel() != t.p.numel())
      return false;
  }
  if (t.low.defined() && (t.low.device() != t.p.device() || t.low.scalar_type() != at::kBFloat16 ||
                          !t.low.is_contiguous() || t.low.numel() != t.p.numel()))
    return false;
  return cuda::adamw_batchable(adamw_item(t));
}

void adamw_many_(const std::vector<AdamWTensors>& ts, double lr, double beta1, double beta2,
                 double eps, double bias_corr1, double bias_corr2, double grad_scale,
                 const at::Tensor& scale_dev) {
  if (ts.empty()) return;
  std::vector<cuda::AdamWItem> items;
  for (const auto& t : ts) {
    VIADUCT_CHECK(adamw_many_takes(t) && t.p.device() == ts.front().p.device(),
                  "fused adamw_many: every tensor must be small, contiguous, aligned fp32 on one "
                  "CUDA device (adamw_many_takes)");
    items.push_back(adamw_item(t));
  }
  check_launch(cuda::adamw_batch(items.data(), static_cast<int>(items.size()),
                                 static_cast<float>(lr), static_cast<float>(beta1),
                                 static_cast<float>(beta2), static_cast<float>(eps),
                                 static_cast<float>(bias_corr1), static_cast<float>(bias_corr2),
                                 static_cast<float>(grad_scale), stream_of(ts.front().p),
                                 scale_ptr(scale_dev, ts.front().p)),
               "adamw_batch");
}

bool clip_on_device_takes(const std::vector<at::Tensor>& grads) {
  if (grads.empty() || !usable(grads.front()) || disabled("clip_on_device")) return false;
  for (const auto& g : grads) {
    if (!g.defined() || g.device() != grads.front().device() || g.scalar_type() != at::kFloat)
      return false;
  }
  return true;
}

DeviceClip clip_on_device(const std::vector<at::Tensor>& grads, double max_norm,
                          const std::vector<at::Tensor>& also) {
  VIADUCT_CHECK(clip_on_device_takes(grads),
                "clip_on_device: the gradients must be fp32 on one CUDA device");
  const auto opts = grads.front().options();
  for (const auto& t : also) {
    VIADUCT_CHECK(t.defined() && t.numel() == 1 && t.device() == opts.device(),
                  "clip_on_device: each value to fetch must be one element on the gradients' "
                  "device");
  }
  // The norms as grad_squared_norms (train/optimizer.cpp) forms them.
  auto norms = at::stack(at::_foreach_norm(grads, 2)).contiguous();
  const auto n = static_cast<int64_t>(also.size());
  auto vals = at::empty({1 + n}, opts.dtype(at::kDouble));  // [norm, also...]
  auto scale = at::empty({1}, opts.dtype(at::kFloat));
  const auto stream = c10::cuda::getCurrentCUDAStream(opts.device().index());
  check_launch(cuda::clip_scale(norms.data_ptr<float>(), norms.numel(), max_norm,
                                vals.data_ptr<double>(), scale.data_ptr<float>(), stream.stream()),
               "clip_scale");
  if (n > 0) {
    std::vector<at::Tensor> flat;
    for (const auto& t : also) flat.push_back(t.reshape({1}));
    vals.narrow(0, 1, n).copy_(at::cat(flat));
  }
  auto host = at::empty({1 + n}, at::TensorOptions().dtype(at::kDouble).pinned_memory(true));
  host.copy_(vals, /*non_blocking=*/true);
  auto ready = std::make_shared<at::cuda::CUDAEvent>();
  ready->record(stream);
  return {scale, [host, ready, vals] {
            ready->synchronize();
            const double* v = host.data_ptr<double>();
            return std::vector<double>(v, v + host.numel());
          }};
}

at::Tensor cross_entropy_rows_(at::Tensor& logits, const at::Tensor& targets) {
  RECORD_FUNCTION("viaduct::cross_entropy_rows", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(logits.dim() == 2 && logits.is_contiguous() && targets.dim() == 1 &&
                    targets.size(0) == logits.size(0),
                "fused cross_entropy: logits must be contiguous [n, V] and targets [n]");
  auto t = targets.to(logits.device(), at::kLong).contiguous();
  auto row_loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  check_launch(cuda::cross_entropy_forward_backward(
                   dtype_of(logits), logits.data_ptr(), t.data_ptr<int64_t>(),
                   row_loss.data_ptr<float>(), logits.size(0), logits.size(1), -100,
                   stream_of(logits)),
               "cross_entropy_forward_backward");
  return row_loss;
}

#else  // CPU build: usable() is false, so nothing below is ever reached.

bool usable(const at::Tensor&) { return false; }

namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw Error(str("fused ", what, " needs viaduct's CUDA build"));
}
}  // namespace

at::Tensor rms_norm(const at::Tensor&, const at::Tensor&, double) { no_cuda("rms_norm"); }
at::Tensor rope(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  no_cuda("rope");
}
at::Tensor repeat_heads(const at::Tensor&, int64_t) { no_cuda("repeat_heads"); }
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, double) {
  no_cuda("add_rms_norm");
}
at::Tensor swiglu(const at::Tensor&, const at::Tensor&) { no_cuda("swiglu"); }
at::Tensor swiglu_linear(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  no_cuda("swiglu_linear");
}
at::Tensor swiglu_linear_packed(const at::Tensor&, const at::Tensor&) {
  no_cuda("swiglu_linear_packed");
}
at::Tensor cross_entropy_rows_(at::Tensor&, const at::Tensor&) { no_cuda("cross_entropy"); }
bool attn_res_read_usable(const std::vector<at::Tensor>&) { return false; }
bool attn_res_read_norm_usable(const std::vector<at::Tensor>&, const at::Tensor&) {
  return false;
}
at::Tensor attn_res_read_norm(const std::vector<at::Tensor>&, const at::Tensor&,
                              const at::Tensor&, double, const std::vector<at::Tensor>*,
                              const at::Tensor&, double) {
  no_cuda("attn_res_read_norm");
}
at::Tensor attn_res_read(const std::vector<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                         double, const std::vector<at::Tensor>*) {
  no_cuda("attn_res_read");
}
void adamw_(at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, double, double, double,
            double, double, double, double, const at::Tensor&, double, const at::Tensor&) {
  no_cuda("adamw");
}
bool adamw_many_takes(const AdamWTensors&) { return false; }
void adamw_many_(const std::vector<AdamWTensors>& ts, double, double, double, double, double,
                 double, double, const at::Tensor&) {
  if (!ts.empty()) no_cuda("adamw_many");
}
bool clip_on_device_takes(const std::vector<at::Tensor>&) { return false; }
DeviceClip clip_on_device(const std::vector<at::Tensor>&, double, const std::vector<at::Tensor>&) {
  no_cuda("clip_on_device");
}

#endif

}  // namespace viaduct::kernels
