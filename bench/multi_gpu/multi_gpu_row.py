#!/usr/bin/env python3
"""One markdown table row of bench/multi_gpu/run_multi_gpu.sh from a run's metrics.jsonl.

    multi_gpu_row.py layers METRICS SCHEDULE STAGES_PER_RANK
    multi_gpu_row.py k3 METRICS SHAPE TRANSPORT
    multi_gpu_row.py ep METRICS EP EP1_METRICS

Both read the step lines (those with a loss), skip the warm-up steps (3 for
layers, 2 for k3, fewer in a short run) and take medians over the rest.
"""
import json
import statistics
import sys


def timed_rows(path, warmup):
    rows = [json.loads(l) for l in open(path) if '"loss"' in l]
    return rows, (rows[warmup:] if len(rows) > warmup + 1 else rows[1:])


def median_of(rows, key):
    v = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(v) if v else float("nan")


def max_per_rank(rows, key, unit, fmt):
    """Each rank's largest value of a per-rank list field, in `unit`."""
    n = len(rows[-1].get(key, []))
    return " / ".join(f"{max(r[key][i] for r in rows) / unit:{fmt}}" for i in range(n))


def layers_row(path, schedule, stages):
    _, t = timed_rows(path, 3)
    for r in t:  # one-rank runs write only the total
        r.setdefault("peak_memory_bytes_per_rank", [r["peak_memory_bytes"]])
    nan = float("nan")
    return (f"| {schedule} | {stages} | {median_of(t, 'tokens_per_sec'):.0f} | "
            f"{100 * median_of(t, 'mfu'):.1f}% | "
            f"{max_per_rank(t, 'peak_memory_bytes_per_rank', 2**30, '.1f')} | "
            f"{100 * median_of(t, 'bubble_measured_mean'):.1f}% | "
            f"{100 * t[-1].get('bubble_simulated', nan):.1f}% "
            f"({100 * t[-1].get('bubble_simulated_flops', nan):.1f}% by FLOPs) | "
            f"{median_of(t, 'p2p_bytes') / 1e6:.0f} |")


def k3_row(path, shape, transport):
    rows, t = timed_rows(path, 2)
    return (f"| {shape} | {transport} | {median_of(t, 'tokens_per_sec'):.0f} | "
            f"{max_per_rank(t, 'peak_memory_bytes_per_rank', 2**30, '.2f')} | "
            f"{max_per_rank(t, 'attn_res_store_peak_bytes', 2**20, '.0f') or '-'} | "
            f"{median_of(t, 'p2p_bytes') / 1e6:.0f} | "
            f"{median_of(t, 'pipeline_p2p_wait_seconds'):.3f} | {rows[-1]['loss']} |")


def ep_row(path, ep, ep1_path):
    rows, t = timed_rows(path, 2)
    for r in t:  # one-rank runs write only the total
        r.setdefault("peak_memory_bytes_per_rank", [r["peak_memory_bytes"]])
    a2a_s = median_of(t, "ep_alltoall_seconds") if "ep_alltoall_seconds" in t[-1] else 0.0
    step_s = median_of(t, "step_seconds")
    a2a_mb = median_of(t, "ep_alltoall_bytes") / 1e6 if "ep_alltoall_bytes" in t[-1] else 0.0
    worst = median_of([{"w": max(r.get("moe_load_max_over_mean") or [float("nan")])} for r in t], "w")
    try:
        ref = [json.loads(l)["loss"] for l in open(ep1_path) if '"loss"' in l]
        same = "yes" if ref[:3] == [r["loss"] for r in rows[:3]] else "no"
    except OSError:
        same = "-"
    return (f"| {ep} | {median_of(t, 'tokens_per_sec'):.0f} | "
            f"{100 * median_of(t, 'mfu'):.1f}% | "
            f"{max_per_rank(t, 'peak_memory_bytes_per_rank', 2**30, '.1f')} | "
            f"{a2a_mb:.1f} | {a2a_s:.3f} ({100 * a2a_s / step_s:.1f}%) | {worst:.2f} | {same} |")


def main(argv):
    rows = {"layers": layers_row, "k3": k3_row, "ep": ep_row}
    if len(argv) != 4 or argv[0] not in rows:
        sys.exit(__doc__)
    print(rows[argv[0]](*argv[1:]))


if __name__ == "__main__":
    main(sys.argv[1:])
