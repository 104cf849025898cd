// AdamW on the device: one tensor, or every tensor of a step in one launch
// (CUDA build).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/adamw.h"

namespace viaduct::kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const float* scale_ptr(const at::Tensor& scale_dev, const at::Tensor& like) {
  if (!scale_dev.defined()) return nullptr;
  VIADUCT_CHECK(scale_dev.device() == like.device() && scale_dev.scalar_type() == at::kFloat &&
                    scale_dev.numel() == 1,
                "fused adamw: the device scale must be one fp32 value on the parameters' device");
  return scale_dev.data_ptr<float>();
}

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
  const auto device = ts.front().p.device();
  // See Note [AdamW over many tensors in one launch] (kernels/adamw.cu): the
  // items' table, planned here, reaches the device by an asynchronous copy
  // from pinned memory on the update's stream (the host allocator keeps
  // the pinned block until the copy is done).
  const auto bytes = static_cast<int64_t>(ts.size() * sizeof(cuda::AdamWItem));
  auto host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  auto* items = reinterpret_cast<cuda::AdamWItem*>(host.data_ptr<uint8_t>());
  for (size_t i = 0; i < ts.size(); ++i) {
    const auto& t = ts[i];
    VIADUCT_CHECK(adamw_many_takes(t) && t.p.device() == device,
                  "fused adamw_many: every tensor must be contiguous, aligned fp32 with a "
                  "multiple of 4 values, all on one CUDA device (adamw_many_takes)");
    items[i] = adamw_item(t);
  }
  const int count = static_cast<int>(ts.size());
  const int64_t chunks = cuda::adamw_plan(items, count, static_cast<float>(lr));
  VIADUCT_CHECK(chunks >= 0, "fused adamw_many: an item the launch cannot take");
  const auto table = host.to(device, /*non_blocking=*/true);
  check_launch(cuda::adamw_many(reinterpret_cast<const cuda::AdamWItem*>(table.data_ptr<uint8_t>()),
                                count, chunks, static_cast<float>(lr), static_cast<float>(beta1),
                                static_cast<float>(beta2), static_cast<float>(eps),
                                static_cast<float>(bias_corr1), static_cast<float>(bias_corr2),
                                static_cast<float>(grad_scale), stream_of(ts.front().p),
                                scale_ptr(scale_dev, ts.front().p)),
               "adamw_many");
}

}  // namespace viaduct::kernels
