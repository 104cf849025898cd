#include "ops/short_conv.h"

#include "core/check.h"
#include "kernels/fused.h"
#include "ops/l2_norm.h"

namespace viaduct::ops {

at::Tensor short_conv_silu(const at::Tensor& x, const at::Tensor& weight, const KernelOptions& k,
                           const Documents* documents) {
  const bool on_kernels = fused_runs(x, k) && kernels::short_conv_silu_usable(x, weight);
  if (documents != nullptr) {
    VIADUCT_CHECK(x.dim() == 3 && documents->rows() == x.size(0) &&
                      documents->seq_len() == x.size(1),
                  "short convolution over documents of [", documents->rows(), ", ",
                  documents->seq_len(), "] tokens, but x is ", x.sizes());
    // The kernels bound each token's taps by its offset in its document
    // (see Note [KDA chunks over documents]); the ATen form runs packed with
    // kernel - 1 zero rows before each span (see Note [Packed documents]).
    if (on_kernels) return kernels::short_conv_silu(x, weight, documents->offsets(x.device()));
    const auto& p = documents->packed(1, weight.size(1) - 1, x.device());
    return unpack_spans(short_conv_silu(pack_spans(x, p), weight, k), p, x.size(0), x.size(1));
  }
  if (on_kernels) return kernels::short_conv_silu(x, weight);
  // The filter as K shifted products added in tap order, in fp32 (fp64 for
  // fp64 x): each output's sum has the same terms in the same order
  // wherever the token sits in the sequence, so a packed document gets its
  // bits alone (see Note [Packed documents]) -- a convolution library's
  // blocking depends on the sequence's length.
  const auto T = x.size(1), K = weight.size(1);
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto xp = at::constant_pad_nd(x.to(acc), {0, 0, K - 1, 0});  // [B, T + K - 1, C]
  auto w = weight.to(acc);                                      // [C, K]
  at::Tensor y = xp.narrow(1, 0, T) * w.select(1, 0);
  for (int64_t j = 1; j < K; ++j) y = y + xp.narrow(1, j, T) * w.select(1, j);
  return at::silu(y).to(x.scalar_type());
}

at::Tensor short_conv_silu_l2(const at::Tensor& x, const at::Tensor& weight, int64_t head_dim,
                              double eps, double scale, const KernelOptions& k,
                              const Documents* documents) {
  VIADUCT_CHECK(x.dim() == 3 && head_dim > 0 && x.size(2) % head_dim == 0,
                "short convolution with an L2 norm per head of ", head_dim,
                " channels: x must be [B, T, C] with C a multiple of it, got ", x.sizes());
  const auto B = x.size(0), T = x.size(1), H = x.size(2) / head_dim;
  // Documents of another shape than x are refused on either path (the
  // kernels' offsets check, short_conv_silu's).
  if (fused_runs(x, k) && kernels::short_conv_silu_l2_usable(x, weight, head_dim)) {
    const auto offsets = documents != nullptr ? documents->offsets(x.device()) : at::Tensor();
    return kernels::short_conv_silu_l2(x, weight, head_dim, eps, scale, offsets)
        .view({B, T, H, head_dim});
  }
  return l2_normalize(short_conv_silu(x, weight, k, documents).view({B, T, H, head_dim}), eps,
                      scale, k);
}

}  // namespace viaduct::ops
