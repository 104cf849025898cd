#!/usr/bin/env python3
"""Largest relative gradient difference per step between two SGD runs.

Both runs must use optimizer.name = SGD with a constant lr, no clipping and
checkpoint.save_initial / interval 1 / keep_latest_k 0, so that the gradient
of step t is (p_{t-1} - p_t) / lr, read from the step folders. Per step it
prints max over tensors of max|g_a - g_b| / max|g_a| (pure Python, no numpy).

usage: attn_res_grad_diff.py RUN_A/checkpoint RUN_B/checkpoint LR STEPS
"""
import array
import glob
import json
import os
import struct
import sys


def load(step_dir):
    out = {}
    for f in sorted(glob.glob(os.path.join(step_dir, "model*.safetensors"))):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
            data = fh.read()
        for name, info in header.items():
            if name == "__metadata__" or info["dtype"] != "F32":
                continue
            a, b = info["data_offsets"]
            out[name] = array.array("f", data[a:b])
    return out


def grads(ckpt, t, lr):
    prev, cur = load(f"{ckpt}/step-{t - 1}"), load(f"{ckpt}/step-{t}")
    return {k: [(p - c) / lr for p, c in zip(prev[k], cur[k])] for k in cur}


def main():
    a, b, lr, steps = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    for t in range(1, steps + 1):
        ga, gb = grads(a, t, lr), grads(b, t, lr)
        worst, worst_name, worst_abs = 0.0, "", 0.0
        for k in ga:
            scale = max((abs(x) for x in ga[k]), default=0.0)
            diff = max((abs(x - y) for x, y in zip(ga[k], gb[k])), default=0.0)
            if scale > 0 and diff / scale > worst:
                worst, worst_name, worst_abs = diff / scale, k, diff
        print(f"step {t}: largest relative gradient difference {worst:.3g} "
              f"({worst_name}, max abs {worst_abs:.3g})")


if __name__ == "__main__":
    main()
