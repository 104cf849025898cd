#!/usr/bin/env python3
"""Device time per kernel class of profiled training steps, side by side.

    python3 bench/speed/kernel_classes.py \\
        --trace viaduct=VD.trace.json --trace compile=PEER.trace.json \\
        [--wall viaduct=MS --wall compile=MS] [--note viaduct="..."] \\
        [--top 15] [--json OUT.json]

Each --trace is one step's Chrome trace: viaduct's metrics.profile_step
(<dump_folder>/profile/step-N-rank-0.trace.json) or the PyTorch peer's
--profile-step (reference/torch_llama.py). Both are read the same way and
every kernel is put in a class by its name alone, with the one classifier
below (kernel_class), so the two columns count the same things:

  GEMMs, attention, norms, rope, SwiGLU, loss, optimizer (the gradient norm,
  the clip and AdamW), embedding, copies/elementwise (ATen's elementwise,
  copy, fill and reduction kernels, memcpy and memset, and Triton kernels
  that hold none of the other classes' ops), other (no rule matched).

Triton kernels from inductor are named by the ATen ops they fuse
(triton_poi_fused_add_mul_..., triton_red_fused_..., triton_per_fused_...):
such a kernel is put in the class of the first of loss, norm, SwiGLU, rope,
embedding whose op it contains, so a norm fused with its residual add counts
as a norm. The top fused kernels are listed on their own, with their class,
to show what compile fuses.

Per trace: busy (the union of the kernels' spans, so overlapping streams
count once), the span from the first kernel's start to the last one's end,
idle = span - busy, and the kernel count. --wall gives the unprofiled step
time to print beside them (the profiled step is slower by the profiler's
cost). Standard library only.
"""

import argparse
import collections
import json
import re
import sys

CLASSES = ["GEMMs", "attention", "norms", "rope", "SwiGLU", "loss", "optimizer",
           "embedding", "copies/elementwise", "other"]

# Op names inside an inductor kernel's name, in the order they decide.
TRITON_RULES = [
    ("loss", ("log_softmax", "nll_loss", "cross_entropy")),
    ("norms", ("rsqrt", "mean", "pow", "layer_norm")),
    ("SwiGLU", ("silu", "sigmoid")),
    ("rope", ("stack", "select", "unbind", "view_as_complex", "view_as_real")),
    ("embedding", ("embedding",)),
]

# Library and hand-written kernels, in the order they decide. The optimizer
# comes before the norms (LpNorm / NormTwo are the gradient norm), attention
# before the GEMMs (cuDNN's attention kernels carry sm90 in their names).
NAME_RULES = [
    ("optimizer", ("adam", "multi_tensor_apply", "foreach", "lpnorm", "normtwo",
                   "norm_two", "clip_scale", "clip_kernel")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn_fwd", "attn_bwd",
                   "cudnn::fusion", "dot_do_o", "convert_dq")),
    ("GEMMs", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "splitk", "gemv",
               "sm90_", "sm80_", "ampere_", "wgmma")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss", "softmax")),
    ("norms", ("rms_norm", "rmsnorm", "layer_norm", "layernorm")),
    ("rope", ("rope", "rotary")),
    ("SwiGLU", ("swiglu", "silu")),
    ("embedding", ("embedding", "indexselect", "index_select", "krn_partials_per_segment",
                   "compute_grad_weight", "sum_and_scatter", "radixsort", "radix_sort",
                   "segment_offsets", "partial_segment")),
    ("copies/elementwise", ("memcpy", "memset", "elementwise", "vectorized", "unrolled",
                            "copy", "fill", "reduce_kernel", "cat", "index", "transpose",
                            "where", "distribution", "scatter", "gather")),
]


def is_triton(name):
    return name.startswith("triton_")


def triton_ops(name):
    """The fused op names of an inductor kernel: 'triton_red_fused__to_copy_add_mean_3'
    -> '_to_copy_add_mean'."""
    m = re.match(r"triton_[a-z]+_fused_?(.*?)(_\d+)?$", name)
    return m.group(1) if m else name


def kernel_class(name):
    n = name.lower()
    if is_triton(n):
        if n.startswith(("triton_tem_", "triton_mm")):  # max-autotune's GEMM templates
            return "GEMMs"
        ops = triton_ops(n)
        for cls, keys in TRITON_RULES:
            if any(k in ops for k in keys):
                return cls
        return "copies/elementwise"
    for cls, keys in NAME_RULES:
        if any(k in n for k in keys):
            return cls
    return "other"


def fused_group(name):
    """A kernel's name without inductor's trailing index (kernels fusing the
    same ops count together) and without a launch's argument list."""
    if is_triton(name):
        return re.sub(r"_\d+$", "", name)
    if name.endswith(")"):  # 'void ns::(anonymous namespace)::f<...>(args)'
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    return name.replace("(anonymous namespace)::", "")[:110]


def load_kernels(path):
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    cats = ("kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset")
    return [e for e in events
            if e.get("ph") == "X" and "dur" in e and e.get("cat") in cats]


def summarize(path, top):
    ks = sorted(load_kernels(path), key=lambda k: k["ts"])
    if not ks:
        raise SystemExit(f"kernel_classes: {path} holds no device kernels "
                         "(a host-only trace?)")
    classes = {c: [0.0, 0] for c in CLASSES}
    groups = collections.defaultdict(lambda: [0.0, 0, ""])
    for k in ks:
        cls = kernel_class(k["name"])
        c = classes[cls]
        c[0] += k["dur"]
        c[1] += 1
        g = groups[fused_group(k["name"])]
        g[0] += k["dur"]
        g[1] += 1
        g[2] = cls
    busy, end = 0.0, ks[0]["ts"]
    for k in ks:  # union of the spans
        s, e = max(k["ts"], end), k["ts"] + k["dur"]
        if e > s:
            busy += e - s
        end = max(end, e)
    span = end - ks[0]["ts"]
    kernel_sum = sum(k["dur"] for k in ks)
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {
        "trace": path,
        "kernels": len(ks),
        "span_us": span,
        "busy_us": busy,
        "idle_us": span - busy,
        "kernel_sum_us": kernel_sum,
        "classes": classes,
        "top_fused": [(n, cls, t, c) for n, (t, c, cls) in ranked if is_triton(n)][:top],
        "top_other": [(n, cls, t, c) for n, (t, c, cls) in ranked
                      if cls not in ("GEMMs", "attention")][:top],
        "top_gemm_attention": [(n, cls, t, c) for n, (t, c, cls) in ranked
                               if cls in ("GEMMs", "attention")][:top],
        "unclassified": [(n, t, c) for n, (t, c, cls) in ranked if cls == "other"][:top],
    }


def ms(us):
    return f"{us / 1000:.2f}"


def side_by_side(runs, walls, notes):
    names = list(runs)
    head = "| class | " + " | ".join(f"{n} ms | {n} kernels" for n in names)
    if len(names) == 2:
        head += f" | {names[0]} − {names[1]} ms"
    lines = [head + " |", "|" + "---|" * (1 + 2 * len(names) + (len(names) == 2))]

    def row(label, vals, counts, diff=True):
        cells = [f"{v} | {c}" for v, c in zip(vals, counts)]
        line = f"| {label} | " + " | ".join(cells)
        if len(names) == 2:
            line += " | " + (f"{(vals_us[0] - vals_us[1]) / 1000:+.2f}" if diff else "")
        return line + " |"

    for c in CLASSES:
        vals_us = [runs[n]["classes"][c][0] for n in names]
        if not any(vals_us) and c == "other":
            continue
        lines.append(row(c, [ms(v) for v in vals_us],
                         [runs[n]["classes"][c][1] for n in names]))
    vals_us = [runs[n]["busy_us"] for n in names]
    lines.append(row("**device busy**", [f"**{ms(v)}**" for v in vals_us],
                     [runs[n]["kernels"] for n in names]))
    vals_us = [runs[n]["idle_us"] for n in names]
    lines.append(row("idle (in the span)", [ms(v) for v in vals_us], [""] * len(names)))
    vals_us = [runs[n]["span_us"] for n in names]
    lines.append(row("span: first kernel to last", [ms(v) for v in vals_us],
                     [""] * len(names)))
    if walls:
        vals_us = [walls.get(n, float("nan")) * 1000 for n in names]  # ms -> us
        lines.append(row("step wall, unprofiled (median)", [ms(v) for v in vals_us],
                         [""] * len(names)))
    lines.append("")
    for n in names:
        if n in notes:
            lines.append(f"- {n}: {notes[n]}")
    return "\n".join(lines)


def kernel_list(title, rows):
    lines = [f"{title}", "", "| kernel | class | ms | calls |", "|---|---|---|---|"]
    for n, c, t, k in rows:
        lines.append(f"| `{n}` | {c} | {ms(t)} | {k} |")
    return "\n".join(lines)


def parse_pairs(items, what):
    out = {}
    for it in items or []:
        if "=" not in it:
            raise SystemExit(f"kernel_classes: {what} '{it}' is not NAME=VALUE")
        k, v = it.split("=", 1)
        out[k] = v
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", action="append", required=True, help="NAME=TRACE.json")
    ap.add_argument("--wall", action="append", help="NAME=unprofiled step ms")
    ap.add_argument("--note", action="append", help="NAME=text (clocks) for the table")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", help="also write the summaries here")
    a = ap.parse_args()
    traces = parse_pairs(a.trace, "--trace")
    walls = {k: float(v) for k, v in parse_pairs(a.wall, "--wall").items()}  # ms
    notes = parse_pairs(a.note, "--note")
    runs = {n: summarize(p, a.top) for n, p in traces.items()}
    print(side_by_side(runs, walls, notes))
    for n, r in runs.items():
        print()
        if r["top_fused"]:
            print(kernel_list(f"{n}: top inductor (Triton) kernels, by name less the index",
                              r["top_fused"]))
            print()
        print(kernel_list(f"{n}: top GEMM and attention kernels", r["top_gemm_attention"]))
        print()
        print(kernel_list(f"{n}: top kernels other than GEMMs and attention", r["top_other"]))
        if r["unclassified"]:
            print()
            print(kernel_list(f"{n}: kernels no rule classified",
                              [(x, "other", t, c) for x, t, c in r["unclassified"]]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "walls_ms": walls, "notes": notes}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
