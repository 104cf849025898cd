#!/usr/bin/env python3
"""How smoothly a run's loss falls, from its metrics.jsonl.

For every step after --after, the rise of the loss over its running mean
before that step (an exponential mean with --decay, started at the first
step's loss): loss / mean - 1. Prints the largest rise and its step, the
loss and eval losses at a few steps, and exits 1 when the largest rise is
above --max-rise. The run report marks the same rises as loss spikes
(metrics.loss_spike_factor = 1 + the rise it allows).

  python3 scripts/check_loss_curve.py outputs/llama_debug/metrics.jsonl
"""
import argparse
import json
import sys


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", help="a run's metrics.jsonl")
    p.add_argument("--after", type=int, default=20, help="first step checked is after this one")
    p.add_argument("--decay", type=float, default=0.9, help="the running mean's decay")
    p.add_argument("--max-rise", type=float, default=0.35,
                   help="largest allowed loss / running mean - 1")
    a = p.parse_args()

    losses, evals = {}, {}
    with open(a.metrics) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            j = json.loads(line)
            if "loss" in j:
                losses[j["step"]] = j["loss"]
            if "eval_loss" in j:
                evals[j["step"]] = j["eval_loss"]
    if not losses:
        sys.exit(f"{a.metrics}: no step records")

    mean, worst, worst_step, over = None, -1.0, None, []
    for step in sorted(losses):
        loss = losses[step]
        if mean is not None and step > a.after:
            rise = loss / mean - 1
            if rise > worst:
                worst, worst_step = rise, step
            if rise > a.max_rise:
                over.append(step)
        mean = loss if mean is None else a.decay * mean + (1 - a.decay) * loss

    steps = sorted(losses)
    print(f"{a.metrics}: {len(steps)} steps, loss {losses[steps[0]]:.4f} at step {steps[0]} "
          f"-> {losses[steps[-1]]:.4f} at step {steps[-1]}")
    if evals:
        print("eval loss: " + ", ".join(f"{evals[s]:.4f} at step {s}" for s in sorted(evals)))
    if worst_step is None:
        print(f"no step after step {a.after}")
        return 0
    print(f"largest rise over the running mean (decay {a.decay}) after step {a.after}: "
          f"{100 * worst:+.1f}% at step {worst_step} (allowed {100 * a.max_rise:+.0f}%)")
    if over:
        print(f"steps above it: {over}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
