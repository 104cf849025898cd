// viaduct's CUDA kernels, on raw device pointers (no LibTorch here, so the
// .cu file compiles with nvcc alone). kernels/fused.h wraps them for autograd.
//
// Every tensor is contiguous, row-major. `DType` names the activation type;
// norms' weights, statistics and partial sums are fp32, and all arithmetic is
// fp32. Every reduction has a fixed order (no atomics): the same inputs give
// the same bits on every run and every layout.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace viaduct::cuda {

enum class DType { kFloat32, kBFloat16 };

// True when the kernels were compiled for `device`'s architecture (sm_90a:
// compute capability 9.0). Cached per device.
bool device_supported(int device);

// y = x * rsqrt(mean(x^2) + eps) * w per row; rstd[row] = that rsqrt.
// x, y: [rows, dim]; w: [dim]; rstd: [rows]. With res and h (both or
// neither): h = x + res rounded to dt, written to h, and normalised instead
// of x.
cudaError_t rms_norm_forward(DType dt, const void* x, const void* res, const float* w,
                             void* h, void* y, float* rstd, int64_t rows, int64_t dim,
                             float eps, cudaStream_t stream);
// How many partial rows rms_norm_backward writes to dw_partial.
int64_t rms_norm_backward_parts(int64_t rows);
// dx = rstd * (g - x * rstd^2 * mean(g * x)) with g = dy * w, and
// dw_partial[p, :] = sum over the rows block p handles of dy * x * rstd
// (the caller sums the parts: dw = dw_partial.sum(0)). dres, when not
// null ([rows, dim]): dx = dres + dx rounded to dt (the gradient of a
// normalised h = x + res that is also used elsewhere).
// register_form = false forces the loop form (the register form keeps a
// thread's row slices in registers for rows of up to 2 slices a thread).
cudaError_t rms_norm_backward(DType dt, const void* dy, const void* x,
                              const float* w, const float* rstd, const void* dres,
                              void* dx, float* dw_partial, int64_t rows, int64_t dim,
                              bool register_form, cudaStream_t stream);

// Rotary embedding on interleaved pairs (x[2i], x[2i+1]); y: contiguous
// [B, T, H, hd]; x read with element strides (sB, sT, sH, 1); cos, sin:
// [>= T, hd / 2] (row t used for position t). inverse = true rotates by
// -theta (the backward). Output head h rotates the fp32 sum of x's heads
// (h / div) * mul + r, r < cnt: (1, 1, 1) a plain rotation of x [B, T, H,
// hd]; (rep, 1, 1) x [B, T, H / rep, hd] with each head written rep times;
// (1, rep, rep) x [B, T, H * rep, hd] with each run of rep heads summed.
// cos == sin == nullptr: the same without the rotation (copies and sums).
cudaError_t rope(DType dt, const void* x, const float* cos, const float* sin,
                 void* y, int64_t B, int64_t T, int64_t H, int64_t hd, int64_t sB,
                 int64_t sT, int64_t sH, bool inverse, int64_t div, int64_t mul, int64_t cnt,
                 cudaStream_t stream);

// Block AttnRes read (Note [AttnRes read without keys], model/attn_res.cpp)
// over n <= kMaxReadSources sources, each a contiguous [rows, dim] tensor of
// the same dtype; u = norm weight * query, fp32 [dim]. Forward: per row,
// rstd_i = rsqrt(mean(v_i^2) + eps), dot_i = v_i . u, alpha = softmax_i(
// rstd_i dot_i), out = sum_i alpha_i v_i (in source order); writes rstd,
// dot, alpha as fp32 [n, rows]. Backward: from g = d out, writes dv_i =
// alpha_i g + dd_i u - dr_i v_i (dd_i = dlogit_i rstd_i, dr_i = dlogit_i
// dot_i rstd_i^3 / dim, dlogit_i = alpha_i (g.v_i - sum_j alpha_j g.v_j))
// and du_partial[p, :] = the sum over the rows block p handles of
// sum_i dd_i v_i (the caller sums the parts). warp_per_row picks the
// kernels: one warp a row (Note [Fused AttnRes read, warp per row]) or one
// block a row (Note [Fused AttnRes read]); the statistics are interchangeable
// between them, du_partial's row count is not.
constexpr int kMaxReadSources = 64;
struct ReadSources {
  const void* p[kMaxReadSources];
};
struct ReadGrads {
  void* p[kMaxReadSources];
};
// The RMSNorm that takes the read's output (Note [AttnRes read with its
// norm], fused_kernels.cu), when the launches get one: weight w [dim] fp32
// and eps; the forward writes out = norm(h) instead of h and the norm's
// rstd [rows]; the backward takes dy, the gradient of norm(h), instead of
// h's, and writes the weight's gradient as dw_partial rows (as du_partial).
struct ReadNorm {
  const float* w = nullptr;
  float eps = 0.f;
  float* rstd = nullptr;  // forward: written; backward: read
  const void* dy = nullptr;
  float* dw_partial = nullptr;
  // Backward: the two-pass form where it takes the source count (Note [Read
  // with its norm in two passes]); false: the three-pass form.
  bool two_pass = true;
};
// Whether the read with its norm runs for these sources (the warp-per-row
// register form: 16-byte aligned rows of at most 2048 bf16 / 1024 fp32).
bool attn_res_read_norm_fits(DType dt, const ReadSources& src, int n, int64_t dim);
// nrm: null, or the norm (attn_res_read_norm_fits, warp_per_row only).
cudaError_t attn_res_read_forward(DType dt, const ReadSources& src, int n, const float* u,
                                  void* out, float* rstd, float* dot, float* alpha, int64_t rows,
                                  int64_t dim, float eps, bool warp_per_row, cudaStream_t stream,
                                  const ReadNorm* nrm = nullptr);
// How many partial rows attn_res_read_backward writes to du_partial.
int64_t attn_res_read_backward_parts(int64_t rows, bool warp_per_row);
// acc.p[i], when not null (warp_per_row only): dsrc.p[i] receives acc.p[i]
// + the gradient rounded to the dtype (the two may be the same buffer).
cudaError_t attn_res_read_backward(DType dt, const ReadSources& src, const ReadSources& acc,
                                   const ReadGrads& dsrc, int n, const void* g, const float* u,
                                   const float* rstd, const float* dot, const float* alpha,
                                   float* du_partial, int64_t rows, int64_t dim,
                                   bool warp_per_row, cudaStream_t stream,
                                   const ReadNorm* nrm = nullptr);

// out[s, c] = the sum over p of partial[s, p, c], for fp32 partial rows
// [sets, parts, dim] (Note [Summing the read's partial rows]); in a fixed
// order, bitwise reproducible. With prod: also prod->out_a[c] = out[0, c] *
// prod->a[c] and prod->out_b[c] = out[0, c] * prod->b[c].
struct PartsProducts {
  const float* a = nullptr;
  const float* b = nullptr;
  float* out_a = nullptr;
  float* out_b = nullptr;
};
cudaError_t sum_parts(const float* partial, int64_t parts, int64_t dim, int sets, float* out,
                      cudaStream_t stream, const PartsProducts* prod = nullptr);

// Note [Small tensors in one AdamW launch] (fused_kernels.cu): adamw() for
// `count` tensors, up to 24 a launch, with the bits of one call each. Every
// item must be adamw_batchable: 1 to kAdamWSmall values, a multiple of 4,
// every pointer 16-byte aligned (low_bf16 may be null).
constexpr int64_t kAdamWSmall = 1 << 16;
struct AdamWItem {
  float* p = nullptr;
  const float* g = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  void* low_bf16 = nullptr;
  int64_t n = 0;
  float weight_decay = 0.f;
};
bool adamw_batchable(const AdamWItem& t);
cudaError_t adamw_batch(const AdamWItem* items, int count, float lr, float beta1, float beta2,
                        float eps, float bias_corr1, float bias_corr2, float grad_scale,
                        cudaStream_t stream, const float* scale_dev = nullptr);

// Note [Clip coefficient on the device] (fused_kernels.cu): from k fp32
// per-tensor gradient norms, norm_out[0] = the global norm (double) and
// scale_out[0] = the clip coefficient as fp32, or NaN when the norm is not
// finite (max_norm <= 0: no clipping, 1).
cudaError_t clip_scale(const float* norms, int64_t k, double max_norm, double* norm_out,
                       float* scale_out, cudaStream_t stream);

// One AdamW step on fp32 [n] tensors, in place, on the gradient
// g' = g * grad_scale (rounded as a separate multiply): p *= 1 - lr * wd;
// m += (1 - beta1) (g' - m); v = beta2 v + (1 - beta2) g^2;
// p -= lr / bias_corr1 * m / (sqrt(v) / sqrt(bias_corr2) + eps) (g' for g); and, when
// low_bf16 is not null, low_bf16[i] = bf16(p[i]) (round to nearest even).
// With scale_dev: grad_scale is read from scale_dev[0] on the device, and
// NaN there updates nothing (Note [Clip coefficient on the device]).
cudaError_t adamw(float* p, const float* g, float* m, float* v, void* low_bf16, int64_t n,
                  float lr, float beta1, float beta2, float eps, float weight_decay,
                  float bias_corr1, float bias_corr2, float grad_scale, cudaStream_t stream,
                  const float* scale_dev = nullptr);

// y = silu(a) * b, elementwise over n values. With width > 0: n / width
// rows of `width` values, y contiguous, a and b (da and db) `pitch` values
// apart from row to row (the halves of one [rows, 2 width] GEMM output:
// pitch = 2 width; Note [One w1/w3 projection]); width 0: all contiguous.
cudaError_t swiglu_forward(DType dt, const void* a, const void* b, void* y,
                           int64_t n, cudaStream_t stream, int64_t width = 0, int64_t pitch = 0);
// da = dy * b * silu'(a), db = dy * silu(a); dy contiguous, a, b, da, db
// as swiglu_forward's a and b.
cudaError_t swiglu_backward(DType dt, const void* dy, const void* a,
                            const void* b, void* da, void* db, int64_t n,
                            cudaStream_t stream, int64_t width = 0, int64_t pitch = 0);

// Cross-entropy of each row of logits [rows, vocab] against targets[row]
// (== ignore_index: skipped). Writes row_loss[row] = logsumexp - logit[target]
// (0 when skipped) and overwrites the logits, in place, with the gradient of
// the row's loss: softmax - onehot(target) (all zero when skipped).
cudaError_t cross_entropy_forward_backward(DType dt, void* logits,
                                           const int64_t* targets,
                                           float* row_loss, int64_t rows,
                                           int64_t vocab, int64_t ignore_index,
                                           cudaStream_t stream);

}  // namespace viaduct::cuda
