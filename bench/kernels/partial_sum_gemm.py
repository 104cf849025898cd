"""The AttnRes partial sum's add, alone and folded into the GEMM before it.

In kimi_k3 every sublayer's output is added to its block's partial sum:
p' = p + x W^T (63 bf16 adds of [8192, 2048] a K3 step). Folding the add
into the GEMM (C = p, beta = 1) saves the add's pass only where the GEMM
reads C and writes a different D; ATen's addmm with a full-matrix C may
copy C into its result first and run the GEMM in place, which moves the
same bytes as the add. This bench times, at the K3 cell's shapes:
  mm + add      y = x W^T, then p + y (what viaduct runs)
  addmm         at::addmm(p, x, W^T)
  addmm_ in place  D = p.clone() outside the timing, D.addmm_(x, W^T): the
                GEMM alone with beta = 1, the floor of any fold
and lists the kernels each form launches (torch.profiler), so the copy, if
there is one, is named. The sums' bits: how many elements of addmm's
result differ from mm + add's (one rounding of the fp32 sum against two).

  python3 bench/kernels/partial_sum_gemm.py [--tokens 8192] [--iters 50]
"""
import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "lib"))
from cuda_timing import gpu_state, timed  # noqa: E402


def kernels_of(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return "; ".join(n[:60] for n in names)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    # (name, K): the attention's output projection (KDA's o_proj, MLA's wo:
    # K = 2048) and the shared expert's down projection (K = 512).
    shapes = [("o_proj / wo", a.dim), ("shared expert w2", 512)]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{a.tokens} tokens, D {a.dim}")
    for name, K in shapes:
        x = torch.randn(a.tokens, K, device=dev, dtype=bf)
        w = torch.randn(a.dim, K, device=dev, dtype=bf) / K ** 0.5
        p = torch.randn(a.tokens, a.dim, device=dev, dtype=bf)
        d = p.clone()
        forms = {
            "mm + add": lambda: p + x @ w.t(),
            "addmm": lambda: torch.addmm(p, x, w.t()),
            "addmm_ in place": lambda: d.addmm_(x, w.t()),
        }
        ref = p + x @ w.t()
        fold = torch.addmm(p, x, w.t())
        differ = (ref != fold).sum().item()
        print(f"\n## {name}: [{a.tokens}, {K}] x [{K}, {a.dim}] + [{a.tokens}, {a.dim}]; "
              f"addmm differs from mm + add in {differ} of {ref.numel()} elements")
        for f, fn in forms.items():
            print(f"- {f} launches: {kernels_of(fn)}")
        for r in range(a.rounds):
            row = []
            for f, fn in forms.items():
                row.append(f"{f} {timed(fn, a.iters) * 1e3:.1f} us")
            print(f"round {r + 1}: " + ", ".join(row) + f" ({gpu_state()})")


if __name__ == "__main__":
    main()
