"""KDA over documents: viaduct against flash-linear-attention.

Reads what `kda_documents_bench --out DIR` wrote (inputs, viaduct's output
and gradients, cu_seqlens), runs fla's chunk_kda on the same inputs with
cu_seqlens (the B x T tokens as one row, as fla takes documents), and
compares both with a float64 step-by-step recurrence of each document from
a zero state (autograd through the loop for the gradients). Then times
fla's forward + backward with cu_seqlens and on the plain [B, T] batch.

    python3 bench/layers/kda_documents_vs_fla.py --dir DIR --anchor ../shared/anchors/kda \
        [--dtype float32|bfloat16] [--iters N]
    python3 bench/layers/kda_documents_vs_fla.py --warm 4x2048x16x64 --anchor ../shared/anchors/kda

--one-config compiles each of fla's autotuned kernels in its first listed
configuration only (triton.autotune wrapped before fla is imported): the
outputs and gradients are the same algorithm's, and the compile, which
otherwise tries every configuration and outlasts a device call, takes a
fraction of the time; the timing table is then labelled as untuned.

--warm B x T x H x D runs fla's forward + backward once with cu_seqlens and
once on the plain batch, on random inputs of that shape, and exits: Triton
compiles the kernels into its on-disk cache, so a later process (the
comparison) does not pay the compile inside its timed call. A session
starts it in the background of the CUDA build.

Prints one table of relative errors (max |a - b| / max |b|, and the RMS
ratio) and one of fla's times. Runs on a GPU with Triton.
"""
import argparse
import json
import statistics
import sys
import time

import torch


def load(d, name, shape):
    n = 1
    for s in shape:
        n *= s
    data = open(f"{d}/{name}.f32", "rb").read()
    assert len(data) == 4 * n, f"{name}.f32: {len(data)} bytes for shape {shape}"
    return torch.frombuffer(bytearray(data), dtype=torch.float32).view(*shape)


def recurrent_documents(q, k, v, g, beta, bounds):
    """o_t = S_t^T q_t, S_t = (I - b_t k_t k_t^T) Diag(exp g_t) S_{t-1} + b_t k_t v_t^T,
    S_0 = 0 at each document [bounds[i], bounds[i + 1]) of the rows q, k, v,
    g [N, H, D], beta [N, H]; all documents at once: padded to the longest with steps that
    change nothing before them (g = 0, beta = 0), so the loop runs the
    longest document's length, not the sum of all. Returns [N, H, Dv]."""
    spans = list(zip(bounds[:-1], bounds[1:]))
    longest = max(e - s for s, e in spans)

    def padded(t):
        out = t.new_zeros(len(spans), longest, *t.shape[1:])
        for i, (s, e) in enumerate(spans):
            out[i, : e - s] = t[s:e]
        return out

    q, k, v, g, beta = (padded(t) for t in (q, k, v, g, beta))
    n, _, H, D = q.shape
    S = q.new_zeros(n, H, D, v.shape[-1])
    outs = []
    for t in range(longest):
        S = S * g[:, t].exp().unsqueeze(-1)
        u = v[:, t] - torch.einsum("nhk,nhkv->nhv", k[:, t], S)
        S = S + torch.einsum("nhk,nhv->nhkv", beta[:, t].unsqueeze(-1) * k[:, t], u)
        outs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], S))
    o = torch.stack(outs, 1)
    return torch.cat([o[i, : e - s] for i, (s, e) in enumerate(spans)], 0)


def errors(a, b):
    a, b = a.double(), b.double()
    d = (a - b).abs()
    return d.max().item() / max(b.abs().max().item(), 1e-30), \
        (d.pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def timed(fn, iters):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def first_config_only():
    """Wraps triton.autotune so that each kernel fla decorates afterwards
    keeps only its first configuration (see --one-config)."""
    import triton

    autotune = triton.autotune

    def first(configs, *args, **kwargs):
        return autotune(list(configs)[:1], *args, **kwargs)

    triton.autotune = first


def warm(shape, dtype):
    """fla's forward + backward once over random documents and once on the
    plain batch, at B x T x H x D (see the module's docstring)."""
    from fla.ops.kda import chunk_kda

    B, T, H, D = (int(v) for v in shape.split("x"))
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    cuts = sorted(set(torch.randint(1, B * T, (max(1, B * T // 400),), generator=gen).tolist()))
    cu = torch.tensor([0] + cuts + [B * T], dtype=torch.long, device=dev)

    def inputs(rows, cols):
        q = torch.nn.functional.normalize(torch.randn(rows, cols, H, D, generator=gen), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(rows, cols, H, D, generator=gen), dim=-1)
        v = torch.randn(rows, cols, H, D, generator=gen)
        g = -torch.rand(rows, cols, H, D, generator=gen) * 0.1
        beta = torch.rand(rows, cols, H, generator=gen)
        return [t.to(dev, torch.float32 if i == 3 else dtype).requires_grad_(True)
                for i, t in enumerate((q, k, v, g, beta))]

    t0 = time.perf_counter()
    for rows, cols, seqlens in ((1, B * T, cu), (B, T, None)):
        what = "documents" if seqlens is not None else "plain batch"
        x = inputs(rows, cols)
        # Each phase says when it is done, so a compile that outlasts its
        # call shows where it stood.
        print(f"fla warm: {what} forward ...", flush=True)
        o, _ = chunk_kda(*x, scale=1.0, cu_seqlens=seqlens)
        torch.cuda.synchronize()
        print(f"fla warm: {what} forward done at {time.perf_counter() - t0:.1f} s; backward ...",
              flush=True)
        torch.autograd.grad(o, x, torch.randn_like(o))
        torch.cuda.synchronize()
        print(f"fla warm: {what} backward done at {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"fla warm ({shape}, {len(cuts) + 1} documents and the plain batch): "
          f"{time.perf_counter() - t0:.1f} s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir")
    ap.add_argument("--one-config", action="store_true",
                    help="compile fla's kernels in their first autotune configuration only")
    ap.add_argument("--warm", metavar="BxTxHxD",
                    help="compile fla's kernels at this shape and exit (no --dir)")
    ap.add_argument("--anchor", required=True, help="the folder holding fla/ (../shared/anchors/kda)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="fla's q, k, v and beta (g stays float32, as fla's core takes it)")
    args = ap.parse_args()
    sys.path.insert(0, args.anchor)
    if args.one_config:
        first_config_only()
    if args.warm:
        warm(args.warm, getattr(torch, args.dtype))
        return
    if not args.dir:
        ap.error("--dir is required (or --warm)")
    from fla.ops.kda import chunk_kda

    meta = json.load(open(f"{args.dir}/meta.json"))
    B, T, H, D = meta["B"], meta["T"], meta["H"], meta["D"]
    cu = torch.tensor(meta["cu_seqlens"], dtype=torch.long)
    dev = torch.device("cuda")
    names = ["q", "k", "v", "g", "beta"]
    x = {n: load(args.dir, n, [B, T, H] if n == "beta" else [B, T, H, D]) for n in names}
    dO = load(args.dir, "do", [B, T, H, D])
    viaduct = {"o": load(args.dir, "o", [B, T, H, D])}
    for n in names:
        viaduct["d" + n] = load(args.dir, "d" + n, [B, T, H] if n == "beta" else [B, T, H, D])

    # fla: the tokens as one row [1, B T, ...], documents by cu_seqlens; q
    # arrives scaled (scale 1) and normalised (no in-kernel L2 norm).
    dt = getattr(torch, args.dtype)

    def flat(n):
        t = x[n].reshape(1, B * T, *x[n].shape[2:])
        return t.to(dev, torch.float32 if n == "g" else dt).requires_grad_(True)

    fx = [flat(n) for n in names]
    cu_dev = cu.to(dev)
    t0 = time.perf_counter()
    o_fla, _ = chunk_kda(*fx, scale=1.0, cu_seqlens=cu_dev)
    g_fla = torch.autograd.grad(o_fla, fx, dO.reshape(1, B * T, H, D).to(dev, o_fla.dtype))
    fla = {"o": o_fla.detach().reshape(B, T, H, D).cpu()}
    for n, gr in zip(names, g_fla):
        fla["d" + n] = gr.reshape(x[n].shape).cpu()
    print(f"fla's first forward + backward (compile, autotune): {time.perf_counter() - t0:.1f} s",
          flush=True)

    # float64 reference: each document alone from a zero state.
    rx = [x[n].reshape(B * T, *x[n].shape[2:]).to(dev, torch.float64).requires_grad_(True) for n in names]
    t0 = time.perf_counter()
    bounds = cu.tolist()
    o_ref = recurrent_documents(*rx, bounds)
    g_ref = torch.autograd.grad(o_ref, rx, dO.reshape(B * T, H, D).to(dev, torch.float64))
    print(f"the float64 reference: {time.perf_counter() - t0:.1f} s", flush=True)
    ref = {"o": o_ref.detach().reshape(B, T, H, D).cpu()}
    for n, gr in zip(names, g_ref):
        ref["d" + n] = gr.reshape(x[n].shape).cpu()

    print(f"KDA over {len(bounds) - 1} documents (mean {B * T / (len(bounds) - 1):.1f} tokens), "
          f"{B} x {T}, {H} heads of {D}; viaduct fp32 on {meta['device']}, fla {args.dtype}")
    print("| tensor | viaduct vs fp64: max rel / rms | fla vs fp64: max rel / rms | viaduct vs fla: max rel / rms |")
    print("|---|---|---|---|")
    for key in ["o"] + ["d" + n for n in names]:
        cells = [errors(viaduct[key], ref[key]), errors(fla[key], ref[key]), errors(viaduct[key], fla[key])]
        print(f"| {key} | " + " | ".join(f"{m:.2e} / {r:.2e}" for m, r in cells) + " |")

    # fla's own cost of documents: cu_seqlens against the plain batch.
    px = [x[n].to(dev, torch.float32 if n == "g" else dt).requires_grad_(True) for n in names]
    dO_dev = dO.to(dev, dt)

    def fla_docs():
        o, _ = chunk_kda(*fx, scale=1.0, cu_seqlens=cu_dev)
        torch.autograd.grad(o, fx, dO_dev.reshape(1, B * T, H, D))

    def fla_causal():
        o, _ = chunk_kda(*px, scale=1.0)
        torch.autograd.grad(o, px, dO_dev)

    causal = timed(fla_causal, args.iters)
    docs = timed(fla_docs, args.iters)
    print()
    tuned = "" if not args.one_config else " (untuned: first autotune configuration)"
    print(f"| fla chunk_kda fwd+bwd{tuned} | ms | vs causal |")
    print("|---|---|---|")
    print(f"| causal ([B, T]) | {causal:.3f} | 1.00x |")
    print(f"| documents (cu_seqlens) | {docs:.3f} | {docs / causal:.2f}x |")


if __name__ == "__main__":
    main()
