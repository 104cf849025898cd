#!/usr/bin/env python3
"""How far the MoE experts' grouped GEMMs are from what cuBLAS does at the
same shapes: each of the six GEMMs viaduct's experts run a layer (the
gate-up projection over w1 and w3 side by side, the down projection w2;
each forward, rows' gradient and weights' gradient) timed three ways:

  grouped    torch._grouped_mm over the groups, as viaduct's
             compat::grouped_mm calls it (the groups' offsets on the device);
  per-expert one cuBLAS GEMM per group on its slice, sizes known on the
             host (not usable in the product: a host sync a layer, and the
             step's CUDA graph would fix the routed sizes), the ceiling a
             better grouped kernel could reach at these group sizes;
  dense      one cuBLAS GEMM over all the rows with one expert's weight: the
             same FLOPs in one launch, the shape's own ceiling.

    python3 bench/kernels/expert_gemm_ceiling.py                 # K3: 16,512 rows, D 2048, H 512, 8 experts
    python3 bench/kernels/expert_gemm_ceiling.py --hidden 1024 --experts 16

If per-expert runs well above grouped, a grouped GEMM of viaduct's own is
worth building; if both sit at the same pace, the group sizes themselves
set it. Rounds alternate the forms; each figure is the median of the
rounds' medians, with the SM clock and power after each round. bf16 in,
fp32 accumulation, bf16 out (the weights' gradients as viaduct's build
writes them before the cast to fp32). Needs torch >= 2.8 on a CUDA GPU.
"""
import argparse
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "lib"))
from cuda_timing import add_expert_shape_args, expert_groups, gpu_state, timed  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    add_expert_shape_args(ap, iters=30)
    ap.add_argument("--peak", type=float, default=989.0, help="bf16 dense TFLOP/s of the card")
    args = ap.parse_args()
    dev = "cuda"
    E, D, H, M = args.experts, args.dim, args.hidden, args.rows
    torch.manual_seed(0)
    # Uneven groups as routing gives them, each a multiple of the alignment
    # (grouped_gemm_shapes.py's groups).
    sizes = expert_groups(M, E, args.align)
    bounds = [0] + sizes.cumsum(0).tolist()
    offs = sizes.cumsum(0).to(torch.int32).to(dev)
    bf = torch.bfloat16
    x = torch.randn(M, D, device=dev, dtype=bf)
    w13 = torch.randn(E, 2 * H, D, device=dev, dtype=bf) * 0.02  # [E, 2H, D]
    w2 = torch.randn(E, D, H, device=dev, dtype=bf) * 0.02  # [E, D, H]
    h = torch.randn(M, H, device=dev, dtype=bf)  # the down projection's input
    dh13 = torch.randn(M, 2 * H, device=dev, dtype=bf)  # the gate-up output's gradient
    dy = torch.randn(M, D, device=dev, dtype=bf)  # the down projection's output gradient
    gm = torch._grouped_mm
    g = [slice(bounds[i], bounds[i + 1]) for i in range(E)]

    # (name, FLOPs, grouped, per-expert, dense)
    gemms = [
        ("gate-up forward [M,D]x[D,2H]", 2 * M * D * 2 * H,
         lambda: gm(x, w13.transpose(1, 2), offs),
         lambda: [torch.mm(x[s], w13[e].t()) for e, s in enumerate(g)],
         lambda: torch.mm(x, w13[0].t())),
        ("gate-up rows' gradient [M,2H]x[2H,D]", 2 * M * D * 2 * H,
         lambda: gm(dh13, w13, offs),
         lambda: [torch.mm(dh13[s], w13[e]) for e, s in enumerate(g)],
         lambda: torch.mm(dh13, w13[0])),
        ("gate-up weights' gradient [2H,M]x[M,D]", 2 * M * D * 2 * H,
         lambda: gm(dh13.t(), x, offs),
         lambda: [torch.mm(dh13[s].t(), x[s]) for s in g],
         lambda: torch.mm(dh13.t(), x)),
        ("down forward [M,H]x[H,D]", 2 * M * D * H,
         lambda: gm(h, w2.transpose(1, 2), offs),
         lambda: [torch.mm(h[s], w2[e].t()) for e, s in enumerate(g)],
         lambda: torch.mm(h, w2[0].t())),
        ("down rows' gradient [M,D]x[D,H]", 2 * M * D * H,
         lambda: gm(dy, w2, offs),
         lambda: [torch.mm(dy[s], w2[e]) for e, s in enumerate(g)],
         lambda: torch.mm(dy, w2[0])),
        ("down weights' gradient [D,M]x[M,H]", 2 * M * D * H,
         lambda: gm(dy.t(), h, offs),
         lambda: [torch.mm(dy[s].t(), h[s]) for s in g],
         lambda: torch.mm(dy.t(), h)),
    ]
    # The grouped GEMM against the per-expert loop, element for element.
    for name, _, grouped, per_expert, _ in gemms:
        a, b = grouped(), per_expert()
        if a.dim() == 3:  # weights' gradients: [E, N, K]
            same = all(torch.equal(a[e], b[e]) for e in range(E))
        else:
            same = torch.equal(a, torch.cat(b, 0))
        print(f"{name}: grouped == per-expert, bitwise: {same}")

    forms = ["grouped", "per-expert", "dense"]
    results = {(n, f): [] for n, *_ in gemms for f in forms}
    clocks = []
    for _ in range(args.rounds):
        for name, _, *fns in gemms:
            for f, fn in zip(forms, fns):
                results[(name, f)].append(timed(fn, args.iters))
        clocks.append(gpu_state())
    print(f"\ngroups {sizes.tolist()} (rows {M}), D {D}, H {H}, {E} experts; "
          f"{args.rounds} rounds of {args.iters}; clocks after each round: {'; '.join(clocks)}\n")
    print("| GEMM | grouped ms (% of peak) | per-expert ms (%) | dense ms (%) | grouped / per-expert |")
    print("|---|---|---|---|---|")
    total = {f: 0.0 for f in forms}
    for name, flops, *_ in gemms:
        cells = []
        ms = {}
        for f in forms:
            ms[f] = statistics.median(results[(name, f)])
            total[f] += ms[f]
            cells.append(f"{ms[f]:.4f} ({flops / ms[f] / 1e9 / args.peak * 100:.0f}%)")
        print(f"| {name} | {' | '.join(cells)} | {ms['grouped'] / ms['per-expert']:.3f} |")
    print(f"| all six | {total['grouped']:.4f} | {total['per-expert']:.4f} | {total['dense']:.4f} "
          f"| {total['grouped'] / total['per-expert']:.3f} |")


if __name__ == "__main__":
    main()
