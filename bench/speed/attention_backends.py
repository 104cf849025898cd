#!/usr/bin/env python3
"""Causal attention's backends at the llama-1B shape, forward and backward.

    python3 bench/speed/attention_backends.py [--batch 4 --heads 32 --kv-heads 8
        --seq 4096 --head-dim 64 --layers 16 --reps 10]
    python3 bench/speed/attention_backends.py --batch 4 --heads 16 --kv-heads 16 \
        --seq 2048 --head-dim 192 --v-head-dim 128 --layers 9    # K3's MLA

Times, on random bf16 q, k, v [B, H, T, hd] (k and v repeated to H heads,
as viaduct's attention hands them over), the ATen ops each backend runs:

  flash    aten._scaled_dot_product_flash_attention and its _backward (what
           viaduct's CausalFlashFn calls, src/ops/rope.cpp)
  cudnn    aten._scaled_dot_product_cudnn_attention and its _backward
  sdpa     F.scaled_dot_product_attention with autograd: the backend
           PyTorch picks itself (named by torch._fused_sdp_choice)
  sdpa_gqa the same on un-repeated k, v (enable_gqa=True)
  flash_det       flash forward and backward under
                  torch.use_deterministic_algorithms(True) (what viaduct's
                  default, training.deterministic = true, runs)
  cudnn_flash_det cuDNN's forward (deterministic) with flash's deterministic
                  backward on cuDNN's output and log-sum-exp: whether the
                  two libraries' statistics agree, and what the mix saves
  cudnn_padded_flash_det  (--v-head-dim below --head-dim) the same with
                  cuDNN's forward on the zero-padded v, as viaduct's
                  deterministic MLA runs it (the row above: on v as it is)

The deterministic rows also say whether two calls gave the same bits.

Each row: forward ms and forward + backward ms per call (median of --reps
timed calls after 3 untimed, CUDA events), the same times --layers (one
step's attention), and the largest relative difference of out, dq, dk, dv
from the flash row. A row whose ops this torch lacks says so. With
--v-head-dim below --head-dim (MLA), flash's rows run on v and the output's
gradient zero-padded to the head dim, as viaduct's flash path does, and
keep the first v-head-dim channels of out and dv.
"""

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "lib"))
from cuda_timing import timed  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--v-head-dim", type=int, default=0, help="v's head dim (default: --head-dim)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    B, H, KV, T, hd = a.batch, a.heads, a.kv_heads, a.seq, a.head_dim
    vd = a.v_head_dim or hd
    g = torch.Generator(device="cuda").manual_seed(1234)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    q, go = rnd(B, H, T, hd), rnd(B, H, T, vd)
    k_kv, v_kv = rnd(B, KV, T, hd), rnd(B, KV, T, vd)
    k, v = k_kv.repeat_interleave(H // KV, 1), v_kv.repeat_interleave(H // KV, 1)
    aten = torch.ops.aten

    def pad(t):  # v-sized channels to the head dim, for flash
        return t if vd == hd else F.pad(t, (0, hd - vd))

    v_f, go_f = pad(v), pad(go)

    def cut(t):  # flash's v-sized results back to v's channels
        return t if vd == hd else t[..., :vd]

    def flash_fwd():
        return aten._scaled_dot_product_flash_attention(q, k, v_f, 0.0, True)

    def flash_both():
        r = flash_fwd()
        d = aten._scaled_dot_product_flash_attention_backward(
            go_f, q, k, v_f, r[0], r[1], r[2], r[3], T, T, 0.0, True, r[6], r[7])
        return cut(r[0]), d[0], d[1], cut(d[2])

    def cudnn_fwd():
        return aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)

    def cudnn_both():
        r = cudnn_fwd()
        d = aten._scaled_dot_product_cudnn_attention_backward(
            go, q, k, v, r[0], r[1], r[6], r[7], None, r[2], r[3], T, T, 0.0, True)
        return r[0], d[0], d[1], d[2]

    def sdpa_both(gqa):
        qq = q.detach().requires_grad_()
        kk = (k_kv if gqa else k).detach().requires_grad_()
        vv = (v_kv if gqa else v).detach().requires_grad_()
        kw = {"enable_gqa": True} if gqa else {}
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, **kw)
        out.backward(go)
        return out, qq.grad, kk.grad, vv.grad

    def sdpa_fwd(gqa):
        kw = {"enable_gqa": True} if gqa else {}
        return F.scaled_dot_product_attention(q, k_kv if gqa else k, v_kv if gqa else v,
                                              is_causal=True, **kw)

    def deterministic(fn):
        def run():
            torch.use_deterministic_algorithms(True)
            try:
                return fn()
            finally:
                torch.use_deterministic_algorithms(False)
        return run

    placeholders = []  # flash's sequence and RNG outputs, from one forward

    def flash_bwd_on(out, lse):
        # flash's backward on out (padded to the head dim) and log-sum-exp lse.
        if not placeholders:
            placeholders.extend(flash_fwd())
        f = placeholders
        return aten._scaled_dot_product_flash_attention_backward(
            go_f, q, k, v_f, out, lse, f[2], f[3], T, T, 0.0, True, f[6], f[7])

    def flash_det_both():
        r = flash_fwd()
        d = flash_bwd_on(r[0], r[1])
        return cut(r[0]), d[0], d[1], cut(d[2])

    def cudnn_flash_det_both():
        r = cudnn_fwd()
        lse = r[1].reshape(B, H, T).contiguous()
        d = flash_bwd_on(pad(r[0]), lse)
        return r[0], d[0], d[1], cut(d[2])

    def cudnn_padded_fwd():
        return aten._scaled_dot_product_cudnn_attention(q, k, v_f, None, True, 0.0, True, False)

    def cudnn_padded_flash_det_both():
        r = cudnn_padded_fwd()
        d = flash_bwd_on(r[0], r[1].reshape(B, H, T).contiguous())
        return cut(r[0]), d[0], d[1], cut(d[2])

    try:
        from torch.nn.attention import SDPBackend
        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True)
        picked = SDPBackend(choice).name
    except Exception as e:  # noqa: BLE001 -- report, do not stop
        picked = f"unknown ({e})"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; B {B}, H {H} "
          f"(kv {KV}), T {T}, hd {hd}, v hd {vd}, causal bf16; SDPA picks: {picked}")
    print()
    print("| backend | fwd ms | fwd+bwd ms | x layers: fwd | x layers: fwd+bwd | "
          "max rel diff from flash (out, dq, dk, dv) |")
    print("|---|---|---|---|---|---|")
    ref = None
    rows = [("flash", flash_fwd, flash_both), ("cudnn", cudnn_fwd, cudnn_both),
            ("sdpa", lambda: sdpa_fwd(False), lambda: sdpa_both(False)),
            ("sdpa_gqa", lambda: sdpa_fwd(True), lambda: sdpa_both(True)),
            ("flash_det", deterministic(flash_fwd), deterministic(flash_det_both)),
            ("cudnn_flash_det", deterministic(cudnn_fwd), deterministic(cudnn_flash_det_both))]
    if vd < hd:
        rows.append(("cudnn_padded_flash_det", deterministic(cudnn_padded_fwd),
                     deterministic(cudnn_padded_flash_det_both)))
    for name, fwd, both in rows:
        try:
            with torch.no_grad():
                tf = timed(fwd, a.reps)
            tb = timed(both, a.reps)
            outs = [x.float() for x in both()]
            if name.endswith("_det"):
                again = [x.float() for x in both()]
                same = all(torch.equal(x, y) for x, y in zip(outs, again))
                name += " (same bits twice)" if same else " (BITS DIFFER between calls)"
            if ref is None:
                ref, diff = outs, "-"
            elif outs[2].shape != ref[2].shape:  # GQA: dk, dv over the KV heads
                rk = ref[2].unflatten(1, (KV, H // KV)).sum(2)
                rv = ref[3].unflatten(1, (KV, H // KV)).sum(2)
                diff = ", ".join(f"{((x - y).norm() / y.norm()).item():.1e}"
                                 for x, y in zip(outs, [ref[0], ref[1], rk, rv]))
            else:
                diff = ", ".join(f"{((x - y).norm() / y.norm()).item():.1e}"
                                 for x, y in zip(outs, ref))
            print(f"| {name} | {tf:.3f} | {tb:.3f} | {tf * a.layers:.1f} | "
                  f"{tb * a.layers:.1f} | {diff} |")
        except Exception as e:  # noqa: BLE001 -- a backend this torch lacks
            msg = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            print(f"| {name} | failed: {msg} | | | | |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
