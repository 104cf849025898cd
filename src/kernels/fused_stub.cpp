// The CPU build's kernels/fused.h: usable() is false, so the ops/ layer
// never reaches the entry points below; each throws if called directly.
#include "kernels/fused.h"

#include "core/check.h"

namespace viaduct::kernels {

bool usable(const at::Tensor&) { return false; }

namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw Error(str("fused ", what, " needs viaduct's CUDA build"));
}
}  // namespace

bool copy_rows_into(const at::Tensor&, const at::Tensor&) { no_cuda("copy_rows_into"); }
int64_t kda_output_grad_rows(const at::Tensor&) { return 0; }
at::Tensor rms_norm(const at::Tensor&, const at::Tensor&, double) { no_cuda("rms_norm"); }
at::Tensor rope(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  no_cuda("rope");
}
at::Tensor repeat_heads(const at::Tensor&, int64_t) { no_cuda("repeat_heads"); }
std::vector<at::Tensor> mla_qkv(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, int64_t, int64_t) {
  no_cuda("mla_qkv");
}
std::vector<at::Tensor> rope_qkv(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                 int64_t) {
  no_cuda("rope_qkv");
}
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, double) {
  no_cuda("add_rms_norm");
}
at::Tensor swiglu_packed(const at::Tensor&) { no_cuda("swiglu_packed"); }
at::Tensor swiglu_linear(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const SwiGLULinearOptions&) {
  no_cuda("swiglu_linear");
}
at::Tensor swiglu_linear_packed(const at::Tensor&, const at::Tensor&,
                                const SwiGLULinearOptions&) {
  no_cuda("swiglu_linear_packed");
}
at::Tensor cross_entropy_rows_(at::Tensor&, const at::Tensor&, const at::Tensor&) {
  no_cuda("cross_entropy");
}
void scale_by_ratio_(at::Tensor&, const at::Tensor&, const at::Tensor&) {
  no_cuda("scale_by_ratio_");
}
at::Tensor l2_normalize(const at::Tensor&, double, double) { no_cuda("l2_normalize"); }
bool short_conv_silu_usable(const at::Tensor&, const at::Tensor&) { return false; }
at::Tensor short_conv_silu(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  no_cuda("short_conv_silu");
}
bool short_conv_silu_l2_usable(const at::Tensor&, const at::Tensor&, int64_t) { return false; }
at::Tensor short_conv_silu_l2(const at::Tensor&, const at::Tensor&, int64_t, double, double,
                              const at::Tensor&) {
  no_cuda("short_conv_silu_l2");
}
at::Tensor embedding_weight_grad(const at::Tensor&, const at::Tensor&, int64_t) {
  no_cuda("embedding backward");
}
bool attn_res_read_usable(const std::vector<at::Tensor>&) { return false; }
bool attn_res_read_norm_usable(const std::vector<at::Tensor>&, const at::Tensor&) {
  return false;
}
at::Tensor attn_res_read_norm(const std::vector<at::Tensor>&, const at::Tensor&,
                              const at::Tensor&, double, const std::vector<at::Tensor>*,
                              const at::Tensor&, double) {
  no_cuda("attn_res_read_norm");
}
at::Tensor attn_res_read(const std::vector<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                         double, const std::vector<at::Tensor>*) {
  no_cuda("attn_res_read");
}
void adamw_(at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, double, double, double,
            double, double, double, double, const at::Tensor&, double, const at::Tensor&) {
  no_cuda("adamw");
}
bool adamw_many_takes(const AdamWTensors&) { return false; }
void adamw_many_(const std::vector<AdamWTensors>& ts, double, double, double, double, double,
                 double, double, const at::Tensor&) {
  if (!ts.empty()) no_cuda("adamw_many");
}
bool clip_on_device_takes(const std::vector<at::Tensor>&) { return false; }
DeviceClip clip_on_device(const std::vector<at::Tensor>&, double, const std::vector<at::Tensor>&) {
  no_cuda("clip_on_device");
}
std::function<std::vector<double>()> fetch_clip_values(const DeviceClip&) {
  no_cuda("fetch_clip_values");
}

bool layer_norm_usable(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  return false;
}
std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, const at::Tensor&, double) {
  no_cuda("add_layer_norm");
}
at::Tensor layer_norm(const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  no_cuda("layer_norm");
}
bool moe_router_usable(const at::Tensor&, const at::Tensor&) { return false; }
std::vector<at::Tensor> moe_router(const at::Tensor&, const at::Tensor&, int64_t) {
  no_cuda("moe_router");
}
bool moe_permute_usable(const at::Tensor&) { return false; }
at::Tensor moe_permute(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  no_cuda("moe_permute");
}
at::Tensor moe_combine(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&) {
  no_cuda("moe_combine");
}
bool moe_topk_usable(const at::Tensor&, int64_t) { return false; }
bool moe_dispatch_usable(const at::Tensor&, int64_t) { return false; }
at::Tensor moe_topk(const at::Tensor&, const at::Tensor&, int64_t) { no_cuda("moe_topk"); }
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_dispatch(const at::Tensor&,
                                                                        int64_t, int64_t) {
  no_cuda("moe_dispatch");
}

bool kda_decay_usable(const at::Tensor&, const at::Tensor&, const at::Tensor&) { return false; }
at::Tensor kda_decay(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  no_cuda("kda_decay");
}
bool gated_rms_norm_usable(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  return false;
}
at::Tensor gated_rms_norm(const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  no_cuda("gated_rms_norm");
}

bool kda_usable(const at::Tensor&, const at::Tensor&) { return false; }
std::pair<at::Tensor, at::Tensor> kda_chunk(const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, const at::Tensor&,
                                            const KdaDocumentChunks*) {
  no_cuda("kda_chunk");
}

}  // namespace viaduct::kernels
