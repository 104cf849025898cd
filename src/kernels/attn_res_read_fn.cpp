// The Block AttnRes read (with or without its norm) as an autograd
// function (CUDA build).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/attn_res_read.h"

namespace viaduct::kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// See Note [Fused AttnRes read, warp per row] in kernels/attn_res_read.cu; the
// equations of see Note [AttnRes read without keys] (ops/attn_res_read.cpp), whose ATen form runs
// everywhere else. With out_weight not empty, the read and the RMSNorm
// after it (see Note [AttnRes read with its norm]): the output is norm(h).
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
                                             D, static_cast<float>(eps),
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
    cuda::ReadSources ptrs{}, accs{};  // accs: the slot to add into, per source
    cuda::ReadGrads dptrs{};
    variable_list out;
    std::vector<std::pair<at::Tensor, at::Tensor>> to_add;  // (slot, gradient) after the kernel
    std::vector<std::pair<at::Tensor, at::Tensor>> to_set;  // (slot, its sum written by it)
    for (int i = 0; i < n; ++i) {
      const auto& v = saved[static_cast<size_t>(i)];
      ptrs.p[i] = v.data_ptr();
      const at::Tensor slot = saved_read_slot(ctx, static_cast<size_t>(i));
      auto dv = at::empty(v.sizes(), v.options());
      dptrs.p[i] = dv.data_ptr();
      if (slot.defined() && slot.numel() > 0 && slot.is_contiguous() &&
          slot.sizes() == v.sizes() && slot.scalar_type() == v.scalar_type() &&
          (!with_norm || aligned16(slot.data_ptr()))) {
        // The kernel adds the slot's sum as it writes dv, which becomes the
        // slot: out of place, since the slot's storage may be a gradient
        // another input also holds (see attn_res_slot_add).
        accs.p[i] = slot.data_ptr();
        to_set.emplace_back(slot, dv);
        out.emplace_back();
      } else if (slot.defined()) {  // the first gradient becomes the slot; others added after
        to_add.emplace_back(slot, dv);
        out.emplace_back();
      } else {
        out.push_back(dv);
      }
    }
    // No rows: the kernels launch nothing, so the parts must start at zero.
    const auto parts = cuda::attn_res_read_backward_parts(rows);
    auto partial = at::empty({with_norm ? 2 * parts : parts, D}, u.options());
    if (rows == 0) partial.zero_();
    cuda::ReadNorm nrm;
    if (with_norm) {
      nrm.w = saved[static_cast<size_t>(n) + 6].data_ptr<float>();
      nrm.rstd = saved[static_cast<size_t>(n) + 7].data_ptr<float>();
      nrm.dy = g.data_ptr();
      nrm.dw_partial = partial[parts].data_ptr<float>();
    }
    check_launch(cuda::attn_res_read_backward(dtype_of(saved[0]), ptrs, accs, dptrs, n,
                                              g.data_ptr(), u.data_ptr<float>(),
                                              rstd.data_ptr<float>(), dot.data_ptr<float>(),
                                              alpha.data_ptr<float>(), partial.data_ptr<float>(),
                                              rows, D, stream_of(g),
                                              with_norm ? &nrm : nullptr),
                 with_norm ? "attn_res_read_norm_backward" : "attn_res_read_backward");
    for (auto& [slot, dv] : to_set) {
      at::Tensor s = slot;  // the same TensorImpl as every holder of the slot
      s.set_(dv);
    }
    for (auto& [slot, dv] : to_add) attn_res_slot_add(slot, dv);
    // See Note [Summing the read's partial rows]: one launch sums the parts and
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
  return !sources.empty() && usable(sources[0]) &&
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
  if (!attn_res_read_usable(sources)) return false;
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

}  // namespace viaduct::kernels
