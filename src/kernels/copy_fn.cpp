// The strided row copy (CUDA build): a plain function for the other
// wrappers' forwards and backwards, no autograd.
#include "kernels/fused.h"

#include "kernels/copy.h"
#include "kernels/fn_common.h"

namespace viaduct::kernels {

namespace {

// t's leading dims (up to three, padded with size 1 in front) with byte
// strides; false where t has more than four dims or a last dim that is not
// dense.
bool as_rows(const at::Tensor& t, cuda::StridedRows& r) {
  const auto d = t.dim();
  if (d < 1 || d > 4 || t.stride(d - 1) != 1) return false;
  int64_t n[3] = {1, 1, 1}, s[3] = {0, 0, 0};
  for (int64_t i = 0; i < d - 1; ++i) {
    n[3 - (d - 1) + i] = t.size(i);
    s[3 - (d - 1) + i] = t.stride(i) * static_cast<int64_t>(t.element_size());
  }
  r = {n[0], n[1], n[2], s[0], s[1], s[2]};
  return true;
}

bool word_aligned(const cuda::StridedRows& r) {
  return r.s0 % 16 == 0 && r.s1 % 16 == 0 && r.s2 % 16 == 0;
}

}  // namespace

bool copy_rows_into(const at::Tensor& dst, const at::Tensor& src) {
  const bool widen = src.scalar_type() == at::kBFloat16 && dst.scalar_type() == at::kFloat;
  VIADUCT_CHECK(dst.sizes() == src.sizes() && (dst.scalar_type() == src.scalar_type() || widen) &&
                    dst.device() == src.device(),
                "copy_rows_into: dst ", dst.sizes(), " ", dst.scalar_type(), " and src ",
                src.sizes(), " ", src.scalar_type(),
                " must match in shape and device, and in dtype unless bf16 into fp32");
  cuda::StridedRows sr{}, dr{};
  const int64_t row_bytes = src.numel() == 0 ? 0 : src.size(-1) * src.element_size();
  if (!usable(src) || !as_rows(src, sr) || !as_rows(dst, dr) || !word_aligned(sr) ||
      !word_aligned(dr) || row_bytes % 16 != 0 || !aligned16(src.data_ptr()) ||
      !aligned16(dst.data_ptr())) {
    dst.copy_(src);  // ATen's copy takes any layout
    return false;
  }
  check_launch(
      cuda::copy_rows(src.data_ptr(), sr, dst.data_ptr(), dr, row_bytes, widen, stream_of(src)),
      "copy_rows");
  return true;
}

}  // namespace viaduct::kernels
