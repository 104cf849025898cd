"""For the Python benches on the GPU machine (bench/speed/attention_backends.py,
bench/kernels/grouped_gemm_shapes.py, bench/kernels/expert_gemm_ceiling.py):
the median milliseconds of a CUDA callable (three untimed calls, then `reps`
calls each between two CUDA events), GPU 0's SM clock and power as
nvidia-smi reads them, and the MoE benches' uneven expert groups."""
import statistics
import subprocess

import torch


def timed(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def gpu_state():
    """GPU 0's SM clock and power now, as "MHz, W" text."""
    try:
        q = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True,
                           timeout=10).stdout.strip()
        sm, pw = [x.strip() for x in q.split(",")]
        return f"{sm} MHz, {pw} W"
    except Exception:  # no nvidia-smi: figures without clocks
        return "clock unknown"


def add_expert_shape_args(ap, iters):
    """The MoE benches' shape options (the K3 cell's by default) on an
    argparse parser, with `iters` timed calls a case by default."""
    ap.add_argument("--rows", type=int, default=16512)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--align", type=int, default=16)
    ap.add_argument("--iters", type=int, default=iters)
    ap.add_argument("--rounds", type=int, default=3)


def expert_groups(rows, experts, align):
    """Uneven group sizes as routing gives them (a fixed draw), each a
    multiple of `align`, summing to `rows`: a CPU int64 tensor [experts]."""
    w = torch.rand(experts, generator=torch.Generator().manual_seed(1)) + 0.5
    sizes = (w / w.sum() * rows / align).floor().long() * align
    sizes[-1] += rows - sizes.sum()
    return sizes
