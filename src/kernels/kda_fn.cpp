// The chunked gated delta rule on viaduct's kernels, as one autograd node
// (CUDA build). The kernels (kernels/kda.cu) do the per-chunk work no GEMM
// does and the serial state passes; the products that are batched GEMMs
// over the chunks run here through cuda::kda_gemm (fp32 accuracy on the
// tensor cores):
//   forward:  [W | U] = Tm R, o = qe S + Aqk v'
//   backward: X = Aqk^T do, Y = qe^T do (into the state pass), dqe = do S^T,
//             dke = v' dS^T, dAqk = do v'^T, d[W | U] = [-dv' S^T | dv'],
//             dR = Tm^T d[W | U], dM = dR [W | U]^T
// (the state pass itself writes dv' into d[W | U] and the parts of ddec).
// (S, dS: the state and its gradient at each chunk's start and end).
#include "kernels/fused.h"

#include "kernels/fn_common.h"
#include "kernels/kda.h"

namespace viaduct::kernels {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const float* ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }
float* mut(at::Tensor& t) { return t.data_ptr<float>(); }
const uint8_t* flags(const at::Tensor& t) { return t.defined() ? t.data_ptr<uint8_t>() : nullptr; }

// A 0-size stand-in (an autograd function takes no undefined tensors on
// LibTorch 2.x) as undefined.
at::Tensor given(const at::Tensor& t) { return t.numel() ? t.contiguous() : at::Tensor(); }

// q's shape, and with `spans` ([B, N, 2] int32, see KdaShape) the chunk table.
cuda::KdaShape shape_of(const at::Tensor& q, const at::Tensor& spans) {
  cuda::KdaShape s{q.size(0), q.size(1), q.size(2), q.size(3)};
  if (spans.defined()) {
    s.spans = spans.data_ptr<int32_t>();
    s.N = spans.size(1);
  }
  return s;
}

// [B, T, H, D] (fp32, contiguous) -> the chunk layout [Z, C, D]: rows
// past T zero, or with documents the chunk rows `read` gives (zeros where
// it is -1), in one gather.
at::Tensor to_chunks(const at::Tensor& x, const cuda::KdaShape& s, const at::Tensor& read,
                     cudaStream_t stream) {
  const auto C = cuda::kKdaChunk, N = s.chunks();
  if (read.defined()) {
    auto rows = at::empty({s.Z(), C, s.D}, x.options());
    check_launch(cuda::kda_gather_rows(ptr(x), read.data_ptr<int64_t>(), s.Z() * C, s.D,
                                       mut(rows), stream),
                 "kda_gather_rows");
    return rows;
  }
  auto p = x;
  if (N * C > s.T) p = at::constant_pad_nd(x, {0, 0, 0, 0, 0, N * C - s.T});
  return p.view({s.B, N, C, s.H, s.D}).permute({0, 3, 1, 2, 4}).reshape({s.Z(), C, s.D});
}

// The chunk layout [Z, C, D] or [Z, C] (a per-head value) back to [B, T,
// H, w] (w = D or 1): the plain chunks' first T rows, or with documents
// each (token, head)'s row at `places`.
at::Tensor from_chunks(const at::Tensor& x, const cuda::KdaShape& s, const at::Tensor& places) {
  const auto C = cuda::kKdaChunk, N = s.chunks();
  const auto w = x.dim() == 3 ? x.size(2) : 1;
  if (places.defined()) {
    return x.reshape({s.Z() * C, w}).index_select(0, places).view({s.B, s.T, s.H, w});
  }
  return x.reshape({s.B, s.H, N * C, w}).narrow(2, 0, s.T).transpose(1, 2).contiguous();
}

// An fp32 [Z, rows, cols] view as a kda_gemm operand.
cuda::KdaOperand operand(const at::Tensor& x) {
  return {ptr(x), x.stride(0), x.stride(1), x.stride(2)};
}

// The product a b over the chunks (see KdaGemm): a [Z, M, K] and b [Z, K,
// N] fp32 views with a unit stride in one of their last two dims (a tensor
// or its transpose); the caller says where C goes.
cuda::KdaGemm chunk_product(const at::Tensor& a, const at::Tensor& b, float alpha, float beta) {
  cuda::KdaGemm g;
  g.batch = a.size(0);
  g.M = a.size(1);
  g.K = a.size(2);
  g.N = b.size(2);
  g.A = operand(a);
  g.B = operand(b);
  g.alpha = alpha;
  g.beta = beta;
  return g;
}

// out = alpha a b + beta out for each chunk z, out [Z, M, N] with
// contiguous rows.
void chunk_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, float alpha,
                float beta, cudaStream_t stream) {
  auto g = chunk_product(a, b, alpha, beta);
  g.C = mut(out);
  g.c_batch = out.stride(0);
  g.c_row = out.stride(1);
  check_launch(cuda::kda_gemm(g, stream), "kda_gemm");
}

// out [B, T, H, w] (fp32, contiguous) = alpha a b + beta out, the product's
// chunk rows written at the (token, head) rows they hold (see KdaGemm);
// a [Z, C, K], b [Z, K, w].
void chunk_gemm_to_tokens(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                          const cuda::KdaShape& s, float alpha, float beta,
                          cudaStream_t stream) {
  auto g = chunk_product(a, b, alpha, beta);
  g.C = mut(out);
  g.c_row = out.size(3);
  g.to_tokens = true;
  g.tokens = s;
  check_launch(cuda::kda_gemm(g, stream), "kda_gemm");
}

at::Tensor chunk_mm(const at::Tensor& a, const at::Tensor& b, cudaStream_t stream) {
  auto out = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  chunk_gemm(out, a, b, 1.f, 0.f, stream);
  return out;
}

class KdaChunkFn : public torch::autograd::Function<KdaChunkFn> {
 public:
  // S0: [B, H, D, D], or a 0-size stand-in for a zero state (custom
  // functions take no undefined inputs on LibTorch 2.x); the document
  // chunks' tensors (KdaDocumentChunks), or 0-size stand-ins for the plain
  // chunks; only q, k, v, g, beta and S0 are differentiable. v is fp32 or
  // bf16, all else fp32.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q_in,
                               const at::Tensor& k_in, const at::Tensor& v_in,
                               const at::Tensor& g_in, const at::Tensor& beta_in,
                               const at::Tensor& S0_in, const at::Tensor& spans_in,
                               const at::Tensor& restarts_in, const at::Tensor& places_in,
                               const at::Tensor& read_in) {
    auto q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
    auto g = g_in.contiguous(), beta = beta_in.contiguous();
    auto S0 = given(S0_in);
    auto spans = given(spans_in), restarts = given(restarts_in);
    const auto s = shape_of(q, spans);
    const auto C = cuda::kKdaChunk, Z = s.Z(), D = s.D;
    const auto opt = q.options();
    auto Aqk = at::empty({Z, C, C}, opt), Kp = at::empty({Z, C, C}, opt);
    auto Tm = at::empty({Z, C, C}, opt), R = at::empty({Z, C, 2 * D}, opt);
    auto qe = at::empty({Z, C, D}, opt), ke = at::empty({Z, C, D}, opt);
    auto dec = at::empty({Z, D}, opt);
    const auto stream = stream_of(q);
    check_launch(cuda::kda_intra_forward(s, ptr(q), ptr(k), v.data_ptr(), dtype_of(v), ptr(g),
                                         ptr(beta), mut(Aqk), mut(Kp), mut(Tm), mut(R), mut(qe),
                                         mut(ke), mut(dec), stream),
                 "kda_intra_forward");
    auto WU = chunk_mm(Tm, R, stream);
    R.reset();
    auto vnew = at::empty({Z, C, D}, opt);
    auto states = at::empty({Z, D, D}, opt);
    auto final_state = at::empty({s.B, s.H, D, D}, opt);
    check_launch(cuda::kda_scan_forward(s, ptr(WU), ptr(ke), ptr(dec), ptr(S0), flags(restarts),
                                        mut(vnew), mut(states), mut(final_state), stream),
                 "kda_scan_forward");
    // o = qe S + Aqk v', written in the token layout (each (token, head)
    // lies in exactly one chunk row, so every row of o is written).
    auto o = at::empty({s.B, s.T, s.H, D}, opt);
    chunk_gemm_to_tokens(o, qe, states, s, 1.f, 0.f, stream);
    chunk_gemm_to_tokens(o, Aqk, vnew, s, 1.f, 1.f, stream);
    ctx->save_for_backward({q, k, v, g, beta, Kp, Tm, WU, qe, ke, dec, Aqk, vnew, states});
    ctx->saved_data["has_S0"] = S0.defined();
    ctx->saved_data["spans"] = spans_in;
    ctx->saved_data["restarts"] = restarts_in;
    ctx->saved_data["places"] = places_in;
    ctx->saved_data["read"] = read_in;
    return {o, final_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &g = saved[3], &beta = saved[4];
    const auto &Kp = saved[5], &Tm = saved[6], &WU = saved[7], &qe = saved[8], &ke = saved[9];
    const auto &dec = saved[10], &Aqk = saved[11], &vnew = saved[12], &states = saved[13];
    const auto spans = given(ctx->saved_data["spans"].toTensor());
    const auto restarts = given(ctx->saved_data["restarts"].toTensor());
    const auto places = given(ctx->saved_data["places"].toTensor());
    const auto read = given(ctx->saved_data["read"].toTensor());
    const auto s = shape_of(q, spans);
    const auto C = cuda::kKdaChunk, Z = s.Z(), D = s.D;
    const auto opt = q.options();
    // do in the chunk layout: as its consumer wrote it (see
    // kda_output_grad_rows), else gathered there.
    const auto chunk_rows = s.chunks() * C;
    const auto& g0 = grads[0];
    const bool in_chunks = s.spans == nullptr && g0.defined() &&
                           g0.scalar_type() == at::kFloat && g0.dim() == 4 &&
                           g0.sizes() == q.sizes() &&
                           g0.strides() == at::IntArrayRef({s.H * chunk_rows * D, D,
                                                            chunk_rows * D, 1});
    auto dSN = grads[1].defined() ? grads[1].contiguous().to(at::kFloat) : at::Tensor();
    auto dstates = at::empty({Z, D, D}, opt);
    auto dS0 = at::empty({s.B, s.H, D, D}, opt);
    // d[W | U] = [-dv' S^T | dv']: the state pass writes dv' into the U half.
    auto dWU = at::empty({Z, C, 2 * D}, opt);
    auto ddec_part = at::empty({Z, D, cuda::kda_ddec_parts(D)}, opt);
    const auto stream = stream_of(q);
    at::Tensor do_z;
    if (in_chunks) {
      do_z = g0.as_strided({Z, C, D}, {C * D, D, 1}, g0.storage_offset());
    } else {
      const auto dO = g0.defined() ? g0.contiguous().to(at::kFloat)
                                   : at::zeros({s.B, s.T, s.H, D}, opt);
      do_z = to_chunks(dO, s, read, stream);
    }
    auto X = chunk_mm(Aqk.transpose(1, 2), do_z, stream);
    auto Y = chunk_mm(qe.transpose(1, 2), do_z, stream);
    check_launch(cuda::kda_scan_backward(s, ptr(WU), ptr(ke), ptr(dec), ptr(X), ptr(Y), ptr(dSN),
                                         flags(restarts), ptr(states), mut(dWU) + D, 2 * D,
                                         mut(dstates), mut(dS0), mut(ddec_part), stream),
                 "kda_scan_backward");
    X.reset();
    Y.reset();
    auto St = states.transpose(1, 2);
    auto dvnew = dWU.narrow(-1, D, D);
    auto dqe = chunk_mm(do_z, St, stream);
    auto dke = chunk_mm(vnew, dstates.transpose(1, 2), stream);
    auto dAqk = chunk_mm(do_z, vnew.transpose(1, 2), stream);
    auto ddec = ddec_part.sum(-1);
    auto dW = dWU.narrow(-1, 0, D);
    chunk_gemm(dW, dvnew, St, -1.f, 0.f, stream);
    auto dR = chunk_mm(Tm.transpose(1, 2), dWU, stream);
    auto dM = chunk_mm(dR, WU.transpose(1, 2), stream);
    auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    auto dg = at::empty_like(g);
    auto dbeta_part = at::empty({cuda::kda_beta_slices(D), Z, C}, opt);
    check_launch(cuda::kda_intra_backward(s, ptr(q), ptr(k), v.data_ptr(), dtype_of(v), ptr(g),
                                          ptr(beta), ptr(Kp), ptr(dAqk), ptr(dM), ptr(dR),
                                          ptr(dqe), ptr(dke), ptr(ddec), mut(dq), mut(dk),
                                          dv.data_ptr(), mut(dg), mut(dbeta_part), stream),
                 "kda_intra_backward");
    // [slices, Z, C] -> [B, T, H]
    auto dbeta = from_chunks(dbeta_part.sum(0), s, places).view({s.B, s.T, s.H});
    const bool has_S0 = ctx->saved_data["has_S0"].toBool();
    return {dq, dk, dv, dg, dbeta, has_S0 ? dS0 : at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

}  // namespace

int64_t kda_output_grad_rows(const at::Tensor& o) {
  using Node = torch::autograd::CppNode<KdaChunkFn>;
  const auto node = std::dynamic_pointer_cast<Node>(o.grad_fn());
  if (!node || o.output_nr() != 0 || o.dim() != 4) return 0;
  // The document chunks scatter a head's tokens by a table: no [B, T, H,
  // D] view holds that layout.
  if (node->ctx_.saved_data["spans"].toTensor().numel() != 0) return 0;
  return shape_of(o, at::Tensor()).chunks() * cuda::kKdaChunk;
}

bool kda_usable(const at::Tensor& q, const at::Tensor& v) {
  return usable(q) && q.dim() == 4 && v.dim() == 4 && q.size(3) == v.size(3) &&
         cuda::kda_supported(q.size(3));
}

std::pair<at::Tensor, at::Tensor> kda_chunk(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& g,
                                            const at::Tensor& beta,
                                            const at::Tensor& initial_state,
                                            const KdaDocumentChunks* documents) {
  RECORD_FUNCTION("viaduct::kda_chunk", std::vector<c10::IValue>());  // named in profiles
  VIADUCT_CHECK(kda_usable(q, v) && q.sizes() == k.sizes() && q.sizes() == v.sizes() &&
                    q.sizes() == g.sizes() && beta.dim() == 3 &&
                    beta.size(0) == q.size(0) && beta.size(1) == q.size(1) &&
                    beta.size(2) == q.size(2),
                "kda_chunk: q, k, v, g must be [B, T, H, D] with D of 64 or 128 and beta "
                "[B, T, H], got q ",
                q.sizes(), ", v ", v.sizes(), ", beta ", beta.sizes());
  auto f = [](const at::Tensor& t) { return t.to(at::kFloat); };
  // v is taken in bf16 as it is (the kernels read it and write its
  // gradient in its type): no fp32 copy each way.
  const auto fv = v.scalar_type() == at::kBFloat16 ? v : f(v);
  at::Tensor S0 = initial_state.defined() ? f(initial_state)
                                          : at::empty({0}, q.options().dtype(at::kFloat));
  if (documents == nullptr) {
    const auto none = at::empty({0}, q.options().dtype(at::kLong));
    auto out = KdaChunkFn::apply(f(q), f(k), fv, f(g), f(beta), S0, none, none, none, none);
    return {out[0], out[1]};
  }
  const auto& d = *documents;
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2);
  VIADUCT_CHECK(!initial_state.defined(),
                "kda_chunk: documents start from a zero state; an initial state has no document");
  auto on_q = [&](const at::Tensor& t, at::ScalarType st) {
    return t.defined() && t.device() == q.device() && t.scalar_type() == st;
  };
  VIADUCT_CHECK(on_q(d.spans, at::kInt) && d.spans.dim() == 3 && d.spans.size(0) == B &&
                    d.spans.size(2) == 2 && on_q(d.restarts, at::kByte) &&
                    d.restarts.numel() == B * d.spans.size(1) && on_q(d.places, at::kLong) &&
                    d.places.numel() == B * T * H && on_q(d.read, at::kLong) &&
                    d.read.numel() == B * H * d.spans.size(1) * kKdaKernelChunk,
                "kda_chunk: document chunks made for another micro-batch: spans ",
                d.spans.sizes(), ", places ", d.places.sizes(), " for q ", q.sizes());
  auto out = KdaChunkFn::apply(f(q), f(k), fv, f(g), f(beta), S0, d.spans, d.restarts, d.places,
                               d.read);
  return {out[0], out[1]};
}

}  // namespace viaduct::kernels
