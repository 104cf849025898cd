// gemm_add: c + x w^T as one cuBLASLt GEMM that reads c and writes a new
// tensor (see Note [The partial sum added by the GEMM]).
#include <cublasLt.h>

#include <array>
#include <map>
#include <mutex>

#include "kernels/fn_common.h"
#include "kernels/fused.h"

namespace viaduct::kernels {

namespace {

// Note [The partial sum added by the GEMM]
// kimi_k3's AttnRes blocks add every sublayer's output to the block's
// partial sum. The token mixer's ends in a GEMM (KDA's o_proj, MLA's wo), so
// that sum is p' = p + x W^T. As a GEMM then an add, the product is
// written, then read again with p to write p'. cuBLAS's epilogue can add a matrix C to
// the product, but ATen's addmm first copies C into its result and runs
// the GEMM in place (a device-to-device copy as large as the add), and p
// cannot be the result: the AttnRes reads keep it for their backward.
// cuBLASLt takes C and the result D as two tensors, so here the GEMM reads
// p as C and writes p' as D: the add's pass is gone, the GEMM reads one
// more matrix. With beta 1 cuBLAS rounds the product to bf16 before adding
// C, the bits of the GEMM then the add (bench/kernels/partial_sum_gemm.py
// compares them).

// 32 MiB, what cuBLAS asks for on Hopper.
constexpr size_t kWorkspaceBytes = 32u << 20;

void check_lt(cublasStatus_t s, const char* what) {
  VIADUCT_CHECK(s == CUBLAS_STATUS_SUCCESS, "cuBLASLt ", what, " failed: ",
                cublasLtGetStatusString(s));
}

// One Lt handle a device, made on first use and kept for the process.
cublasLtHandle_t lt_handle(int device) {
  static std::mutex m;
  static std::map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> g(m);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  check_lt(cublasLtCreate(&h), "handle creation");
  handles.emplace(device, h);
  return h;
}

// The descriptors and the heuristic's algorithm of one shape, kept for the
// process: the same few shapes recur every step.
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

// The largest power of two up to 256 that divides p's address: the
// heuristic may otherwise pick a kernel that assumes 256-byte alignment.
uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 2 && a % al != 0) al /= 2;
  return al;
}

// Row-major D [M, N] = C + X [M, K] W [N, K]^T in cuBLAS's column-major
// terms: D^T (N x M, ld N) = W X^T + C^T, with A = W read as the K x N
// column-major matrix W^T (ld K) and transposed, B = X^T as K x M (ld K),
// and C, D both N x M (ld N). align: the alignments of W, X, C and D, in
// that order.
const Plan& plan_for(int device, int64_t M, int64_t N, int64_t K,
                     const std::array<uint32_t, 4>& align) {
  static std::mutex m;
  static std::map<std::array<int64_t, 8>, Plan> plans;
  std::lock_guard<std::mutex> g(m);
  const std::array<int64_t, 8> key{device, M, N, K, align[0], align[1], align[2], align[3]};
  auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  Plan p;
  check_lt(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul descriptor");
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
           "transa");
  check_lt(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
           "transb");
  check_lt(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, K, N, K), "A layout");
  check_lt(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, K, M, K), "B layout");
  check_lt(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, N, M, N), "C layout");
  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(cublasLtMatmulPreferenceCreate(&pref), "preference");
  const uint64_t ws = kWorkspaceBytes;
  check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &ws, sizeof(ws)),
           "workspace preference");
  const cublasLtMatmulPreferenceAttributes_t min_align[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    check_lt(cublasLtMatmulPreferenceSetAttribute(pref, min_align[i], &align[i], sizeof(align[i])),
             "alignment preference");
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const auto s = cublasLtMatmulAlgoGetHeuristic(lt_handle(device), p.op, p.a, p.b, p.c, p.c,
                                                pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  check_lt(s, "heuristic");
  VIADUCT_CHECK(found > 0, "cuBLASLt has no GEMM for [", M, ", ", K, "] x [", K, ", ", N,
                "] plus C in bf16");
  p.algo = result.algo;
  return plans.emplace(key, p).first->second;
}

}  // namespace

at::Tensor gemm_add(const at::Tensor& x, const at::Tensor& w, const at::Tensor& c) {
  RECORD_FUNCTION("viaduct::gemm_add", std::vector<c10::IValue>());  // named in profiles
  const auto K = x.size(-1), N = w.size(0);
  VIADUCT_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 &&
                    w.scalar_type() == at::kBFloat16 && c.scalar_type() == at::kBFloat16,
                "gemm_add: x, w and c must be bf16 CUDA tensors");
  VIADUCT_CHECK(w.dim() == 2 && w.size(1) == K && c.size(-1) == N &&
                    c.numel() / N == x.numel() / K,
                "gemm_add: x [..., ", K, "], w [N, ", K, "] and c [..., N] do not match: ",
                x.sizes(), ", ", w.sizes(), ", ", c.sizes());
  const auto M = x.numel() / K;
  const auto xc = x.contiguous(), wc = w.contiguous(), cc = c.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto d = at::empty(sizes, x.options());
  if (M == 0) return d;
  const int device = x.device().index();
  const auto& p = plan_for(device, M, N, K,
                           {alignment(wc.data_ptr()), alignment(xc.data_ptr()),
                            alignment(cc.data_ptr()), alignment(d.data_ptr())});
  const auto ws = at::empty({static_cast<int64_t>(kWorkspaceBytes)}, x.options().dtype(at::kByte));
  const float one = 1.f;
  check_lt(cublasLtMatmul(lt_handle(device), p.op, &one, wc.data_ptr(), p.a, xc.data_ptr(), p.b,
                          &one, cc.data_ptr(), p.c, d.data_ptr(), p.c, &p.algo, ws.data_ptr(),
                          kWorkspaceBytes, stream_of(x)),
           "matmul");
  return d;
}

}  // namespace viaduct::kernels
