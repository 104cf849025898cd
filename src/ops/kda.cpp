// Kimi Delta Attention's recurrence (see ops/kda.h): the chunked ATen
// form, the step-by-step form it is checked against, and the op that runs
// viaduct's kernels where they take the shape.
#include "ops/kda.h"

#include <algorithm>
#include <limits>

#include "core/check.h"
#include "kernels/fused.h"
#include "ops/recompute.h"

namespace viaduct::ops {
namespace {

// The precision the recurrence runs in: fp64 stays fp64, all else is fp32.
at::ScalarType inner_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// [B, T, H, d] -> [B, H, T, d] in the inner type.
at::Tensor heads_first(const at::Tensor& x, at::ScalarType st) {
  return x.to(st).transpose(1, 2);
}

// Note [KDA decayed products in sub-chunks]
// The chunked form needs, per
// chunk, A[c, j] = sum_d x_c,d y_j,d exp(G_c,d - G_j,d) for j <= c (j < c:
// strict), G the in-chunk cumulative log-decay (non-increasing). Built as
// one [C, C, d] tensor of exp(G_c - G_j) it costs C * d per token (and as
// much again saved for the backward): 4.3 GB a layer at 4 x 2048 tokens, 32
// heads of 64, C = 64. Split the chunk into sub-chunks of S rows: for c in
// sub-chunk p and j before it, with R = G at p's first row,
// exp(G_c - G_j) = exp(G_c - R) exp(R - G_j), both factors in (0, 1] (G
// falls: c >= p S > j), so the block is one matmul of the rescaled rows and
// neither factor can overflow (a factor that underflows to 0 bounds the
// true product by the same underflow). Only the S x S diagonal blocks keep
// the explicit [S, S, d] form (masked before exp, as before): C / S times
// less of it. Same sums in another order: the results agree to rounding.
at::Tensor decayed_products(const at::Tensor& x, const at::Tensor& y, const at::Tensor& G,
                            int64_t S, bool strict) {
  const auto B = x.size(0), H = x.size(1), N = x.size(2), C = x.size(3), d = x.size(4);
  const auto P = C / S;
  auto sub = [&](const at::Tensor& t) { return t.reshape({B, H, N, P, S, d}); };
  auto Gs = sub(G);
  auto keep = at::ones({S, S}, at::TensorOptions().dtype(at::kBool).device(x.device()))
                  .tril(strict ? -1 : 0);
  auto decay = (Gs.unsqueeze(-2) - Gs.unsqueeze(-3))  // [.., P, S, S, d]: G_c - G_j
                   .masked_fill(keep.logical_not().unsqueeze(-1),
                                -std::numeric_limits<double>::infinity())
                   .exp();
  auto diag = (sub(x).unsqueeze(-2) * sub(y).unsqueeze(-3) * decay).sum(-1);  // [.., P, S, S]
  if (P == 1) return diag.reshape({B, H, N, C, C});
  std::vector<at::Tensor> rows;
  rows.reserve(static_cast<size_t>(P));
  for (int64_t p = 0; p < P; ++p) {
    std::vector<at::Tensor> parts;
    if (p > 0) {
      auto R = G.narrow(3, p * S, 1);                                    // [.., 1, d]
      auto xp = x.narrow(3, p * S, S) * (G.narrow(3, p * S, S) - R).exp();  // [.., S, d]
      auto yp = y.narrow(3, 0, p * S) * (R - G.narrow(3, 0, p * S)).exp();  // [.., pS, d]
      parts.push_back(at::matmul(xp, yp.transpose(-1, -2)));          // [.., S, pS]
    }
    parts.push_back(diag.select(3, p));
    if (p + 1 < P) parts.push_back(at::zeros({B, H, N, S, C - (p + 1) * S}, diag.options()));
    rows.push_back(at::cat(parts, -1));
  }
  return at::cat(rows, -2);  // [B, H, N, C, C]
}

// The sub-chunk of see Note [KDA decayed products in sub-chunks]: 16 rows where
// they divide the chunk, else the chunk itself.
int64_t sub_chunk(int64_t C) { return C > 16 && C % 16 == 0 ? 16 : C; }

// Note [KDA chunk scan as one autograd node]
// The scan over chunks is
// serial, N = T / C steps a layer (128 at 2048 tokens, C = 16). Written as
// ATen ops under autograd, every step recorded ~13 nodes, and every
// `select` of a chunk from the [B, H, N, ...] inputs had a backward that
// writes a zero tensor of the whole input with one chunk filled in, which
// the engine then adds into the input's gradient: per input, N full-size
// fills and N full-size adds, O(N^2 C) traffic a layer. Here the scan is one
// node. The forward runs the same ops without recording and keeps the
// state S_n before each chunk and each chunk's v'_n (what the recorded
// matmuls kept anyway). The backward walks the chunks in reverse:
//   v'_n   = U_n - W_n S_n
//   o_n    = qe_n S_n + Aqk_n v'_n
//   S_n+1  = d_n * S_n + Ke_n^T v'_n        (d_n: [dk, 1], per key channel)
// gives, with dS_N = 0,
//   dv'_n  = Aqk_n^T do_n + Ke_n dS_n+1
//   dAqk_n = do_n v'_n^T,  dqe_n = do_n S_n^T,  dKe_n = v'_n dS_n+1^T
//   dd_n   = rowsum(dS_n+1 * S_n),  dU_n = dv'_n,  dW_n = -dv'_n S_n^T
//   dS_n   = d_n * dS_n+1 + qe_n^T do_n - W_n^T dv'_n
// and each input's gradient is one stack of its N chunk gradients, so the
// backward's cost grows with the chunk count rather than its square.

// For chunk n of a scan with restarts (N x B H flags, chunk-major, on the
// host, and `keep`, 1 - the flags as [N, B H, 1, 1] in the state's type on
// its device, made once a call): 0 for the rows that restart, 1 for the
// rest; undefined when none restarts there. A state times 0 or 1 is
// exactly zero or itself.
at::Tensor kept_rows(const std::vector<int64_t>& restarts, const at::Tensor& keep, int64_t n) {
  if (restarts.empty()) return {};
  const int64_t rows = keep.size(1);
  const auto first = restarts.begin() + n * rows;
  if (std::find(first, first + rows, 1) == first + rows) return {};
  return keep[n];
}

// Chunk n of x [B, H, N, r, c] as [B H, r, c] (a view: the scan's inputs
// are contiguous over B and H, or narrowed in the last dimension only).
at::Tensor chunk_of(const at::Tensor& x, int64_t n) {
  return x.select(2, n).reshape({-1, x.size(-2), x.size(-1)});
}

// The scan's forward: U, W, qe, Aqk, Ke: [B, H, N, C, *]; d: [B, H, N, dk,
// 1]; S0: the state before the first chunk [B H, dk, dv]; returns o:
// [B, H, N, C, dv]. The chunk's products run as batched
// GEMMs over B H with the additions folded in (baddbmm): 5 launches a chunk.
// With `states` and `vnew` it keeps S_n and v'_n for ChunkScanFn's
// backward.
//
// `restarts` (empty, or N x B H flags, chunk-major): the state of a
// flagged (chunk, row and head) is zero as the chunk starts (a document's
// first chunk, see Note [Packed documents]).
at::Tensor chunk_scan(const at::Tensor& U, const at::Tensor& W, const at::Tensor& qe,
                      const at::Tensor& Aqk, const at::Tensor& Ke, const at::Tensor& d,
                      const at::Tensor& S0, const std::vector<int64_t>& restarts,
                      const at::Tensor& keep, std::vector<at::Tensor>* states = nullptr,
                      std::vector<at::Tensor>* vnew = nullptr) {
  const auto B = U.size(0), H = U.size(1), N = U.size(2), dv = U.size(-1);
  auto S = S0;
  std::vector<at::Tensor> outs;
  outs.reserve(N);
  for (int64_t n = 0; n < N; ++n) {
    if (auto kept = kept_rows(restarts, keep, n); kept.defined()) S = S * kept;
    auto v_n = at::baddbmm(chunk_of(U, n), chunk_of(W, n), S, 1, -1);  // [BH, C, dv]
    outs.push_back(at::baddbmm(at::bmm(chunk_of(qe, n), S), chunk_of(Aqk, n), v_n));
    if (states) states->push_back(S);
    S = at::baddbmm(chunk_of(d, n) * S, chunk_of(Ke, n).transpose(1, 2), v_n);
    if (vnew) vnew->push_back(std::move(v_n));
  }
  return at::stack(outs, 1).view({B, H, N, -1, dv});
}

class ChunkScanFn : public torch::autograd::Function<ChunkScanFn> {
 public:
  // chunk_scan's inputs and output; the backward takes 11 launches a chunk.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& U,
                            const at::Tensor& W, const at::Tensor& qe, const at::Tensor& Aqk,
                            const at::Tensor& Ke, const at::Tensor& d, const at::Tensor& S0,
                            const std::vector<int64_t>& restarts, const at::Tensor& keep) {
    // See Note [Per-op activation checkpointing]: the scan's output and the
    // states and v' its backward reads are what a replay takes back.
    const auto N = static_cast<size_t>(U.size(2));
    auto kept = run_saved_op_outputs([&] {
      std::vector<at::Tensor> states, vnew;
      std::vector<at::Tensor> all{chunk_scan(U, W, qe, Aqk, Ke, d, S0, restarts, keep, &states, &vnew)};
      all.insert(all.end(), states.begin(), states.end());
      all.insert(all.end(), vnew.begin(), vnew.end());
      return all;
    });
    VIADUCT_CHECK(kept.size() == 1 + 2 * N, "KDA chunk scan: ", kept.size(),
                  " saved tensors for ", N, " chunks");
    auto o = kept[0];
    std::vector<at::Tensor> states(kept.begin() + 1, kept.begin() + 1 + N);
    std::vector<at::Tensor> vnew(kept.begin() + 1 + N, kept.end());
    ctx->save_for_backward({U, W, qe, Aqk, Ke, d});
    ctx->saved_data["states"] = states;
    ctx->saved_data["vnew"] = vnew;
    ctx->saved_data["restarts"] = restarts;
    ctx->saved_data["keep"] = keep;
    return o;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &U = saved[0], &W = saved[1], &qe = saved[2], &Aqk = saved[3], &Ke = saved[4],
               &d = saved[5];
    const auto states = ctx->saved_data["states"].toTensorVector();
    const auto vnew = ctx->saved_data["vnew"].toTensorVector();
    const auto restarts = ctx->saved_data["restarts"].toIntVector();
    const auto keep = ctx->saved_data["keep"].toTensor();
    const auto N = static_cast<int64_t>(states.size());
    const auto& dO = grads[0];  // [B, H, N, C, dv]
    std::vector<at::Tensor> dU(N), dW(N), dqe(N), dAqk(N), dKe(N), dd(N);
    auto dS = at::zeros_like(states[0]);  // dS_N: nothing follows the last chunk
    for (int64_t n = N - 1; n >= 0; --n) {
      const auto& S = states[n];
      const auto& v_n = vnew[n];
      auto do_n = chunk_of(dO, n);
      auto dv_n = at::baddbmm(at::bmm(chunk_of(Aqk, n).transpose(1, 2), do_n), chunk_of(Ke, n), dS);
      dAqk[n] = at::bmm(do_n, v_n.transpose(1, 2));
      dqe[n] = at::bmm(do_n, S.transpose(1, 2));
      dKe[n] = at::bmm(v_n, dS.transpose(1, 2));
      dd[n] = (dS * S).sum(-1, /*keepdim=*/true);
      dW[n] = at::bmm(dv_n, S.transpose(1, 2));  // negated once, below
      dS = at::baddbmm(at::baddbmm(chunk_of(d, n) * dS, chunk_of(qe, n).transpose(1, 2), do_n),
                       chunk_of(W, n).transpose(1, 2), dv_n, 1, -1);
      dU[n] = std::move(dv_n);
      // A restarted chunk's state is zero, not the previous chunk's result.
      if (auto kept = kept_rows(restarts, keep, n); kept.defined()) dS = dS * kept;
    }
    // Each input's N chunk gradients, stacked into its [B, H, N, ...] shape.
    auto whole = [&](const std::vector<at::Tensor>& g, const at::Tensor& like) {
      return at::stack(g, 1).view(like.sizes());
    };
    return {whole(dU, U), whole(dW, W).neg_(), whole(dqe, qe),
            whole(dAqk, Aqk), whole(dKe, Ke), whole(dd, d), dS, at::Tensor(), at::Tensor()};
  }

};

}  // namespace

at::Tensor kda_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& g, const at::Tensor& beta,
                         const at::Tensor& initial_state) {
  const auto st = inner_type(q);
  auto qh = heads_first(q, st), kh = heads_first(k, st);  // [B, H, T, dk]
  auto vh = heads_first(v, st), gh = heads_first(g, st);  // [B, H, T, dv|dk]
  auto bh = beta.to(st).transpose(1, 2);                  // [B, H, T]
  const auto B = qh.size(0), H = qh.size(1), T = qh.size(2);
  const auto dk = qh.size(3), dv = vh.size(3);
  auto S = initial_state.defined() ? initial_state.to(st)
                                   : at::zeros({B, H, dk, dv}, qh.options());
  std::vector<at::Tensor> outs;
  outs.reserve(T);
  for (int64_t t = 0; t < T; ++t) {
    auto kt = kh.select(2, t);                                 // [B, H, dk]
    S = S * gh.select(2, t).exp().unsqueeze(-1);               // decay keys
    auto kS = at::matmul(kt.unsqueeze(-2), S).squeeze(-2);     // [B, H, dv]
    auto delta = (vh.select(2, t) - kS) * bh.select(2, t).unsqueeze(-1);
    S = S + kt.unsqueeze(-1) * delta.unsqueeze(-2);            // rank-1 update
    outs.push_back(
        at::matmul(qh.select(2, t).unsqueeze(-2), S).squeeze(-2));
  }
  return at::stack(outs, 2).transpose(1, 2);  // [B, T, H, dv]
}

at::Tensor kda_chunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& g, const at::Tensor& beta, int64_t chunk_size,
                       const at::Tensor& initial_state, const at::Tensor& chunk_starts) {
  VIADUCT_CHECK(chunk_size > 0, "model.kda_chunk_size must be > 0, got ",
                chunk_size);
  const auto st = inner_type(q);
  const auto B = q.size(0), T = q.size(1), H = q.size(2);
  const auto dk = q.size(3), dv = v.size(3);
  const auto C = chunk_size;
  const auto pad = (C - T % C) % C;
  const auto N = (T + pad) / C;
  // Zero-padded steps sit after every real step (beta = 0, g = 0: they leave
  // the state and every earlier output alone); their outputs are dropped.
  auto prep = [&](const at::Tensor& x) {
    auto h = heads_first(x, st);  // [B, H, T, d]
    if (pad) h = at::constant_pad_nd(h, {0, 0, 0, pad});
    return h.reshape({B, H, N, C, h.size(-1)});  // [B, H, N, C, d]
  };
  auto qc = prep(q), kc = prep(k), vc = prep(v), gc = prep(g);
  auto bc = beta.to(st).transpose(1, 2);  // [B, H, T]
  if (pad) bc = at::constant_pad_nd(bc, {0, pad});
  bc = bc.reshape({B, H, N, C});

  auto G = gc.cumsum(-2);  // inclusive cumulative log-decay in the chunk
  const auto sub = sub_chunk(C);
  // Aqk[c, j] = sum_d q_c k_j e^{G_c - G_j}, j <= c: [B, H, N, C, C]
  auto Aqk = decayed_products(qc, kc, G, sub, /*strict=*/false);
  // L[c, j] = beta_c sum_d k_c k_j e^{G_c - G_j}, j < c (strictly lower).
  auto Lm = decayed_products(kc, kc, G, sub, /*strict=*/true) * bc.unsqueeze(-1);
  auto eye = at::eye(C, qc.options());
  auto eG = G.exp();  // [B, H, N, C, dk], <= 1
  // (I + L) [W | U] = diag(beta) [e^G * K | V]  (unit lower triangular)
  auto rhs = at::cat({eG * kc, vc}, -1) * bc.unsqueeze(-1);
  auto WU = at::linalg_solve_triangular(Lm + eye, rhs, /*upper=*/false,
                                        /*left=*/true, /*unitriangular=*/true);
  auto W = WU.narrow(-1, 0, dk);   // [B, H, N, C, dk]
  auto U = WU.narrow(-1, dk, dv);  // [B, H, N, C, dv]
  auto qe = qc * eG;                                   // [B, H, N, C, dk]
  auto G_last = G.narrow(-2, C - 1, 1);                // [B, H, N, 1, dk]
  auto k_to_end = kc * (G_last - G).exp();             // [B, H, N, C, dk]
  auto decay_chunk = G_last.exp().transpose(-1, -2);   // [B, H, N, dk, 1]

  // The serial scan over chunks (see Note [KDA chunk scan as one autograd node]).
  auto S0 = initial_state.defined()
                ? initial_state.to(st).reshape({B * H, dk, dv})
                : at::zeros({B * H, dk, dv}, qc.options());
  std::vector<int64_t> restarts;  // N x B H, chunk-major (the scan's order)
  // Empty without restarts (an autograd function's tensor inputs must be
  // defined).
  at::Tensor keep = at::empty({0}, S0.options());
  if (chunk_starts.defined()) {
    VIADUCT_CHECK(chunk_starts.dim() == 2 && chunk_starts.size(0) == B &&
                      chunk_starts.size(1) == N,
                  "KDA chunk starts: ", chunk_starts.sizes(), " for ", B, " x ", N, " chunks");
    const auto flags = chunk_starts.to(at::kCPU, at::kLong)
                           .t()
                           .unsqueeze(-1)
                           .expand({N, B, H})
                           .contiguous();
    restarts.assign(flags.data_ptr<int64_t>(), flags.data_ptr<int64_t>() + flags.numel());
    // Made once a call from the flags, on the state's device.
    keep = (1 - chunk_starts.to(S0.device(), S0.scalar_type()))
               .t()
               .unsqueeze(-1)
               .expand({N, B, H})
               .reshape({N, B * H, 1, 1});
  }
  auto o = ChunkScanFn::apply(U, W, qe, Aqk, k_to_end, decay_chunk, S0, restarts, keep)
               .reshape({B, H, N * C, dv})
               .narrow(2, 0, T);
  return o.transpose(1, 2);  // [B, T, H, dv]
}

at::Tensor kda_decay(const at::Tensor& f, const at::Tensor& dt_bias, const at::Tensor& A_log,
                     const KernelOptions& opts) {
  if (fused_runs(f, opts) && kernels::kda_decay_usable(f, dt_bias, A_log)) {
    return kernels::kda_decay(f, dt_bias, A_log);
  }
  const auto st = inner_type(f);
  const auto H = A_log.size(0);
  auto heads = f.sizes().vec();
  heads.back() = H;
  heads.push_back(f.size(-1) / H);
  std::vector<int64_t> per_head(heads.size(), 1);
  per_head[per_head.size() - 2] = H;
  auto z = f.to(st) + dt_bias.to(st);
  return -(A_log.to(st).exp().view(per_head)) * at::softplus(z.view(heads));
}

namespace {

// Whether viaduct's kernels take the recurrence: fp32 inputs on a device
// they were built for, their chunk, and a head width they have.
bool kernels_take(const at::Tensor& q, const at::Tensor& v, int64_t chunk_size,
                  const KernelOptions& opts) {
  return chunk_size == kernels::kKdaKernelChunk && fused_runs(q, opts) &&
         q.scalar_type() == at::kFloat && kernels::kda_usable(q, v);
}

}  // namespace

at::Tensor kda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
               const at::Tensor& beta, int64_t chunk_size, const KernelOptions& opts,
               const at::Tensor& initial_state, const Documents* documents) {
  const bool on_kernels = kernels_take(q, v, chunk_size, opts);
  if (documents == nullptr) {
    return on_kernels ? kernels::kda_chunk(q, k, v, g, beta, initial_state).first
                      : kda_chunked(q, k, v, g, beta, chunk_size, initial_state);
  }
  VIADUCT_CHECK(!initial_state.defined(),
                "KDA over documents starts each from zero; an initial state has no document");
  VIADUCT_CHECK(documents->rows() == q.size(0) && documents->seq_len() == q.size(1),
                "KDA over documents of [", documents->rows(), ", ", documents->seq_len(),
                "] tokens, but q is ", q.sizes());
  if (on_kernels) {
    // The chunks over the documents in place (see Note [KDA chunks over documents]).
    const auto& chunks = documents->kda_chunks(chunk_size, q.size(2), q.device());
    return kernels::kda_chunk(q, k, v, g, beta, {}, &chunks).first;
  }
  // Each row's spans on chunk boundaries, the state restarted at each
  // (see Note [Packed documents]).
  const auto& p = documents->packed(chunk_size, 0, q.device());
  auto o = kda_chunked(pack_spans(q, p), pack_spans(k, p), pack_spans(v, p), pack_spans(g, p),
                       pack_spans(beta, p), chunk_size, {}, p.chunk_starts);
  return unpack_spans(o, p, q.size(0), q.size(1));
}

}  // namespace viaduct::ops
