// The vision tower: a small patch encoder whose outputs take the place of the
// image placeholder tokens in the embedded sequence. Pinned to the embedding's
// stage (it counts as no split unit).
//
// Images: [B, n_img, C, S, S] floats, or uint8 pixels (0..255), which the
// tower scales to [-1, 1]. Each image gives (S / p)^2 patch
// embeddings; a sequence carries exactly that many placeholder tokens
// (model.image_token_id) per image, in image order.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "model/layers.h"

namespace viaduct {

struct VisionOptions {
  int64_t out_dim = 0;     // the language model's width
  int64_t dim = 64;        // the tower's width
  int64_t n_heads = 2;
  int64_t channels = 3;
  int64_t image_size = 16;
  int64_t patch_size = 8;
  double norm_eps = 1e-5;
  int64_t patches() const {
    return (image_size / patch_size) * (image_size / patch_size);
  }
};

// FQNs: patch_embed, pos_embed, norm1, wqkv, wo, norm2, mlp.{w1,w2,w3},
// norm, proj. One pre-norm encoder block with bidirectional attention.
class VisionTowerImpl : public torch::nn::Module, public ops::KernelUser {
 public:
  explicit VisionTowerImpl(const VisionOptions& opts);
  // images: [B, n_img, C, S, S] -> [B, n_img * patches, out_dim]
  at::Tensor forward(const at::Tensor& images);
  void init_weights(uint64_t seed, const std::string& prefix);
  static int64_t count_params(const VisionOptions& o);

  VisionOptions opts_;
  torch::nn::Linear patch_embed{nullptr}, wqkv{nullptr}, wo{nullptr};
  torch::nn::Linear proj{nullptr};
  at::Tensor pos_embed;
  RMSNorm norm1{nullptr}, norm2{nullptr}, norm{nullptr};
  SwiGLU mlp{nullptr};
};
TORCH_MODULE(VisionTower);

// Replace the embeddings at placeholder positions by the tower's outputs.
// h: [B, T, D], tokens: [B, T], patches: [B, P, D] with P placeholders per
// row. Differentiable in h and patches.
at::Tensor merge_image_embeddings(const at::Tensor& h, const at::Tensor& tokens,
                                  const at::Tensor& patches,
                                  int64_t image_token_id);

}  // namespace viaduct
