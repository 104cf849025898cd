"""Median milliseconds of a CUDA callable, for the Python benches on the GPU
machine (bench/speed/attention_backends.py, bench/kernels/grouped_gemm_shapes.py):
three untimed calls, then `reps` calls each between two CUDA events."""
import statistics

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
