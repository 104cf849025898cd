// KDA chunked gated delta rule launches (kernels/kda.cu).
//
// The chunked form of model/kda.h's recurrence at chunk C = 64, head width
// D (dk = dv = D) of 64 or 128, every tensor fp32 and contiguous. Inputs
// keep the model's [B, T, H, *] layout (q, k, v, g: [B, T, H, D]; beta:
// [B, T, H]); rows past T in the last chunk read as zero (beta = 0, g = 0:
// they change nothing before them). Per-chunk intermediates are indexed by
// z = (b H + h) N + n with N = ceil(T / C) (or the chunk table's N, see
// KdaShape):
//   G       in-chunk inclusive cumulative sum of g (recomputed, never stored)
//   Aqk     [Z, C, C]  sum_d q_cd k_jd e^{G_cd - G_jd}, j <= c (0 above)
//   Kp      [Z, C, C]  sum_d k_cd k_jd e^{G_cd - G_jd}, j < c (0 elsewhere)
//   Tm      [Z, C, C]  (I + diag(beta) Kp)^-1 (unit lower triangular)
//   R       [Z, C, 2D] [beta e^G k | beta v]; Tm R = [W | U] (the caller's GEMM)
//   qe, ke  [Z, C, D]  q e^G and k e^{G_last - G}
//   dec     [Z, D]     e^{G_last}
// The scan over chunks, per head, with S_0 the initial state [D, D]:
//   v'_n = U_n - W_n S_n;  o_n = qe_n S_n + Aqk_n v'_n;
//   S_n+1 = dec_n * S_n + ke_n^T v'_n   (dec scales the key rows of S)
// The kernels here run the state pass; o and the backward's other products
// are batched GEMMs over the chunks on the saved states.
// Every exponent is <= 0 (G falls along the chunk), so nothing overflows.
// Every sum has a fixed order and no atomics: the same inputs give the same
// bits on every run.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common.h"

namespace viaduct::cuda {

constexpr int64_t kKdaChunk = 64;

// True for the head widths the kernels are built for.
bool kda_supported(int64_t head_dim);

// Callable in kernels too (the shape is passed by value).
#ifdef __CUDACC__
#define VIADUCT_KDA_HD __host__ __device__
#else
#define VIADUCT_KDA_HD
#endif
// Chunk n of row b holds tokens n C .. n C + C - 1 of the row (rows past T
// read as zero), or, with a table of spans, the tokens the table gives it:
// spans [B, N, 2] int32 holds each chunk's first token in its row and its
// token count (<= C; 0 for a chunk past the row's last), so that no chunk
// holds two documents and every token is in exactly one chunk (documents
// in place, see Note [KDA chunks over documents], ops/documents.h).
struct KdaShape {
  int64_t B = 0, T = 0, H = 0, D = 0;
  const int32_t* spans = nullptr;  // on the device; null: the plain chunks
  int64_t N = 0;                   // the table's chunks per row
  VIADUCT_KDA_HD int64_t chunks() const {
    return spans != nullptr ? N : (T + kKdaChunk - 1) / kKdaChunk;
  }
  VIADUCT_KDA_HD int64_t Z() const { return B * H * chunks(); }
};

// The intra-chunk products, the inverse and the scaled rows, all chunks at
// once. v is fp32 or bf16 (v_type), read as it is (the layer's convolution
// writes it in the activations' type); every other tensor is fp32.
cudaError_t kda_intra_forward(const KdaShape& s, const float* q, const float* k, const void* v,
                              DType v_type, const float* g, const float* beta, float* Aqk, float* Kp,
                              float* Tm, float* R, float* qe, float* ke, float* dec,
                              cudaStream_t stream);

// The serial state pass, forward: WU = Tm R [Z, C, 2D]; S0 [B H, D, D] may
// be null (zero state). Writes v' [Z, C, D], the state as every chunk
// starts [Z, D, D] and the final state [B H, D, D]:
//   v'_n = U_n - W_n S_n;  S_n+1 = dec_n * S_n + ke_n^T v'_n
// (o_n = qe_n S_n + Aqk_n v'_n is then a batched GEMM for the caller.)
// restarts [B][N] (null: none): where set, S_n is zero instead (a
// document's first chunk); the backward then passes no gradient back past
// that chunk.
cudaError_t kda_scan_forward(const KdaShape& s, const float* WU, const float* ke,
                             const float* dec, const float* S0, const uint8_t* restarts,
                             float* vnew, float* states, float* final_state,
                             cudaStream_t stream);

// The state pass backward, chunks in reverse, from X = Aqk^T do [Z, C, D],
// Y = qe^T do [Z, D, D] and dS_N [B H, D, D] (null: zero). Writes dv'
// [Z, C, dvnew_stride] (the first D columns of each row), dS_n+1 for every
// chunk n [Z, D, D] (the gradient of the state after chunk n) and dS_0
// [B H, D, D]:
//   dv'_n = X_n + ke_n dS_n+1;  dS_n = dec_n * dS_n+1 + Y_n - W_n^T dv'_n
// and, from the forward's states [Z, D, D], the parts of the gradient of
// dec, ddec_n[k] = sum_i dS_n+1[k, i] S_n[k, i], as ddec_part [Z, D,
// kda_ddec_parts(D)] (ddec is the sum over the last dim).
int64_t kda_ddec_parts(int64_t head_dim);
cudaError_t kda_scan_backward(const KdaShape& s, const float* WU, const float* ke,
                              const float* dec, const float* X, const float* Y, const float* dSN,
                              const uint8_t* restarts, const float* states, float* dvnew,
                              int64_t dvnew_stride, float* dstates, float* dS0, float* ddec_part,
                              cudaStream_t stream);

// The products over the chunks, C_z = alpha A_z B_z + beta C_z for every z
// of a batch, in fp32 on the tensor cores (split-tf32: three tf32 products
// a term, about fp32's accuracy; a fixed summation order, so bitwise run to
// run). Element (i, j) of an operand's matrix z is at data + z batch + i row
// + j col, and one of row, col is 1 (the matrix or its transpose
// contiguous); A is (m, k), B is (k, n). C_z is row-major with row stride
// c_row. M and N multiples of 64, K of 32; beta 0 or 1 (0: C is not read).
// With `tokens` set (to_tokens), M is the chunk (64), the batch is the Z
// chunks of that shape, and row m of C_z is the row of a [B, T, H, N]
// tensor C that the chunk's row m holds (its token and head), skipped where
// it holds none: the chunk layout's product lands in the token layout
// without a gather after it (c_batch unused; c_row the token row's stride).
struct KdaOperand {
  const float* data = nullptr;
  int64_t batch = 0, row = 0, col = 0;
};
struct KdaGemm {
  int64_t batch = 0, M = 0, N = 0, K = 0;
  KdaOperand A, B;
  float* C = nullptr;
  int64_t c_batch = 0, c_row = 0;
  float alpha = 1.f, beta = 0.f;
  bool to_tokens = false;
  KdaShape tokens;
  int64_t z_first = 0;  // the launch's first chunk (set by kda_gemm)
};
cudaError_t kda_gemm(const KdaGemm& g, cudaStream_t stream);

// Rows of x [*, width] (fp32) into out [rows, width]: out row r is x's row
// read[r], or zeros where read[r] < 0 (a chunk row that holds no token).
// width a multiple of 4, x and out 16-byte aligned.
cudaError_t kda_gather_rows(const float* x, const int64_t* read, int64_t rows, int64_t width,
                            float* out, cudaStream_t stream);

// The intra-chunk backward. Inputs: the forward's q, k, v, g, beta and Kp;
// dAqk [Z, C, C] (read on and below the diagonal), dM [Z, C, C] = dR [W|U]^T
// (the gradient of I + diag(beta) Kp is -dM, read below the diagonal), dR
// [Z, C, 2D] = Tm^T d[W | U], dqe, dke [Z, C, D], ddec [Z, D]. Writes dq,
// dk, dv, dg [B, T, H, D] (rows < T; dv in v's type, rounded once from
// its fp32 value) and dbeta in parts
// [kda_beta_slices(D), Z, C], one per slice of channels; dbeta of chunk
// row c is the parts' sum (in slice order).
int64_t kda_beta_slices(int64_t head_dim);
cudaError_t kda_intra_backward(const KdaShape& s, const float* q, const float* k, const void* v,
                               DType v_type, const float* g, const float* beta, const float* Kp,
                               const float* dAqk, const float* dM, const float* dR,
                               const float* dqe, const float* dke, const float* ddec, float* dq,
                               float* dk, void* dv, float* dg, float* dbeta_part,
                               cudaStream_t stream);

}  // namespace viaduct::cuda
