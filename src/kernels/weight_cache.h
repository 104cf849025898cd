// Note [Low-precision weight cache]
//
// Training keeps fp32 master weights and computes in bf16, so every linear
// casts its weight on every forward -- once per micro-batch under a
// pipeline, and the cast weight is kept for the backward anyway. The cache
// keeps that cast copy between forwards instead:
//
//  - get(parts, dtype, dim) returns the parts (fp32 [out_i, in] weights, or
//    [out_i] biases) cast to `dtype` and concatenated along dim 0 (one part:
//    the weight itself; q, k, v: the one-GEMM projection's weight), or along
//    another dim (the MoE's stacked [E, H, D] w1 and w3 side by side as
//    [E, 2H, D]: one grouped GEMM's weight). The copy is reused
//    while every part's version counter still reads what it read when the
//    copy was made; a part that moved is re-cast into its rows. Any ATen
//    in-place write of a weight (the optimizer's loop, a checkpoint load,
//    init) bumps its version, so a stale copy is never returned.
//  - The fused AdamW kernel writes the new bf16 value of each weight that
//    has a copy in the same pass as the fp32 update (slot_for), then
//    mark_written bumps the weight's version (the kernel's raw writes do
//    not) and records the copy as current: the next forward casts nothing.
//    The kernel rounds to nearest-even as a cast does, so the copy has the
//    bits a cast would give and the cache changes no result.
//
// Memory: the copies of all cached weights stay resident (2 bytes a
// parameter for bf16), but the cast weights were kept for the backward
// already, so the activation peak does not grow. The copies do not require
// grad; the autograd functions that use them return the gradient to the
// fp32 parts.
//
// Ownership: one WeightCache per rank, made with the rank's model
// (train/rank_model.cpp, freed with it) and reached through
// ops::KernelOptions::weight_cache by the ops that cast weights -- linear,
// the fused SwiGLU's down projection, the grouped MoE experts, the chunked
// head loss -- and by the AdamW kernel's update. Where options carry none
// (a module built outside a training run), every cast is made afresh.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace viaduct::kernels {

// One rank's copies (see above). The rank's model owns one (train/
// rank_model.h) and hands it to every module and to the optimizer through
// ops::KernelOptions::weight_cache; nothing else reaches it. Thread-safe.
class WeightCache {
 public:
  WeightCache();
  ~WeightCache();
  WeightCache(const WeightCache&) = delete;
  WeightCache& operator=(const WeightCache&) = delete;

  // `parts` cast to `dtype` and concatenated along `dim` (see above). The
  // parts of one number of dims (biases 1, weights 2, the MoE's stacked
  // expert weights 3) with the same sizes but along `dim`, on one device. The
  // result must not be written. Parts that are not leaves (views, results of
  // ops) are cast every time and not kept. A weight's copy is that of the
  // last grouping asked for.
  at::Tensor get(at::TensorList parts, at::ScalarType dtype, int64_t dim = 0);

  // For the optimizer: `p`'s part of its copy, a view of p's sizes (in the
  // copy's dtype) -- contiguous where the copy concatenates along dim 0,
  // else each index along the dims before the concatenation's holds a
  // contiguous block -- or an undefined tensor when p has no copy.
  at::Tensor slot_for(const at::Tensor& p);

  // After the optimizer wrote p and slot_for(p) from the same new values:
  // bumps p's version and records p's rows of the copy as current.
  void mark_written(const at::Tensor& p);

  // A [1, n] row of ones of `dtype` on `device` (the bias gradients'
  // product with ones: see Note [Bias gradient as a product with ones],
  // ops/linear.cpp): a view of one kept vector per dtype and device, grown
  // to the longest row asked for. Not to be written.
  at::Tensor ones_row(int64_t n, at::ScalarType dtype, const at::Device& device);

  // Forgets every copy (they are rebuilt on use).
  void clear();

  // Bytes held by the copies; the number of get() calls that cast at least
  // one part (for tests and logs).
  int64_t bytes();
  int64_t casts();

  struct Entry;  // one copy and its parts (weight_cache.cpp)

 private:
  std::mutex mu_;
  // Each part's entry, keyed by its TensorImpl (checked against the weak
  // pointer, so a new tensor at a freed address never matches).
  std::unordered_map<const c10::TensorImpl*, std::shared_ptr<Entry>> by_part_;
  int64_t casts_ = 0;
  std::vector<at::Tensor> ones_;  // ones_row's vectors, one per dtype and device
};

// `parts` cast as WeightCache::get casts them: through `cache` where the
// caller has one, else a fresh cast on every call (the same bits).
at::Tensor cast_weights(WeightCache* cache, at::TensorList parts, at::ScalarType dtype,
                        int64_t dim = 0);

// WeightCache::ones_row through `cache` where the caller has one, else a
// fresh row of ones.
at::Tensor ones_row(WeightCache* cache, int64_t n, at::ScalarType dtype, const at::Device& device);

}  // namespace viaduct::kernels
