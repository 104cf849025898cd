// Vision tower and the placeholder merge (see vision.h).
#include "model/vision.h"

#include <cmath>

#include "core/check.h"
#include "core/rng.h"

namespace viaduct {

VisionTowerImpl::VisionTowerImpl(const VisionOptions& o) : opts_(o) {
  VIADUCT_CHECK(o.patch_size > 0 && o.image_size % o.patch_size == 0,
                "model.vision_image_size (", o.image_size,
                ") must be a multiple of model.vision_patch_size (",
                o.patch_size, ")");
  VIADUCT_CHECK(o.dim % o.n_heads == 0, "vision width ", o.dim,
                " must divide by its heads ", o.n_heads);
  const int64_t patch_in = o.channels * o.patch_size * o.patch_size;
  patch_embed = make_linear(*this, "patch_embed", patch_in, o.dim, true);
  pos_embed = register_parameter("pos_embed", torch::zeros({o.patches(), o.dim}));
  norm1 = register_module("norm1", RMSNorm(o.dim, o.norm_eps));
  wqkv = make_linear(*this, "wqkv", o.dim, 3 * o.dim, false);
  wo = make_linear(*this, "wo", o.dim, o.dim, false);
  norm2 = register_module("norm2", RMSNorm(o.dim, o.norm_eps));
  mlp = register_module("mlp", SwiGLU(o.dim, 2 * o.dim));
  norm = register_module("norm", RMSNorm(o.dim, o.norm_eps));
  proj = make_linear(*this, "proj", o.dim, o.out_dim, false);
}

int64_t VisionTowerImpl::count_params(const VisionOptions& o) {
  const int64_t patch_in = o.channels * o.patch_size * o.patch_size;
  return patch_in * o.dim + o.dim + o.patches() * o.dim  // patches + positions
         + 3 * o.dim * o.dim + o.dim * o.dim               // attention
         + 3 * o.dim * 2 * o.dim                           // SwiGLU
         + 3 * o.dim                                       // norms
         + o.dim * o.out_dim;                              // projection
}

void VisionTowerImpl::init_weights(uint64_t seed, const std::string& p) {
  const double std = 0.02;
  auto tn = [&](const at::Tensor& w, const std::string& name) {
    init_trunc_normal_(w, std, -2.0, 2.0, seed, p + name);
  };
  tn(patch_embed->weight, "patch_embed.weight");
  tn(pos_embed, "pos_embed");
  tn(wqkv->weight, "wqkv.weight");
  tn(wo->weight, "wo.weight");
  mlp->init_weights(seed, p + "mlp.", std, std);
  tn(proj->weight, "proj.weight");
  torch::NoGradGuard g;
  patch_embed->bias.zero_();
  norm1->reset_parameters();
  norm2->reset_parameters();
  norm->reset_parameters();
}

at::Tensor VisionTowerImpl::forward(const at::Tensor& input) {
  // images: [B, n, C, S, S]; uint8 pixels (image-text data) are scaled to
  // [-1, 1] here, on the device.
  const at::Tensor images =
      input.scalar_type() == at::kByte ? input.to(at::kFloat) / 127.5 - 1.0 : input;
  VIADUCT_CHECK(images.dim() == 5 && images.size(2) == opts_.channels &&
                    images.size(3) == opts_.image_size &&
                    images.size(4) == opts_.image_size,
                "images must be [B, n_img, ", opts_.channels, ", ",
                opts_.image_size, ", ", opts_.image_size, "], got ",
                images.sizes());
  const auto B = images.size(0), n = images.size(1);
  const auto C = opts_.channels, p = opts_.patch_size;
  const auto g = opts_.image_size / p, P = g * g, Dv = opts_.dim;
  // Patchify: [B n, C, g, p, g, p] -> [B n, P, C p p]
  auto x = images.reshape({B * n, C, g, p, g, p})
               .permute({0, 2, 4, 1, 3, 5})
               .reshape({B * n, P, C * p * p});
  auto h = linear(x, patch_embed, kernel_options_) + pos_embed.to(x.scalar_type());  // [Bn,P,Dv]
  // Bidirectional self-attention over the patches of one image.
  const auto H = opts_.n_heads, hd = Dv / H;
  auto qkv = linear(norm1(h), wqkv, kernel_options_).view({B * n, P, 3, H, hd});
  auto q = qkv.select(2, 0).transpose(1, 2);  // [Bn, H, P, hd]
  auto k = qkv.select(2, 1).transpose(1, 2);
  auto v = qkv.select(2, 2).transpose(1, 2);
  const auto st = h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto att = at::softmax(at::matmul(q.to(st), k.to(st).transpose(-1, -2)) /
                             std::sqrt(static_cast<double>(hd)),
                         -1)
                 .to(v.scalar_type());
  auto a = at::matmul(att, v).transpose(1, 2).reshape({B * n, P, Dv});
  h = h + linear(a, wo, kernel_options_);
  h = h + mlp(norm2(h));
  return linear(norm(h), proj, kernel_options_).reshape({B, n * P, opts_.out_dim});
}

at::Tensor merge_image_embeddings(const at::Tensor& h, const at::Tensor& tokens,
                                  const at::Tensor& patches,
                                  int64_t image_token_id) {
  // h: [B, T, D], tokens: [B, T], patches: [B, P, D]
  auto mask = tokens.eq(image_token_id);  // [B, T]
  // The count per row is checked where it costs nothing: on host tokens. On
  // a GPU, reading the flag would wait for the device once per micro-batch;
  // there the rows come from the sampler and eval-captions, which refuse
  // captions holding the placeholder id before the tokens leave the host.
  if (tokens.is_cpu()) {
    const auto per_row = mask.sum(1);
    VIADUCT_CHECK((per_row == patches.size(1)).all().item<bool>(),
                  "each sequence must hold exactly ", patches.size(1),
                  " image placeholder tokens (id ", image_token_id,
                  ", one per patch of its images); got ", per_row);
  }
  return h.masked_scatter(mask.unsqueeze(-1).expand_as(h),
                          patches.to(h.scalar_type()));
}

}  // namespace viaduct
