"""The clip's gradient norm after the backward, or during it on a side stream.

The clip reads every fp32 gradient once after the backward (1.9 ms of a K3
step, 2.2 ms of the 1B's), at the copy's pace. Overlapping it with the
backward, each layer's norms on a second stream as soon as its gradients
are final, hides it only if the backward's kernels leave the memory and
the SMs room for it. This bench answers that before any product code:
a backward-like sequence per layer (GEMMs at the K3 cell's shapes and a
memory-bound add) whose layers each "finish" fp32 gradients of the K3
cell's size (1.28 B elements over 33 layers, by default), timed
  sequence   the layers alone
  after      the layers, then `torch._foreach_norm` over every gradient
             (what viaduct runs now)
  overlapped each layer's gradients' norms on a side stream after its
             GEMMs (an event each way), the main stream joining at the end
and the bits: every tensor's norm from its layer's list against its norm
from the whole list (the clip's host path, which other layouts take,
forms the norms over the whole list), which must be equal for the
overlap to keep the layouts' bits.

  python3 bench/kernels/norm_overlap.py [--layers 33] [--params 1.28e9]
"""
import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "lib"))
from cuda_timing import gpu_state, timed  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=33)
    ap.add_argument("--params", type=float, default=1.28e9)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--gemms", type=int, default=6, help="GEMMs a layer's backward runs")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    T, D = a.tokens, a.dim
    x = torch.randn(T, D, device=dev, dtype=bf)
    w = torch.randn(D, D, device=dev, dtype=bf) / D ** 0.5
    y = torch.empty(T, D, device=dev, dtype=bf)
    z = torch.randn(T, D, device=dev, dtype=bf)
    # Each layer's gradients: tensors of D x D fp32 and one remainder, about
    # params / layers elements a layer; the values of a backward's (small,
    # of mixed signs).
    per_layer = int(a.params / a.layers)
    grads = []
    for _ in range(a.layers):
        sizes = [D * D] * (per_layer // (D * D))
        if per_layer % (D * D):
            sizes.append(per_layer % (D * D))
        grads.append([torch.randn(n, device=dev) * 1e-3 for n in sizes])
    flat = [g for layer in grads for g in layer]
    side = torch.cuda.Stream()
    out = {}

    def layer_work():
        for _ in range(a.gemms):
            torch.mm(x, w, out=y)
        torch.add(y, z, out=y)

    def sequence():
        for _ in range(a.layers):
            layer_work()

    def after():
        sequence()
        out["after"] = torch._foreach_norm(flat, 2)

    def overlapped():
        main = torch.cuda.current_stream()
        norms = []
        for layer in grads:
            layer_work()
            ready = torch.cuda.Event()
            ready.record(main)
            side.wait_event(ready)
            with torch.cuda.stream(side):
                norms.extend(torch._foreach_norm(layer, 2))
        done = torch.cuda.Event()
        done.record(side)
        main.wait_event(done)
        out["overlapped"] = norms

    def norms_alone():
        torch._foreach_norm(flat, 2)

    gb = sum(g.numel() for g in flat) * 4 / 1e9
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {a.layers} layers, "
          f"{len(flat)} gradients, {gb:.2f} GB fp32; a layer: {a.gemms} GEMMs "
          f"[{T}, {D}] x [{D}, {D}] and one bf16 add")
    print("| round | norms alone | sequence | after | overlapped | after - sequence "
          "| overlapped - sequence | clock |")
    print("|---|---|---|---|---|---|---|---|")
    for r in range(a.rounds):
        t_norm = timed(norms_alone, a.iters)
        t_seq = timed(sequence, a.iters)
        t_after = timed(after, a.iters)
        t_over = timed(overlapped, a.iters)
        print(f"| {r + 1} | {t_norm:.3f} ms | {t_seq:.3f} | {t_after:.3f} | {t_over:.3f} "
              f"| {t_after - t_seq:+.3f} | {t_over - t_seq:+.3f} | {gpu_state()} |")
    torch.cuda.synchronize()
    a_bits = torch.stack(out["after"])
    o_bits = torch.stack(out["overlapped"])
    differ = int((a_bits.view(torch.int32) != o_bits.view(torch.int32)).sum())
    print(f"per-tensor norms from each layer's list against the whole list's: {differ} of "
          f"{a_bits.numel()} differ in their bits")


if __name__ == "__main__":
    main()
