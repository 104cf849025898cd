#!/usr/bin/env python3
"""Per-op breakdown of one profiled viaduct step (metrics.profile_step).

    python3 reference/profile_summary.py TRACE.json [--top 30] [--json OUT.json]

Reads the Chrome trace viaduct writes (<dump_folder>/profile/step-N-rank-R
.trace.json) and prints where the step's time goes:

  * with device kernels (CUDA build): device time per *source* -- the phase
    ("fwd", "bwd", "optim", "norm") and the op that launched the kernel: the
    outermost ATen op on the host in the forward and the optimizer, the
    autograd node (e.g. MmBackward0) in the backward -- then per kernel name,
    then ATen's glue (elementwise, copies, reductions) per source and kernel;
    device busy time against the step's wall time;
  * with device kernels and host ops recorded with their input shapes (as
    metrics.profile_step records them): the matmul kernels by the GEMM op
    that launched them and its shapes (aten::mm, addmm, bmm, baddbmm,
    _grouped_mm), with the multiply-adds the shapes imply and the rate
    the kernels ran at against --peak-tflops (989: an H100 or H200 SXM's
    dense bf16); matmul kernels of other ops count as "(no shapes)";
  * the device's idle time: before the first kernel, after the last, and the
    largest gaps between kernels, each with the host op the CPU was in when
    the gap began and the source of the kernel that ended it (in a
    device-only trace, metrics.profile_host_ops = false: the kernels before
    and after it);
  * without (Debian's CPU LibTorch records host ops only): host time of the
    outermost ops, the same way.

Standard library only.
"""

import argparse
import bisect
import collections
import json
import sys


def load(path):
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def is_kernel(e):
    return e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset")


def host_forest(ops):
    """For each host op, its chain of enclosing ops on the same thread."""
    by_tid = collections.defaultdict(list)
    for e in ops:
        by_tid[(e.get("pid"), e.get("tid"))].append(e)
    parent = {}
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack = []
        for e in evs:
            end = e["ts"] + e.get("dur", 0)
            while stack and stack[-1][1] < end - 1e-3 and stack[-1][1] <= e["ts"]:
                stack.pop()
            parent[id(e)] = stack[-1][0] if stack else None
            stack.append((e, end))
    return parent


def chain(e, parent):
    out = []
    while e is not None:
        out.append(e)
        e = parent.get(id(e))
    return out  # innermost first


def source_of(e, parent):
    """(phase, op) for a host op: the autograd node in the backward, else the
    outermost ATen op, with the viaduct:: scope as the phase."""
    c = chain(e, parent)
    phase = "fwd"
    for x in c:
        n = x.get("name", "")
        if n.startswith("viaduct::optimizer"):
            phase = "optim"
        elif n.startswith("viaduct::grad_norm"):
            phase = "norm"
    for x in c:
        n = x.get("name", "")
        if n.startswith("autograd::engine::evaluate_function: "):
            return "bwd", n.split(": ", 1)[1]
    scopes = ("viaduct::forward_backward", "viaduct::optimizer", "viaduct::grad_norm")
    aten = [x.get("name", "") for x in c
            if x.get("name", "").startswith(("aten::", "viaduct::"))
            and not x.get("name", "").startswith(scopes)]
    op = aten[-1] if aten else (c[0].get("name", "?") if c else "?")
    return phase, op


def kernel_class(name):
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n or "sdpa" in n:
        return "attention"
    if "gemm" in n or "xmma" in n or "cutlass" in n or "sm90" in n or "nvjet" in n:
        return "matmul"
    if "memcpy" in n or "memset" in n:
        return "copy"
    # viaduct's own kernels before the name rules below: its norm kernels
    # are not ATen's reductions.
    if "viaduct" in n:
        return "viaduct kernel"
    if "reduce" in n or "norm" in n:
        return "reduction"
    if "elementwise" in n or "vectorized" in n or "unrolled" in n or "foreach" in n:
        return "elementwise"
    return "other"


def glue_name(name):
    """A short name for an ATen glue kernel: its innermost functor where the
    name gives one (CUDAFunctor_add, direct_copy_kernel_cuda, MulFunctor, ...),
    else the kernel's own name, with the dtype when the name says it."""
    name = name.replace("(anonymous namespace)::", "")
    for marker in ("Functor", "_functor", "_kernel_cuda", "copy_kernel"):
        i = name.rfind(marker)  # the innermost: MulFunctor inside BinaryFunctor
        if i >= 0:
            j = i
            while j > 0 and (name[j - 1].isalnum() or name[j - 1] == "_"):
                j -= 1
            k = i + len(marker)
            while k < len(name) and (name[k].isalnum() or name[k] == "_"):
                k += 1
            short = name[j:k]
            break
    else:
        short = name.split("<")[0].split("(")[0].split("::")[-1][-50:] or name[:50]
    for dt in ("BFloat16", "float", "double", "long", "bool"):
        if dt in name:
            return f"{short} ({dt})"
    return short


def idle_gaps(kernels, ops, parent, t0, t1, by_ext, top, min_us=20.0):
    """Device idle intervals of the step (kernels overlap on streams: the
    union of their spans is what counts) and where the host was."""
    ks = sorted(kernels, key=lambda k: k["ts"])
    gaps = [(ks[0]["ts"] - t0, t0, None, ks[0])]
    end = ks[0]["ts"] + ks[0]["dur"]
    prev = ks[0]
    for k in ks[1:]:
        if k["ts"] - end >= min_us:
            gaps.append((k["ts"] - end, end, prev, k))
        if k["ts"] + k["dur"] > end:
            end, prev = k["ts"] + k["dur"], k
    gaps.append((t1 - end, end, prev, None))
    # The innermost host op open at a time point (any thread).
    def host_at(t):
        best = None
        for e in ops:
            if e["ts"] <= t < e["ts"] + e["dur"] and (best is None or e["ts"] >= best["ts"]):
                best = e
        return best
    def label(k):
        if k is None:
            return "-"
        if not ops:  # a device-only trace: the kernel itself
            return k["name"][:60]
        op = by_ext.get((k.get("args") or {}).get("External id"))
        phase, name = source_of(op, parent) if op is not None else ("?", "(no host op)")
        return f"{phase}: {name}"
    total = sum(g[0] for g in gaps)
    lines = [f"device idle {total / 1000:.2f} ms: {gaps[0][0] / 1000:.2f} before the first "
             f"kernel, {gaps[-1][0] / 1000:.2f} after the last, "
             f"{sum(g[0] for g in gaps[1:-1]) / 1000:.2f} in {len(gaps) - 2} gaps of "
             f">= {min_us:.0f} us", "",
             "| idle ms | at ms | host op when it began | kernel that ended it |",
             "|---|---|---|---|"]
    rows = []
    for dur, start, before, nxt in sorted(gaps, key=lambda g: -g[0])[:top]:
        h = host_at(start + 1e-3)
        if ops:
            hname = h.get("name", "?")[:60] if h else "(no host op)"
        else:  # a device-only trace (metrics.profile_host_ops = false)
            hname = "after " + (before["name"][:54] if before else "the start")
        lines.append(f"| {dur / 1000:.3f} | {(start - t0) / 1000:.1f} | {hname} | {label(nxt)} |")
        rows.append({"idle_us": dur, "at_us": start - t0, "host": hname, "next": label(nxt)})
    return "\n".join(lines), total, rows


def gemm_shape(op):
    """(label, flops) of a GEMM op from its recorded input shapes, or None:
    aten::mm [M, K] x [K, N]; addmm's and _addmm_activation's second and
    third inputs; bmm [B, M, K] x [B, K, N] and baddbmm's second and third;
    _grouped_mm [M, K] x [G, K, N] (the tokens of G groups, each against
    its own weight), [K, M] x [M, N] (the weights' gradients: G outputs of
    [K, N] over the groups' rows) or [G, M, K] x [G, K, N]."""
    name = op.get("name", "")
    dims = (op.get("args") or {}).get("Input Dims")
    if not dims:
        return None
    try:
        if name == "aten::mm":
            a, b = dims[0], dims[1]
        elif name in ("aten::addmm", "aten::_addmm_activation", "aten::baddbmm"):
            a, b = dims[1], dims[2]
        elif name in ("aten::bmm", "aten::_grouped_mm"):
            a, b = dims[0], dims[1]
        else:
            return None
        batch, groups = 1, ""
        if len(a) == 2 and len(b) == 2:
            (m, k), (k2, n) = a, b
        elif len(a) == 2 and len(b) == 3:  # grouped: each row meets one group's weight
            (m, k), (g, k2, n) = a, b
            groups = f", {g} groups"
        elif len(a) == 3 and len(b) == 3:
            (batch, m, k), (_, k2, n) = a, b
        else:
            return None
        if k != k2:
            return None
    except (TypeError, ValueError):
        return None
    shape = f"{m}x{k} . {k}x{n}" if batch == 1 else f"{batch} x ({m}x{k} . {k}x{n})"
    return f"{name} {shape}{groups}", 2.0 * batch * m * k * n


def gemm_table(gemms, peak_tflops, top):
    """The GEMMs by op and shape: device ms, calls, TFLOP/s and % of peak."""
    total_us = sum(t for t, _, _ in gemms.values())
    shaped = {k: v for k, v in gemms.items() if v[2] > 0}
    flops = sum(f for _, _, f in shaped.values())
    shaped_us = sum(t for t, _, _ in shaped.values())
    lines = [f"| GEMM (source / op and shapes) | ms | calls | TFLOP/s | % of {peak_tflops:g} |",
             "|---|---|---|---|---|"]
    for key, (t, n, f) in sorted(gemms.items(), key=lambda kv: -kv[1][0])[:top]:
        rate = f / t / 1e6 if f > 0 and t > 0 else 0.0
        cells = (f"{rate:.0f}", f"{100 * rate / peak_tflops:.0f}") if f > 0 else ("-", "-")
        lines.append(f"| {key} | {t / 1000:.3f} | {n} | {cells[0]} | {cells[1]} |")
    rate = flops / shaped_us / 1e6 if shaped_us > 0 else 0.0
    lines.append(f"\nmatmul kernels {total_us / 1000:.2f} ms; with shapes {shaped_us / 1000:.2f} ms "
                 f"for {flops / 1e12:.2f} TFLOP: {rate:.0f} TFLOP/s, "
                 f"{100 * rate / peak_tflops:.0f}% of {peak_tflops:g}")
    return "\n".join(lines), {"matmul_us": total_us, "shaped_us": shaped_us, "flops": flops,
                              "rows": {k: list(v) for k, v in gemms.items()}}


def table(rows, total, top, head):
    lines = [f"| {head} | ms | % | calls |", "|---|---|---|---|"]
    for key, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {key} | {t / 1000:.3f} | {100 * t / total:.1f} | {n} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", help="also write the aggregates here")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="the device's dense peak for the GEMM table's percentages")
    a = ap.parse_args()
    events = [e for e in load(a.trace) if e.get("ph") == "X" and "dur" in e]
    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "Operator")]
    kernels = [e for e in events if is_kernel(e)]
    parent = host_forest(ops)
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    wall = t1 - t0
    out = {"wall_us": wall}
    if kernels:
        by_ext = {}
        for e in ops:
            ext = (e.get("args") or {}).get("External id")
            if ext is not None:
                by_ext.setdefault(ext, e)
        busy = sum(k["dur"] for k in kernels)
        src = collections.defaultdict(lambda: [0.0, 0])
        names = collections.defaultdict(lambda: [0.0, 0])
        classes = collections.defaultdict(lambda: [0.0, 0])
        phases = collections.defaultdict(lambda: [0.0, 0])
        glue = collections.defaultdict(lambda: [0.0, 0])  # ATen's glue kernels by source
        gemms = collections.defaultdict(lambda: [0.0, 0, 0.0])  # time, op calls, flops
        gemm_ops = set()  # the External ids of the GEMM ops counted
        for k in kernels:
            ext = (k.get("args") or {}).get("External id")
            op = by_ext.get(ext)
            phase, name = source_of(op, parent) if op is not None else ("?", "(no host op)")
            cls = kernel_class(k["name"])
            keyed = [(src, f"{phase}: {name}"), (names, k["name"][:90]), (classes, cls),
                     (phases, phase)]
            if cls in ("elementwise", "copy", "reduction"):
                # autograd's gradient sums run inside the node that produced
                # the gradient: this table names where such glue comes from.
                node = name.replace("torch::autograd::CppNode<", "").rstrip(">")
                node = node.replace("(anonymous namespace)::", "")
                keyed.append((glue, f"{phase}: {node[:60]} / {glue_name(k['name'])}"))
            for d, key in keyed:
                d[key][0] += k["dur"]
                d[key][1] += 1
            if cls == "matmul" and op is not None:
                shape = gemm_shape(op)
                key = f"{phase}: {name} / {shape[0]}" if shape else f"{phase}: {name} (no shapes)"
                g = gemms[key]
                g[0] += k["dur"]
                if ext not in gemm_ops:  # an op's multiply-adds once, however many kernels
                    gemm_ops.add(ext)
                    g[1] += 1
                    if shape:
                        g[2] += shape[1]
        print(f"step wall {wall / 1000:.1f} ms; device busy {busy / 1000:.1f} ms "
              f"({100 * busy / wall:.1f}%), {len(kernels)} kernels\n")
        print(table(phases, busy, a.top, "phase"), "\n")
        print(table(classes, busy, a.top, "kernel class"), "\n")
        print(table(src, busy, a.top, "source (phase: op)"), "\n")
        print(table(names, busy, a.top, "kernel"), "\n")
        print(table(glue, busy, a.top, "ATen glue kernel by source (phase: op / kernel)"), "\n")
        if gemms:
            text, gemm_out = gemm_table(gemms, a.peak_tflops, a.top)
            print(text, "\n")
            out.update(gemms=gemm_out)
        text, idle, gap_rows = idle_gaps(kernels, ops, parent, t0, t1, by_ext, min(a.top, 15))
        print(text)
        out.update(idle_us=idle, gaps=gap_rows)
        out.update(busy_us=busy, phases=phases, classes=classes, sources=src, kernels=names,
                   glue=glue)
    else:
        top_level = collections.defaultdict(lambda: [0.0, 0])
        for e in ops:
            if not e.get("name", "").startswith("aten::"):
                continue
            c = chain(e, parent)
            if any(x.get("name", "").startswith("aten::") for x in c[1:]):
                continue  # not outermost
            phase, name = source_of(e, parent)
            top_level[f"{phase}: {name}"][0] += e["dur"]
            top_level[f"{phase}: {name}"][1] += 1
        busy = sum(t for t, _ in top_level.values())
        print(f"step wall {wall / 1000:.1f} ms; host time in outermost ATen ops "
              f"{busy / 1000:.1f} ms (no device kernels in this trace)\n")
        print(table(top_level, busy, a.top, "source (phase: op)"))
        out.update(host_us=busy, sources=top_level)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
