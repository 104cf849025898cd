#!/usr/bin/env python3
"""The MoE experts' grouped GEMMs at the K3 cell's shapes, as separate gate
and up projections (two GEMMs of N = hidden) against one fused gate-up
projection (N = 2 hidden, what viaduct runs: Note [One gate-up GEMM for
the experts]), for the forward, the rows' gradient and the weights'
gradient, with torch._grouped_mm (the kernel viaduct's compat::grouped_mm
calls). The weights' gradient four ways: two GEMMs on two gradients, one
GEMM cast whole, two GEMMs each on its half of the one [rows, 2H]
gradient (what viaduct runs), and one GEMM whose two halves are then cast
to fp32 each on its own.

    python3 bench/kernels/grouped_gemm_shapes.py            # K3: 16,512 rows, 2048 -> 2 x 512, 8 experts
    python3 bench/kernels/grouped_gemm_shapes.py --rows 32768 --hidden 1024

Rounds alternate the forms (A, B, A, B, ...); each figure is the median of
the rounds' medians, with the SM clock and power read by nvidia-smi after
each round. Needs torch >= 2.8 on a CUDA GPU (the GPU machine's Python).
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
    add_expert_shape_args(ap, iters=50)
    args = ap.parse_args()
    dev = "cuda"
    E, D, H, M = args.experts, args.dim, args.hidden, args.rows
    torch.manual_seed(0)
    # Uneven groups as routing gives them, each a multiple of the alignment.
    sizes = expert_groups(M, E, args.align)
    offs = sizes.cumsum(0).to(torch.int32).to(dev)
    bf = torch.bfloat16
    x = torch.randn(M, D, device=dev, dtype=bf)
    w1 = torch.randn(E, H, D, device=dev, dtype=bf) * 0.02
    w3 = torch.randn(E, H, D, device=dev, dtype=bf) * 0.02
    w13 = torch.cat([w1, w3], 1).contiguous()  # [E, 2H, D]
    dh1 = torch.randn(M, H, device=dev, dtype=bf)
    dh3 = torch.randn(M, H, device=dev, dtype=bf)
    dh13 = torch.cat([dh1, dh3], 1).contiguous()
    gm = torch._grouped_mm

    def halves_cast(both):
        return (both[:, :H].to(torch.float32, memory_format=torch.contiguous_format),
                both[:, H:].to(torch.float32, memory_format=torch.contiguous_format))

    cases = {
        "forward: two [M,D]x[D,H]": lambda: (gm(x, w1.transpose(1, 2), offs),
                                             gm(x, w3.transpose(1, 2), offs)),
        "forward: one [M,D]x[D,2H]": lambda: gm(x, w13.transpose(1, 2), offs),
        "rows' gradient: two [M,H]x[H,D] + add": lambda: gm(dh1, w1, offs) + gm(dh3, w3, offs),
        "rows' gradient: two [M,H]x[H,D], no add": lambda: (gm(dh1, w1, offs),
                                                             gm(dh3, w3, offs)),
        "rows' gradient: one [M,2H]x[2H,D]": lambda: gm(dh13, w13, offs),
        # bf16 out, then fp32, as compat::grouped_mm_fp32 runs where the
        # build's grouped GEMM writes no fp32.
        "weights' gradient: two [H,M]x[M,D] fp32": lambda: (gm(dh1.t(), x, offs).float(),
                                                             gm(dh3.t(), x, offs).float()),
        "weights' gradient: one [2H,M]x[M,D] fp32": lambda: gm(dh13.t(), x, offs).float(),
        # One GEMM, then each weight's half cast to its own contiguous fp32
        # tensor (a strided read), as the optimizer keeps the two gradients.
        "weights' gradient: one [2H,M]x[M,D], halves cast": lambda: halves_cast(
            gm(dh13.t(), x, offs)),
        # Each weight's gradient from its half of the one [M, 2H] gradient
        # (a strided operand), so that each comes out contiguous.
        "weights' gradient: two on [M,2H]'s halves fp32": lambda: (
            gm(dh13[:, :H].t(), x, offs).float(), gm(dh13[:, H:].t(), x, offs).float()),
    }
    flops = {
        "forward": 2 * M * D * 2 * H,
        "rows' gradient": 2 * M * D * 2 * H,
        "weights' gradient": 2 * M * D * 2 * H,
    }
    # The fused forms' results against the separate ones (same sums per
    # element for the forward and the weights' gradient; the rows' gradient
    # sums 2H terms in one GEMM instead of two H-term GEMMs and a bf16 add).
    f2 = torch.cat(cases["forward: two [M,D]x[D,H]"](), 1)
    print(f"forward fused == separate, bitwise: {torch.equal(f2, cases['forward: one [M,D]x[D,2H]']())}")
    g2 = torch.cat(cases["weights' gradient: two [H,M]x[M,D] fp32"](), 1)
    g1 = cases["weights' gradient: one [2H,M]x[M,D] fp32"]()
    print(f"weights' gradient fused == separate, bitwise: {torch.equal(g2, g1)}")
    g3 = torch.cat(cases["weights' gradient: two on [M,2H]'s halves fp32"](), 1)
    print(f"weights' gradient on the halves == separate, bitwise: {torch.equal(g2, g3)}")
    h1, h3 = cases["weights' gradient: one [2H,M]x[M,D], halves cast"]()
    print(f"weights' gradient as one GEMM, halves cast == separate, bitwise: "
          f"{torch.equal(g2, torch.cat([h1, h3], 1)) and h1.is_contiguous()}")
    r2 = cases["rows' gradient: two [M,H]x[H,D] + add"]().float()
    r1 = cases["rows' gradient: one [M,2H]x[2H,D]"]().float()
    print(f"rows' gradient fused vs separate: max |diff| / max |x| = "
          f"{((r1 - r2).abs().max() / r2.abs().max()).item():.2e}")

    results = {k: [] for k in cases}
    clocks = []
    for r in range(args.rounds):
        for k, fn in cases.items():
            results[k].append(timed(fn, args.iters))
        clocks.append(gpu_state())
    print(f"\ngroups {sizes.tolist()} (rows {M}), D {D}, H {H}, {E} experts; "
          f"{args.rounds} rounds of {args.iters}; clocks after each round: {'; '.join(clocks)}\n")
    print("| case | ms (median of rounds) | TFLOP/s | rounds |")
    print("|---|---|---|---|")
    for k, v in results.items():
        f = flops[k.split(":")[0]]
        ms = statistics.median(v)
        print(f"| {k} | {ms:.4f} | {f / ms / 1e9:.0f} | {', '.join(f'{t:.4f}' for t in v)} |")


if __name__ == "__main__":
    main()
