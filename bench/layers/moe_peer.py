#!/usr/bin/env python3
"""The MoE layer's PyTorch peer at layer_bench's shapes, forward + backward.

    python3 bench/layers/moe_peer.py            # B=1, T=4096, D=2048, hidden D/2, one shared expert

The peer is reference/torch_models.py's Moe (sigmoid router in fp32, top-k by a
stable sort with the selection-only bias, slots dispatched into expert groups
padded to 16 rows on the device, the experts as three torch._grouped_mm,
the weighted combine, the shared SwiGLU expert): the whole layer as
build-gpu/bench/layer_bench's "moe (E experts, top-k)" rows time it, timed
the same way (3 warm-up calls, the median of --iters, a device
synchronisation around each forward + backward, gradients set to none).

Two weight forms: "fp32 masters" casts each fp32 weight to bf16 in every
forward, as the K3 reference does in training; "bf16 weights" keeps bf16
parameters (no cast), the fastest a PyTorch user gets from this layer, while
viaduct's bf16 weight cache casts once per optimizer step (layer_bench runs
no step, so its rows carry no cast either).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

# The reference models live in reference/ at the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "reference"))
import torch_models  # noqa: E402


def time_fwd_bwd(m, x, iters):
    times = []
    for i in range(iters + 3):
        xi = x.detach().requires_grad_(True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = m(xi)
        y.backward(torch.ones_like(y))
        torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
        m.zero_grad(set_to_none=True)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--shapes", default="16x2,64x2,128x8", help="experts x top-k, comma separated")
    a = ap.parse_args()
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        sys.exit("moe_peer.py: needs a CUDA device and torch._grouped_mm (PyTorch >= 2.8)")
    torch_models.GROUPED_MM = True  # the grouped path without fla's anchor
    dev = torch.device("cuda")
    D = a.dim
    torch.manual_seed(0)
    x = torch.randn(1, a.tokens, D, device=dev).to(torch.bfloat16)
    print(f"moe_peer.py: torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"B=1 T={a.tokens} D={D} hidden {D // 2}, one shared expert")
    for shape in a.shapes.split(","):
        E, K = (int(v) for v in shape.split("x"))
        s = SimpleNamespace(n_routed_experts=E, n_activated_experts=K, moe_route_scale=1.0,
                            moe_bias_update_rate=0.0, dim=D, moe_hidden_dim=D // 2,
                            n_shared_experts=1)
        m = torch_models.Moe(s).to(dev)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0.0, 0.02)
        row = []
        for form in ("fp32 masters", "bf16 weights"):
            if form == "bf16 weights":
                m = m.to(torch.bfloat16)
                m.expert_bias = m.expert_bias.float()
            row.append(time_fwd_bwd(m, x, a.iters))
        print(f"moe peer ({E} experts, top-{K}): fp32 masters {row[0]:8.3f} ms, "
              f"bf16 weights {row[1]:8.3f} ms")
        sys.stdout.flush()
        del m
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
