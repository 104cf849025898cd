// The Block AttnRes read (see Note [AttnRes stack], model/attn_res.h): a
// softmax over depth of the sources' normalised dot with a query, then the
// weighted sum of the sources.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "kernels/fused.h"
#include "ops/options.h"

namespace viaduct::ops {

// The slots of see Note [AttnRes block gradients in place] in an autograd
// context (kernels/read_slots.cpp; the read's ATen and kernel forms share them).
using kernels::attn_res_slot_add;
using kernels::save_read_slots;
using kernels::take_slot;
using kernels::saved_read_slot;

// sources: N tensors [B, T, D] (1 <= N) -> [B, T, D] in the sources' dtype.
// query, norm_weight: [D]. slots (one entry per source, undefined for none):
// See Note [AttnRes block gradients in place], model/attn_res.h.
at::Tensor attn_res_read(const std::vector<at::Tensor>& sources, const at::Tensor& query,
                         const at::Tensor& norm_weight, double eps,
                         const std::vector<at::Tensor>* slots, const KernelOptions& k);
// rms_norm(attn_res_read(...), out_weight, out_eps): one kernel each way
// where the kernels take these sources (see Note [AttnRes read with its norm],
// kernels/attn_res_read.cu), the two ops elsewhere.
at::Tensor attn_res_read_norm(const std::vector<at::Tensor>& sources, const at::Tensor& query,
                              const at::Tensor& norm_weight, double eps,
                              const std::vector<at::Tensor>* slots, const at::Tensor& out_weight,
                              double out_eps, const KernelOptions& k);
// The softmax weights over depth, [N, B, T] fp32 (fp64 for fp64 sources).
at::Tensor attn_res_read_weights(const std::vector<at::Tensor>& sources, const at::Tensor& query,
                                 const at::Tensor& norm_weight, double eps);

}  // namespace viaduct::ops
