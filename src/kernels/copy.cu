// Strided row copies in 16-byte words (see kernels/copy.h). ATen's strided
// copy runs one element a thread through an offset calculator: the same
// bytes at a fraction of the memory's pace. Here every thread moves whole
// 16-byte words, a few at a time, so several loads are in flight before the
// first store.
#include "kernels/copy.h"

namespace viaduct::cuda {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kWordsPerThread = 4;

// Widen: src holds bf16 and dst fp32, so each 16-byte source word (eight
// values) becomes two destination words, every value widened exactly (its
// bits shifted up by 16, as ATen's conversion does).
template <bool Widen>
__global__ void __launch_bounds__(kCopyThreads)
    copy_rows_kernel(const char* __restrict__ src, StridedRows sr, char* __restrict__ dst,
                     StridedRows dr, int64_t words_per_row, int64_t words) {
  constexpr int64_t kDstWord = Widen ? 32 : 16;  // bytes a source word becomes
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kCopyThreads * kWordsPerThread) +
                        threadIdx.x;
  uint4 v[kWordsPerThread];
  int64_t at[kWordsPerThread];
#pragma unroll
  for (int k = 0; k < kWordsPerThread; ++k) {
    const int64_t i = first + static_cast<int64_t>(k) * kCopyThreads;
    at[k] = -1;
    if (i < words) {
      const int64_t w = i % words_per_row, r = i / words_per_row;
      const int64_t i2 = r % sr.n2, r01 = r / sr.n2;
      const int64_t i1 = r01 % sr.n1, i0 = r01 / sr.n1;
      v[k] = __ldg(reinterpret_cast<const uint4*>(src + i0 * sr.s0 + i1 * sr.s1 + i2 * sr.s2) + w);
      at[k] = i0 * dr.s0 + i1 * dr.s1 + i2 * dr.s2 + w * kDstWord;
    }
  }
#pragma unroll
  for (int k = 0; k < kWordsPerThread; ++k) {
    if (at[k] < 0) continue;
    if constexpr (Widen) {
      // Little-endian: a 32-bit lane holds value 2i in its low half.
      const uint32_t h[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
      const uint4 lo{h[0] << 16, h[0] & 0xffff0000u, h[1] << 16, h[1] & 0xffff0000u};
      const uint4 hi{h[2] << 16, h[2] & 0xffff0000u, h[3] << 16, h[3] & 0xffff0000u};
      *reinterpret_cast<uint4*>(dst + at[k]) = lo;
      *reinterpret_cast<uint4*>(dst + at[k] + 16) = hi;
    } else {
      *reinterpret_cast<uint4*>(dst + at[k]) = v[k];
    }
  }
}

unsigned blocks_for(int64_t words) {
  const int64_t per_block = static_cast<int64_t>(kCopyThreads) * kWordsPerThread;
  return static_cast<unsigned>((words + per_block - 1) / per_block);
}

}  // namespace

cudaError_t copy_rows(const void* src, const StridedRows& src_rows, void* dst,
                      const StridedRows& dst_rows, int64_t row_bytes, bool widen,
                      cudaStream_t stream) {
  const int64_t words_per_row = row_bytes / 16;
  const int64_t words = src_rows.n0 * src_rows.n1 * src_rows.n2 * words_per_row;
  if (words == 0) return cudaSuccess;
  auto kernel = widen ? copy_rows_kernel<true> : copy_rows_kernel<false>;
  kernel<<<blocks_for(words), kCopyThreads, 0, stream>>>(static_cast<const char*>(src), src_rows,
                                                         static_cast<char*>(dst), dst_rows,
                                                         words_per_row, words);
  return cudaGetLastError();
}

}  // namespace viaduct::cuda
