#!/usr/bin/env python3
"""PyTorch reference of viaduct's models, for the side-by-side benchmark.

Loads the weights of a viaduct checkpoint (`<folder>/step-<N>/`), reads the
model family and shape and the training settings from its metadata.json (the
effective job config viaduct saved), trains on the same token windows
viaduct's sampler hands out, and reports tokens/s, MFU, peak device memory and
the per-step losses -- in eager mode or under torch.compile.

The models (llama, gpt2, kimi_k3 with or without AttnRes) are in
torch_models.py, viaduct's op for op; the family is the checkpoint's
model.family. This file is the one driver of all of them: config, data,
checkpoint, training, timing and the report. For llama, for example:
  - fp32 master parameters; the embedding output is cast to bf16; every
    linear casts its fp32 weight to the activation dtype;
  - RMSNorm in fp32 (x * rsqrt(mean(x^2) + eps) * w), returning the input
    dtype; RoPE on interleaved pairs (x[2i], x[2i+1]) with fp64 tables
    cast to fp32 at use, as viaduct does (--rope-dtype float64 keeps them,
    the rotation then runs in fp64 by promotion);
  - GQA by repeat_interleave of K/V over heads, causal SDPA; SwiGLU
    w2(silu(w1 x) * w3 x); final RMSNorm; untied lm_head;
  - loss = summed token cross-entropy over fp32 logits, backward of
    loss / (tokens of the step).
The optimizer step is viaduct's (src/train/optimizer.cpp, trainer.cpp):
global-norm clipping (coef = max_norm / (norm + 1e-6) when < 1), AdamW with
decoupled decay on params with dim >= 2 except embeddings, bias corrections,
lr_at's warmup + cosine/linear/constant schedule, then the model's
after-step hook (kimi_k3: the MoE balancing bias). By default torch's fused
AdamW and clip_grad_norm_ (the same formulas, the fast kernels a PyTorch user
would run); --optimizer-impl exact runs viaduct's per-tensor loop instead.

FLOPs per token are viaduct's formula for the family (describe_model), e.g.
llama's Note [FLOPs per token] in src/model/chain_transformer.cpp:
  6 * (L * (2 D^2 + 2 D * kv_dim + 3 D F) + V * D) + 12 * L * D * T
and MFU = flops_per_token * tokens/s / peak (989.4e12, H100/H200 dense bf16).

Three commands:
  torch_llama.py --checkpoint DIR/step-0 [--mode eager|compile] [--device cpu] [...]
  torch_llama.py report --viaduct-metrics M.jsonl --peer A.json ... --out R.md
  torch_llama.py overhead --name N --with A/metrics.jsonl --without B/metrics.jsonl

Only the standard library is needed for parsing (tests run without torch).
On torch 1.13 (CPU) eager mode runs; torch.compile, fused AdamW and foreach
clipping need 2.x (see --optimizer-impl).
"""

import argparse
import array
import datetime
import glob
import json
import math
import os
import statistics
import struct
import sys
import time
from dataclasses import asdict, dataclass

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_models import cfg_get, fail, flops_per_token, spec_from_config  # noqa: E402
import torch_models  # noqa: E402

torch = torch_models.torch  # None without torch: parsing and the report still work

PEAK_BF16_FLOPS = 989.4e12  # H100 / H200 SXM, dense bf16 (src/core/device.cpp)


def print_steps(start_step, losses, grad_norms, lrs, step_s):
    """The first steps' lines of a run's report, and a warning if a loss is
    not finite (shared by the single-GPU and the pipeline reference)."""
    for i, (l, g) in enumerate(zip(losses[:5], grad_norms)):
        print(f"step {start_step + i + 1:5d} | loss {l:.9g} | grad_norm {g:.6g} | "
              f"lr {lrs[i]:.3e} | {step_s[i] * 1e3:.1f} ms")
    if not all(math.isfinite(l) for l in losses):
        print("warning: a loss is not finite", file=sys.stderr)


# --------------------------------------------------------------- config


def parse_config_toml(text):
    if tomllib is None:
        fail("reading the checkpoint's config needs Python 3.11+ (tomllib)")
    return tomllib.loads(text)


@dataclass
class TrainSettings:
    steps: int  # training.steps (the LR schedule's total)
    seq_len: int
    batch_size: int
    grad_accum: int
    microbatches: int
    max_norm: float
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    optimizer: str
    warmup: int
    decay_type: str
    min_lr_factor: float
    seed: int
    data_path: str
    data_format: str
    shuffle: bool


def train_settings_from_config(cfg, single_process=True):
    """single_process: note that a pp/dp checkpoint is replayed in one process
    (bench/multi_gpu/torch_pipeline.py, which runs the pipeline, passes
    False)."""
    pp = cfg_get(cfg, "parallelism.pipeline_parallel_degree", 1)
    dp = cfg_get(cfg, "parallelism.data_parallel_degree", 1)
    if single_process and (pp != 1 or dp != 1):
        print(f"note: the checkpoint was written by a pp={pp} x dp={dp} run; "
              "the reference runs one process with the same global batch "
              "per dp rank = local_batch_size", file=sys.stderr)
    return TrainSettings(
        steps=cfg_get(cfg, "training.steps", 200),
        seq_len=cfg_get(cfg, "training.seq_len", 128),
        batch_size=cfg_get(cfg, "training.local_batch_size", 8),
        grad_accum=cfg_get(cfg, "training.gradient_accumulation_steps", 1),
        microbatches=cfg_get(cfg, "parallelism.pipeline_parallel_microbatches", 1),
        max_norm=float(cfg_get(cfg, "training.max_norm", 1.0)),
        lr=float(cfg_get(cfg, "optimizer.lr", 8e-4)),
        beta1=float(cfg_get(cfg, "optimizer.beta1", 0.9)),
        beta2=float(cfg_get(cfg, "optimizer.beta2", 0.95)),
        eps=float(cfg_get(cfg, "optimizer.eps", 1e-8)),
        weight_decay=float(cfg_get(cfg, "optimizer.weight_decay", 0.1)),
        optimizer=cfg_get(cfg, "optimizer.name", "AdamW"),
        warmup=cfg_get(cfg, "lr_scheduler.warmup_steps", 20),
        decay_type=cfg_get(cfg, "lr_scheduler.decay_type", "cosine"),
        min_lr_factor=float(cfg_get(cfg, "lr_scheduler.min_lr_factor", 0.1)),
        seed=cfg_get(cfg, "training.seed", 42),
        data_path=cfg_get(cfg, "data.path", "data/fortunes.tok"),
        data_format=cfg_get(cfg, "data.format", "auto"),
        shuffle=bool(cfg_get(cfg, "data.shuffle", False)),
    )


def lr_at(ts, step):
    """src/train/optimizer.cpp lr_at(); step is 1-based."""
    if ts.warmup > 0 and step <= ts.warmup:
        return ts.lr * step / ts.warmup
    if ts.decay_type == "constant" or ts.steps <= ts.warmup:
        return ts.lr
    progress = min(max((step - ts.warmup) / (ts.steps - ts.warmup), 0.0), 1.0)
    f = ts.min_lr_factor
    if ts.decay_type == "cosine":
        factor = f + (1.0 - f) * 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        factor = 1.0 - (1.0 - f) * progress
    return ts.lr * factor




# ----------------------------------------------------------- token files
# src/data/token_file.h: viaduct (128-byte header), llm.c shards, raw u16/u32.

VIADUCT_MAGIC = b"VIADTOK\0"
LLMC_MAGIC, LLMC_MAGIC_LLAMA3 = 20240520, 20240801


def _typecode(nbytes):
    for code in ("H", "I", "L") if nbytes == 2 else ("I", "L"):
        if array.array(code).itemsize == nbytes:
            return code
    fail(f"no array typecode of {nbytes} bytes")


class TokenFile:
    def __init__(self, path, fmt="auto"):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(1024)
        if fmt == "auto":
            if head[:8] == VIADUCT_MAGIC:
                fmt = "viaduct"
            elif len(head) >= 8 and struct.unpack_from("<i", head)[0] in (
                    LLMC_MAGIC, LLMC_MAGIC_LLAMA3):
                fmt = "llmc"
            elif path.endswith(".u16"):
                fmt = "uint16"
            elif path.endswith(".u32"):
                fmt = "uint32"
            else:
                fail(f"token file '{path}': no viaduct or llm.c magic and no "
                     ".u16/.u32 extension; name the format")
        self.vocab_size = 0
        if fmt == "viaduct":
            if size < 128 or head[:8] != VIADUCT_MAGIC:
                fail(f"token file '{path}': not a viaduct token file")
            version, bpt, count, vocab = struct.unpack_from("<IIQQ", head, 8)
            # Version 2 adds the document marker at [96, 105) (unused here).
            if version not in (1, 2) or bpt not in (2, 4):
                fail(f"token file '{path}': version {version}, {bpt} bytes/token")
            if size != 128 + count * bpt:
                fail(f"token file '{path}': header says {count} tokens but the "
                     f"file has {size} bytes")
            self.offset, self.bpt, self.size, self.vocab_size = 128, bpt, count, vocab
        elif fmt == "llmc":
            magic, version, count = struct.unpack_from("<iii", head, 0)
            bpt = 2 if magic == LLMC_MAGIC else 4
            if (magic, version) not in ((LLMC_MAGIC, 1), (LLMC_MAGIC_LLAMA3, 7)):
                fail(f"token file '{path}': llm.c magic {magic} version {version}")
            if size != 1024 + count * bpt:
                fail(f"token file '{path}': header says {count} tokens but the "
                     f"file has {size} bytes")
            self.offset, self.bpt, self.size = 1024, bpt, count
        elif fmt in ("uint16", "uint32"):
            bpt = 2 if fmt == "uint16" else 4
            if size % bpt:
                fail(f"token file '{path}': {size} bytes is no whole number of "
                     f"{bpt}-byte tokens")
            self.offset, self.bpt, self.size = 0, bpt, size // bpt
        else:
            fail(f"unknown data.format '{fmt}'")
        self.format = fmt

    def read(self, start, count):
        """Tokens [start, start + count) as an array of unsigned ints."""
        assert 0 <= start and start + count <= self.size
        out = array.array(_typecode(self.bpt))
        with open(self.path, "rb") as f:
            f.seek(self.offset + start * self.bpt)
            out.frombytes(f.read(count * self.bpt))
        if sys.byteorder != "little":
            out.byteswap()
        return out

    def max_token(self):
        m, chunk, i = 0, 1 << 22, 0
        while i < self.size:
            n = min(chunk, self.size - i)
            m = max(m, max(self.read(i, n)))
            i += n
        return m


class TokenStream:
    """Several token files read as one stream, in sorted-glob order."""

    def __init__(self, spec, fmt="auto"):
        paths = sorted(glob.glob(spec)) if any(c in spec for c in "*?[") else [spec]
        if not paths:
            fail(f"data path '{spec}' matches no file")
        for p in paths:
            if not os.path.isfile(p):
                fail(f"token file '{p}' does not exist (run from the repo root, "
                     "or pass --data)")
        self.files = [TokenFile(p, fmt) for p in paths]
        self.starts, n = [], 0
        for f in self.files:
            self.starts.append(n)
            n += f.size
        self.size = n

    def read(self, start, count):
        out = array.array("q")
        for f, s in zip(self.files, self.starts):
            lo, hi = max(start, s), min(start + count, s + f.size)
            if lo < hi:
                out.fromlist(f.read(lo - s, hi - lo).tolist())
        assert len(out) == count
        return out

    def max_token(self):
        return max(f.max_token() for f in self.files)


# ------------------------------------------------------------- sampler
# src/data/sampler.cpp: Note [Windows and the data cursor], one dp rank.

M64 = (1 << 64) - 1


class SplitMix64:
    def __init__(self, state):
        self.state = state & M64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & M64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    def below(self, bound):
        m = self.next() * bound
        low = m & M64
        if low < bound:
            threshold = ((-bound) & M64) % bound
            while low < threshold:
                m = self.next() * bound
                low = m & M64
        return m >> 64


class TokenSampler:
    def __init__(self, stream, batch_size, seq_len, seed=0, shuffle=False,
                 epoch=0, position=0):
        self.stream, self.B, self.T = stream, batch_size, seq_len
        self.seed, self.shuffle = seed, shuffle
        self.num_windows = (stream.size - 1) // seq_len if stream.size > 0 else 0
        if self.num_windows < batch_size:
            fail(f"the data has {stream.size} tokens: {self.num_windows} windows "
                 f"of seq_len {seq_len}, fewer than one batch of {batch_size}")
        self.epoch, self.position = epoch, position
        self._order_epoch, self._order = -1, None

    def _load_epoch(self, epoch):
        if self._order_epoch == epoch:
            return
        self._order_epoch, self._order = epoch, None
        if not self.shuffle:
            return
        order = list(range(self.num_windows))
        seeder = SplitMix64(self.seed ^ ((0xD1B54A32D192ED03 * (epoch + 1)) & M64))
        rng = SplitMix64(seeder.next())
        for i in range(self.num_windows - 1, 0, -1):
            j = rng.below(i + 1)
            order[i], order[j] = order[j], order[i]
        self._order = order

    def window_at(self, epoch, index):
        self._load_epoch(epoch)
        return index if self._order is None else self._order[index]

    def next_windows(self):
        if self.position + self.B > self.num_windows:
            self.epoch += 1
            self.position = 0
        ids = [self.window_at(self.epoch, self.position + b) for b in range(self.B)]
        self.position += self.B
        return ids

    def next(self):
        """Flat int64 array [B, T + 1]: row b = tokens [w T, w T + T]."""
        buf = array.array("q")
        for w in self.next_windows():
            buf.extend(self.stream.read(w * self.T, self.T + 1))
        return buf


# ---------------------------------------------------------- safetensors

SAFETENSORS_DTYPES = {  # name -> (bytes, torch dtype name)
    "F64": (8, "float64"), "F32": (4, "float32"), "F16": (2, "float16"),
    "BF16": (2, "bfloat16"), "I64": (8, "int64"), "I32": (4, "int32"),
    "I16": (2, "int16"), "I8": (1, "int8"), "U8": (1, "uint8"), "BOOL": (1, "bool"),
}


def read_safetensors_header(path):
    """(entries {name: (dtype, shape, begin, end)}, metadata, data_start)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            fail(f"'{path}' is shorter than the 8-byte safetensors header length")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            fail(f"'{path}': header length {n} does not fit the file of {size} bytes")
        header = json.loads(f.read(n))
    metadata = header.pop("__metadata__", {}) or {}
    entries = {}
    for name, e in header.items():
        dtype, shape, (begin, end) = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in SAFETENSORS_DTYPES:
            fail(f"'{path}': tensor '{name}' has unknown dtype {dtype}")
        numel = 1
        for d in shape:
            numel *= d
        if numel * SAFETENSORS_DTYPES[dtype][0] != end - begin or end > size - 8 - n:
            fail(f"'{path}': tensor '{name}' ({dtype} {shape}) has a bad byte range "
                 f"[{begin}, {end})")
        entries[name] = (dtype, list(shape), begin, end)
    return entries, metadata, 8 + n


def load_safetensors(path, names, device):
    """{name: tensor on device} for the requested names (torch required)."""
    entries, _, data_start = read_safetensors_header(path)
    out = {}
    with open(path, "rb") as f:
        for name in names:
            dtype, shape, begin, end = entries[name]
            buf = bytearray(end - begin)
            f.seek(data_start + begin)
            if f.readinto(buf) != len(buf):
                fail(f"'{path}': tensor '{name}' is truncated")
            t = torch.frombuffer(buf, dtype=getattr(torch, SAFETENSORS_DTYPES[dtype][1]))
            out[name] = t.reshape(shape).to(device)
    return out


def open_checkpoint(step_dir):
    meta_path = os.path.join(step_dir, "metadata.json")
    if not os.path.isfile(meta_path):
        fail(f"'{meta_path}' does not exist (pass --checkpoint <folder>/step-<N>)")
    with open(meta_path) as f:
        meta = json.load(f)
    model_files = [r["name"] for r in meta.get("files", [])
                   if r["name"].startswith("model")]
    if model_files != ["model.safetensors"]:
        fail(f"{step_dir}: expected one model.safetensors (a pp=1 save), found "
             f"{model_files}")
    return meta, os.path.join(step_dir, "model.safetensors")




def check_shapes(model, entries, allow_extra=False):
    """Every parameter and persistent buffer of the model against the
    checkpoint; returns the names to load, in registration order.
    allow_extra: the model is one pipeline stage, the checkpoint holds more."""
    want = {n: list(p.shape) for n, p in model.named_parameters()}
    want.update({n: list(b.shape) for n, b in model.named_buffers()
                 if b is not None and n.rsplit(".", 1)[-1] not in
                 ("rope_cos", "rope_sin")})
    for name, shape in want.items():
        if name not in entries:
            fail(f"the checkpoint has no tensor '{name}'")
        if entries[name][1] != shape:
            fail(f"tensor '{name}' is {entries[name][1]} in the checkpoint, the "
                 f"config's shape says {shape}")
    extra = sorted(set(entries) - set(want))
    if extra and not allow_extra:
        fail(f"the checkpoint holds tensors this {model.spec.family} lacks: {extra[:5]}")
    return list(want)


def parameter_count(entries):
    """Parameters in the checkpoint (its buffers, e.g. MoE biases, left out)."""
    n = 0
    for name, (_, shape, _, _) in entries.items():
        if not name.endswith("expert_bias"):
            n += math.prod(shape)
    return n


# --------------------------------------------------------------- training


def build_model(spec, ckpt_file, entries, device, compute_dtype, rope_dtype):
    if torch_models.TORCH2:  # no host copy of the weights before the load
        with torch.device("meta"):
            model = torch_models.make_model(spec, compute_dtype)
        model = model.to_empty(device=device)
    else:
        model = torch_models.make_model(spec, compute_dtype).to(device)
    names = check_shapes(model, entries)
    model.init_buffers(device, rope_dtype)
    state = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    with torch.no_grad():
        for name in names:  # one tensor at a time: host memory stays small
            state[name].copy_(load_safetensors(ckpt_file, [name], device)[name])
    return model


def named_params_for_training(model):
    """(fqn, param, weight_decay) in registration order (optimizer.cpp)."""
    out = []
    for fqn, p in model.named_parameters():
        emb = fqn.startswith("tok_embeddings.") or fqn.startswith("pos_embeddings.")
        out.append((fqn, p, p.dim() >= 2 and not emb))
    return out


class ExactAdamW:
    """viaduct's AdamW::step, tensor by tensor."""

    def __init__(self, named, ts, steps_taken=0, state=None):
        self.named, self.ts, self.steps = named, ts, steps_taken
        self.m = [torch.zeros_like(p) for _, p, _ in named]
        self.v = [torch.zeros_like(p) for _, p, _ in named]
        if state:
            for i, (fqn, _, _) in enumerate(named):
                self.m[i].copy_(state["optim.exp_avg." + fqn])
                self.v[i].copy_(state["optim.exp_avg_sq." + fqn])

    def step(self, lr):
        ts = self.ts
        self.steps += 1
        bc1 = 1.0 - ts.beta1 ** self.steps
        bc2_sqrt = math.sqrt(1.0 - ts.beta2 ** self.steps)
        with torch.no_grad():
            for i, (_, p, decay) in enumerate(self.named):
                g = p.grad
                if g is None:
                    continue
                if decay and ts.weight_decay != 0.0:
                    p.mul_(1.0 - lr * ts.weight_decay)
                self.m[i].lerp_(g, 1.0 - ts.beta1)
                self.v[i].mul_(ts.beta2).addcmul_(g, g, value=1.0 - ts.beta2)
                denom = (self.v[i].sqrt() / bc2_sqrt).add_(ts.eps)
                p.addcdiv_(self.m[i], denom, value=-lr / bc1)

    def zero_grad(self):
        for _, p, _ in self.named:
            p.grad = None


class TorchAdamW:
    """torch.optim.AdamW (fused by default) with viaduct's decay groups."""

    def __init__(self, named, ts, impl, steps_taken=0, state=None):
        decay = [p for _, p, d in named if d]
        no_decay = [p for _, p, d in named if not d]
        kw = {"fused": True} if impl == "fused" else {"foreach": True}
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": ts.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=ts.lr, betas=(ts.beta1, ts.beta2), eps=ts.eps, **kw)
        if state:
            for fqn, p, _ in named:
                self.opt.state[p] = {
                    "step": torch.tensor(float(steps_taken), dtype=torch.float32,
                                         device=p.device if impl == "fused" else "cpu"),
                    "exp_avg": state["optim.exp_avg." + fqn].clone(),
                    "exp_avg_sq": state["optim.exp_avg_sq." + fqn].clone(),
                }

    def step(self, lr):
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)


def clip_exact(named, max_norm):
    """grad_squared_norms + total_norm + scale_grads of optimizer.cpp."""
    sq = [float(p.grad.float().pow(2).sum().item()) if p.grad is not None else 0.0
          for _, p, _ in named]
    norm = math.sqrt(sum(sq))
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for _, p, _ in named:
                    if p.grad is not None:
                        p.grad.mul_(coef)
    return torch.tensor(norm)


def device_peak_flops(name, dtype):
    table = {"H200": 989.4e12, "H100": 989.4e12, "H800": 989.4e12, "A100": 312e12,
             "A800": 312e12, "L40S": 362e12, "B200": 2250e12}
    for k, v in table.items():
        if k in name:
            return v / 2 if dtype == torch.float32 else v
    return None


class StepClock:
    """Per-step times: CUDA events (no sync inside the timed steps) or, on
    the CPU, the wall clock."""

    def __init__(self, device, n):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            self.ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        else:
            self.starts, self.ends = [0.0] * n, [0.0] * n

    def start(self, i):
        if self.cuda:
            self.starts[i].record()
        else:
            self.starts[i] = time.perf_counter()

    def end(self, i):
        if self.cuda:
            self.ends[i].record()
        else:
            self.ends[i] = time.perf_counter()

    def seconds(self):
        if self.cuda:
            return [s.elapsed_time(e) / 1e3 for s, e in zip(self.starts, self.ends)]
        return [e - s for s, e in zip(self.starts, self.ends)]


class StepProfiler:
    """One step under torch.profiler, as viaduct's metrics.profile_step with
    metrics.profile_host_ops = false: device kernels only on CUDA (no host
    cost per op, so the device's idle gaps stay close to an unprofiled
    step's), host ops on the CPU. The device is synchronized before the
    step starts and before the trace closes."""

    def __init__(self, device):
        from torch.profiler import ProfilerActivity, profile
        self.device = device
        cuda = device.type == "cuda"
        synchronize(device)
        self.prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
        self.prof.__enter__()

    def save(self, path):
        synchronize(self.device)
        self.prof.__exit__(None, None, None)
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self.prof.export_chrome_trace(path + ".tmp")
        os.replace(path + ".tmp", path)


class EnergyCounter:
    """The GPU's total-energy counter (NVML, millijoules since the driver
    loaded), the counter viaduct's energy_joules reads, through ctypes: None
    readings on the CPU or without libnvidia-ml."""

    def __init__(self, device):
        self.nvml = self.handle = None
        if device.type != "cuda":
            return
        import ctypes
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return
        if nvml.nvmlInit_v2() != 0:
            return
        p = torch.cuda.get_device_properties(device)
        bus = f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0".encode()
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByPciBusId_v2(bus, ctypes.byref(handle)) == 0:
            self.nvml, self.handle = nvml, handle

    def joules(self):
        if self.nvml is None:
            return None
        import ctypes
        mj = ctypes.c_ulonglong()
        if self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(mj)) != 0:
            return None
        return mj.value / 1e3


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    import resource  # the process's peak resident set: a coarse CPU figure
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def clip_grad_norm(params, max_norm):
    grads = [p.grad for p in params if p.grad is not None]
    if max_norm > 0:
        kw = {"foreach": True} if torch_models.TORCH2 else {}
        return torch.nn.utils.clip_grad_norm_(params, max_norm, **kw)
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads, foreach=True)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def add_config_override_args(ap):
    """Flags shared with bench/multi_gpu/torch_pipeline.py: settings read
    from the checkpoint's config (given, they override it) and shapes (given,
    they must agree with it)."""
    ap.add_argument("--data", help="token file or glob (default: data.path)")
    ap.add_argument("--data-format", help="default: data.format")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--steps", type=int,
                    help="training.steps: steps to run and the LR schedule's total")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--warmup", type=int, help="lr_scheduler.warmup_steps")
    for flag in ("dim", "n-layers", "n-heads", "n-kv-heads", "vocab-size", "ffn-hidden"):
        ap.add_argument("--" + flag, type=int)
    ap.add_argument("--rope-theta", type=float)
    ap.add_argument("--norm-eps", type=float)


def check_shape_flags(args, spec):
    for flag, field in (("dim", "dim"), ("n_layers", "n_layers"), ("n_heads", "n_heads"),
                        ("n_kv_heads", "n_kv_heads"), ("vocab_size", "vocab_size"),
                        ("ffn_hidden", "ffn_hidden"), ("rope_theta", "rope_theta"),
                        ("norm_eps", "norm_eps")):
        given = getattr(args, flag)
        if given is not None and given != getattr(spec, field, None):
            fail(f"--{flag.replace('_', '-')} {given} disagrees with the checkpoint's "
                 f"{field} = {getattr(spec, field, None)}")


def resolve_settings(args, cfg, spec, meta, microbatches=None, single_process=True):
    """(TrainSettings, start step, steps to run): the checkpoint's config with
    the flags' overrides; microbatches, given, replaces the config's count."""
    ts = train_settings_from_config(cfg, single_process)
    for flag, field in (("data", "data_path"), ("data_format", "data_format"),
                        ("seq_len", "seq_len"), ("batch", "batch_size"),
                        ("steps", "steps"), ("lr", "lr"), ("warmup", "warmup")):
        if getattr(args, flag) is not None:
            setattr(ts, field, getattr(args, flag))
    if microbatches is not None:
        ts.microbatches = microbatches
    ts.warmup = min(ts.warmup, ts.steps)  # config.cpp: warmup never outlasts the run
    if ts.optimizer != "AdamW":
        fail(f"optimizer.name is {ts.optimizer}; the reference implements AdamW")
    if ts.seq_len > spec.max_seq_len:
        fail(f"seq_len {ts.seq_len} exceeds model.max_seq_len {spec.max_seq_len}")
    if ts.batch_size % ts.microbatches:
        fail(f"local_batch_size {ts.batch_size} is not divisible by "
             f"{ts.microbatches} micro-batches")
    start_step = int(meta.get("step", 0))
    n_steps = ts.steps - start_step
    if n_steps <= args.timing_warmup:
        fail(f"{n_steps} steps to run ({ts.steps} - checkpoint step {start_step}) "
             f"leave none after {args.timing_warmup} warm-up steps; pass --steps")
    return ts, start_step, n_steps


def sampler_from_checkpoint(ts, meta):
    """(TokenStream, TokenSampler) positioned at the checkpoint's data cursor."""
    stream = TokenStream(ts.data_path, ts.data_format)
    cursor = meta.get("data_cursor") or {}
    sampler = TokenSampler(stream, ts.batch_size, ts.seq_len, ts.seed, ts.shuffle,
                           cursor.get("epoch", 0), cursor.get("position", 0))
    return stream, sampler


def read_batches(sampler, n_steps, grad_accum, B, T, vocab_size, pin):
    """Every step's (inputs, targets) [B, T] int64 pairs, grad_accum per
    step, read up front (pinned when pin) so the timed loop reads no file."""
    batches = []
    max_tok = 0
    for _ in range(n_steps):
        step_batches = []
        for _ in range(grad_accum):
            buf = torch.frombuffer(sampler.next(), dtype=torch.int64).view(B, T + 1)
            max_tok = max(max_tok, int(buf.max()))
            inp, tgt = buf[:, :T].contiguous(), buf[:, 1:].contiguous()
            step_batches.append((inp.pin_memory(), tgt.pin_memory()) if pin else (inp, tgt))
        batches.append(step_batches)
    if max_tok >= vocab_size:
        fail(f"the data holds token id {max_tok}, but vocab_size is {vocab_size}")
    return batches


def train_main(argv):
    ap = argparse.ArgumentParser(
        description="PyTorch reference of viaduct's models (see the file's top comment)")
    ap.add_argument("--checkpoint", required=True,
                    help="a viaduct step folder, e.g. outputs/x/checkpoint/step-0")
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode: default | max-autotune-no-cudagraphs | ...")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the fp32 correctness check (reference/check_references.sh)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU intra-op threads (default: the checkpoint's "
                    "training.num_threads, as viaduct)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="compute dtype (bf16: mixed precision with fp32 master weights)")
    ap.add_argument("--rope-dtype", choices=["float64", "float32"], default="float32",
                    help="dtype of the RoPE tables at use (viaduct: float32, float64 for fp64 models)")
    ap.add_argument("--optimizer-impl", choices=["fused", "foreach", "exact"],
                    default="fused", help="exact = viaduct's per-tensor loop and "
                    "per-tensor norm (slow: one sync per tensor); fused needs torch "
                    "2.x (CUDA) and falls back to foreach elsewhere")
    ap.add_argument("--timing-warmup", type=int, default=3,
                    help="untimed steps first (compile happens in the first)")
    ap.add_argument("--peak-flops", type=float, default=None,
                    help="device peak FLOP/s for MFU (default: by GPU name, "
                    f"H100/H200 {PEAK_BF16_FLOPS:.4g})")
    ap.add_argument("--json", help="write the summary JSON here too")
    ap.add_argument("--label", default="", help="free text carried into the JSON")
    ap.add_argument("--profile-step", type=int, default=0,
                    help="profile this step of the run (1-based; 0: off) with "
                    "torch.profiler, device kernels only on CUDA, into --profile-trace")
    ap.add_argument("--profile-trace", default="torch_profile.trace.json",
                    help="the Chrome trace --profile-step writes")
    add_config_override_args(ap)
    ap.add_argument("--dry-run", action="store_true",
                    help="resolve the checkpoint, config and data, print them, "
                    "and stop (needs no torch)")
    args = ap.parse_args(argv)

    meta, ckpt_file = open_checkpoint(args.checkpoint)
    cfg = parse_config_toml(meta["config_toml"])
    spec = spec_from_config(cfg)
    check_shape_flags(args, spec)
    entries, _, _ = read_safetensors_header(ckpt_file)

    ts, start_step, n_steps = resolve_settings(args, cfg, spec, meta)

    # Data: the sampler from the checkpoint's cursor, every step's batch read
    # up front (pinned on CUDA), so the timed loop does no file reads.
    stream, sampler = sampler_from_checkpoint(ts, meta)
    B, T = ts.batch_size, ts.seq_len
    if args.dry_run:
        print(json.dumps({"spec": asdict(spec), "settings": asdict(ts),
                          "start_step": start_step, "steps": n_steps,
                          "params": parameter_count(entries),
                          "flops_per_token": flops_per_token(spec, T),
                          "lrs": [lr_at(ts, start_step + i + 1) for i in range(n_steps)],
                          "data_tokens": stream.size,
                          "num_windows": sampler.num_windows,
                          "first_windows": sampler.next_windows()}))
        return 0
    if torch is None:
        fail("PyTorch is not installed")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("no CUDA device (--device cpu runs on the CPU)")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads or cfg_get(cfg, "training.num_threads", 2))
    cuda = device.type == "cuda"
    batches = read_batches(sampler, n_steps, ts.grad_accum, B, T, spec.vocab_size, cuda)

    compute_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rope_dtype = torch.float64 if args.rope_dtype == "float64" else torch.float32
    t0 = time.perf_counter()
    model = build_model(spec, ckpt_file, entries, device, compute_dtype, rope_dtype)
    model.train()
    named = named_params_for_training(model)
    optim_state = None
    if start_step > 0:
        optim_file = os.path.join(args.checkpoint, "optim.safetensors")
        keys = [f"optim.{slot}.{fqn}" for fqn, _, _ in named
                for slot in ("exp_avg", "exp_avg_sq")]
        optim_state = load_safetensors(optim_file, keys, device)
    steps_taken = int((meta.get("extra") or {}).get("optimizer_steps", start_step))
    impl = args.optimizer_impl
    if impl == "fused" and not (torch_models.TORCH2 and cuda):
        impl = "foreach"  # fused AdamW: torch 2.x on CUDA
    if impl == "exact":
        opt = ExactAdamW(named, ts, steps_taken, optim_state)
    else:
        opt = TorchAdamW(named, ts, impl, steps_taken, optim_state)
    del optim_state
    synchronize(device)
    load_s = time.perf_counter() - t0

    loss_fn = model
    if args.mode == "compile":
        kw = {} if args.compile_mode == "default" else {"mode": args.compile_mode}
        loss_fn = torch_models.compile_model(model, kw)
    params = [p for _, p, _ in named]

    tokens = B * T * ts.grad_accum  # no target is -100 in a token stream
    scale = 1.0 / tokens
    clock = StepClock(device, n_steps)
    step_losses, norms, lrs, wall = [], [], [], []
    reset_peak_memory(device)
    peak_warmup = 0
    energy = EnergyCounter(device)
    energy_start = None
    if not 0 <= args.profile_step <= n_steps:
        fail(f"--profile-step {args.profile_step} is not a step of this run (1..{n_steps})")
    profiler = None
    for i in range(n_steps):
        if i == args.timing_warmup:
            synchronize(device)
            peak_warmup = peak_memory(device)
            reset_peak_memory(device)
            energy_start = energy.joules()
        if i + 1 == args.profile_step:
            profiler = StepProfiler(device)
        w0 = time.perf_counter()
        clock.start(i)
        mb_losses = []
        for inputs, targets in batches[i]:
            for inp, tgt in zip(inputs.chunk(ts.microbatches), targets.chunk(ts.microbatches)):
                loss = loss_fn(inp.to(device, non_blocking=True),
                               tgt.to(device, non_blocking=True))
                (loss * scale).backward()
                mb_losses.append(loss.detach())
        if impl == "exact":
            norm = clip_exact(named, ts.max_norm)
        else:
            norm = clip_grad_norm(params, ts.max_norm)
        lr = lr_at(ts, start_step + i + 1)
        opt.step(lr)
        opt.zero_grad()
        torch_models.after_optimizer_step(model)
        clock.end(i)
        step_losses.append(mb_losses)
        norms.append(norm.detach())
        lrs.append(lr)
        if i < args.timing_warmup:  # wall time of the warm-up steps (compile)
            synchronize(device)
            wall.append(time.perf_counter() - w0)
        if profiler is not None:
            profiler.save(args.profile_trace)
            profiler = None
    synchronize(device)
    peak_timed = peak_memory(device)
    energy_end = energy.joules()
    timed_tokens = tokens * (n_steps - args.timing_warmup)
    energy_per_token = ((energy_end - energy_start) / timed_tokens
                        if energy_start is not None and energy_end is not None
                        and timed_tokens > 0 else None)

    losses = [sum(float(l.item()) for l in ls) / tokens for ls in step_losses]
    grad_norms = [float(n.item()) for n in norms]
    step_s = clock.seconds()
    timed = step_s[args.timing_warmup:]
    median = statistics.median(timed)
    fpt = flops_per_token(spec, T)
    dev_name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = args.peak_flops or (device_peak_flops(dev_name, compute_dtype) if cuda else None)
    tok_s = tokens / median
    summary = {
        "impl": "torch-" + args.mode + ("" if args.mode == "eager" or
                                         args.compile_mode == "default"
                                         else f"[{args.compile_mode}]"),
        "label": args.label,
        "checkpoint": args.checkpoint,
        "data": ts.data_path,
        "device": dev_name,
        "torch": torch.__version__,
        "family": spec.family,
        "spec": asdict(spec),
        "params": parameter_count(entries),
        "batch": B, "seq_len": T, "grad_accum": ts.grad_accum,
        "tokens_per_step": tokens,
        "start_step": start_step, "steps": n_steps, "timing_warmup": args.timing_warmup,
        "optimizer_impl": impl, "rope_dtype": args.rope_dtype,
        "compute_dtype": args.dtype,
        "profile_step": args.profile_step or None,
        "median_step_s": median,
        "step_s": step_s,
        "tokens_per_s": tok_s,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "mfu": fpt * tok_s / peak if peak else None,
        "peak_memory_bytes": peak_timed,
        "peak_memory_warmup_bytes": peak_warmup,
        "joules_per_token": energy_per_token,
        "first_step_wall_s": wall[0] if wall else None,
        "compile_s": (wall[0] - median) if (wall and args.mode == "compile") else None,
        "load_s": load_s,
        "losses": losses,
        "grad_norms": grad_norms,
        "lrs": lrs,
    }
    print_steps(start_step, losses, grad_norms, lrs, step_s)
    line = json.dumps(summary)
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    return 0


# ----------------------------------------------------------------- report


def viaduct_summary(metrics_path, timing_warmup, fpt, peak_flops):
    """The viaduct row from its metrics.jsonl (per-step lines only)."""
    rows = []
    with open(metrics_path) as f:
        for line in f:
            line = line.strip()
            if line:
                j = json.loads(line)
                if "loss" in j and "step_seconds" in j:
                    rows.append(j)
    rows.sort(key=lambda j: j["step"])
    if len(rows) <= timing_warmup:
        fail(f"{metrics_path} has {len(rows)} step lines, none after "
             f"{timing_warmup} warm-up steps")
    timed = [j["step_seconds"] for j in rows[timing_warmup:]]
    median = statistics.median(timed)
    tokens = rows[-1]["tokens"]
    tok_s = tokens / median
    # The timed steps' energies telescope (viaduct's Note [Energy per step]):
    # their sum over their tokens is the span's energy per token.
    timed_rows = rows[timing_warmup:]
    joules = [j.get("energy_joules") for j in timed_rows]
    jpt = (sum(joules) / sum(j["tokens"] for j in timed_rows)
           if joules and all(x is not None for x in joules) else None)
    return {
        "impl": "viaduct",
        "tokens_per_step": tokens,
        "median_step_s": median,
        "step_s": [j["step_seconds"] for j in rows],
        "tokens_per_s": tok_s,
        "flops_per_token": fpt,
        "mfu": fpt * tok_s / peak_flops if peak_flops else None,
        "mfu_reported": statistics.median(
            [j["mfu"] for j in rows[timing_warmup:] if j.get("mfu") is not None] or [0]),
        "peak_memory_bytes": max(j.get("peak_memory_bytes", 0) for j in rows),
        "joules_per_token": jpt,
        "losses": [j["loss"] for j in rows],
        "grad_norms": [j["grad_norm"] for j in rows],
    }


def fmt_losses(ls, n=5):
    return " ".join(f"{l:.4f}" for l in ls[:n])


def report_main(argv):
    ap = argparse.ArgumentParser(prog="torch_llama.py report",
                                 description="one markdown table of a benchmark cell")
    ap.add_argument("--cell", required=True, help="the cell's name, e.g. 'llama 1B, 4x4096'")
    ap.add_argument("--viaduct-metrics", help="viaduct's metrics.jsonl")
    ap.add_argument("--peer", action="append", default=[],
                    help="a summary JSON of torch_llama.py or torch_pipeline.py "
                    "(repeatable)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="devices of the viaduct run, for its MFU (default: the "
                    "peers' world_size, else 1)")
    ap.add_argument("--checkpoint", help="step folder: the FLOP count when no peer ran")
    ap.add_argument("--timing-warmup", type=int, default=3)
    ap.add_argument("--peak-flops", type=float, default=PEAK_BF16_FLOPS)
    ap.add_argument("--loss-rtol", type=float, default=1e-2,
                    help="relative loss difference still called agreement (bf16)")
    ap.add_argument("--out", help="append the table here")
    ap.add_argument("--steps-out", help="append the step-time lines here (default: "
                    "printed after the table)")
    ap.add_argument("--header", action="store_true", help="print the table header")
    args = ap.parse_args(argv)

    peers = []
    for p in args.peer:
        if os.path.isfile(p):
            with open(p) as f:
                peers.append(json.loads(f.readline()))
        else:
            peers.append({"impl": os.path.basename(p).rsplit(".", 1)[0], "failed": True})
    fpt = next((p["flops_per_token"] for p in peers if "flops_per_token" in p), None)
    if fpt is None and args.checkpoint:
        meta, _ = open_checkpoint(args.checkpoint)
        cfg = parse_config_toml(meta["config_toml"])
        fpt = flops_per_token(spec_from_config(cfg),
                              train_settings_from_config(cfg).seq_len)
    # A pipeline cell's MFU is over all its devices (as viaduct's own mfu).
    gpus = args.gpus or max([p.get("world_size", 1) for p in peers if not p.get("failed")]
                            or [1])
    rows = []
    vd = None
    if args.viaduct_metrics and os.path.isfile(args.viaduct_metrics) and fpt:
        vd = viaduct_summary(args.viaduct_metrics, args.timing_warmup, fpt,
                             args.peak_flops * gpus if args.peak_flops else None)
        rows.append(vd)
    elif args.viaduct_metrics:
        rows.append({"impl": "viaduct", "failed": True})
    rows.extend(peers)

    lines = []
    if args.header:
        lines += ["| cell | impl | tok/s | MFU | peak GiB | mJ/tok | loss steps 1-5 | "
                  "rel Δloss vs viaduct: step 1 / max 1-5 | viaduct ÷ this: tok/s, mem, energy |",
                  "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {args.cell} | {r['impl']} | failed | | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        gib = f"{r['peak_memory_bytes'] / 2**30:.1f}"
        if len(r.get("peak_memory_bytes_per_rank") or []) > 1:  # rank 0's first, as viaduct's
            gib += " (ranks " + " / ".join(
                f"{b / 2**30:.1f}" for b in r["peak_memory_bytes_per_rank"]) + ")"
        dl = ratio = ""
        if vd is not None and r is not vd:
            n = min(len(vd["losses"]), len(r["losses"]), 5)
            rels = [abs(a - b) / max(abs(a), 1e-12)
                    for a, b in zip(vd["losses"][:n], r["losses"][:n])]
            dl = (f"{rels[0]:.1e} / {max(rels):.1e} "
                  f"{'ok' if max(rels) <= args.loss_rtol else 'DIFFERS'}")
            ratio = (f"{vd['tokens_per_s'] / r['tokens_per_s']:.2f}x, "
                     f"{vd['peak_memory_bytes'] / r['peak_memory_bytes']:.2f}x")
            if vd.get("joules_per_token") and r.get("joules_per_token"):
                ratio += f", {vd['joules_per_token'] / r['joules_per_token']:.2f}x"
        mj = (f"{1e3 * r['joules_per_token']:.2f}" if r.get("joules_per_token") is not None
              else "n/a")
        extra = ""
        if r.get("compile_s") is not None:
            extra = f" (compile {r['compile_s']:.0f} s)"
        lines.append(f"| {args.cell} | {r['impl']}{extra} | {r['tokens_per_s']:.0f} | "
                     f"{mfu} | {gib} | {mj} | {fmt_losses(r['losses'])} | {dl} | {ratio} |")
    # Step times of the timed steps, each side: a median alone hides a
    # bimodal run (viaduct's steps alternated in pairs between 256 and 269 ms
    # in session 5), so the mean (the wall rate) and the spread go beside it.
    spread = []
    for r in rows:
        if r.get("failed") or not r.get("step_s"):
            continue
        t = r["step_s"][args.timing_warmup:]
        if not t:
            continue
        mean = statistics.fmean(t)
        by_mean = ""
        if vd is not None and r is not vd and vd.get("step_s"):
            vt = vd["step_s"][args.timing_warmup:]
            if vt:
                by_mean = f"; viaduct ÷ this by mean {mean / statistics.fmean(vt):.3f}x"
        spread.append(f"{r['impl']}: timed steps {len(t)}, median {1e3 * statistics.median(t):.1f} ms, "
                      f"mean {1e3 * mean:.1f} ms, min {1e3 * min(t):.1f}, max {1e3 * max(t):.1f}"
                      f"{by_mean}")
    text = "\n".join(lines)
    print(text)
    spread = [f"- {args.cell}, {x}" for x in spread]
    if args.steps_out:
        with open(args.steps_out, "a") as f:
            f.write("".join(x + "\n" for x in spread))
    elif spread:
        print("\n" + "\n".join(spread))
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


def overhead_main(argv):
    """One results line: the step-time cost of a model feature, from viaduct's
    own metrics of the model with it and the same model without it. Given
    several runs of each (alternating processes, to average out the
    process-to-process spread), the medians are over all their timed steps
    pooled, and each pair's own ratio follows."""
    ap = argparse.ArgumentParser(prog="torch_llama.py overhead",
                                 description="median step time with / without - 1")
    ap.add_argument("--name", required=True, help="e.g. 'AttnRes overhead (k3 / k3plain - 1)'")
    ap.add_argument("--with", dest="with_", required=True, action="append",
                    help="metrics.jsonl with it (repeat for several runs); a peer's "
                    "summary .json also serves, to compare viaduct with a peer")
    ap.add_argument("--without", required=True, action="append",
                    help="metrics.jsonl or summary .json without it (repeat for several runs)")
    ap.add_argument("--timing-warmup", type=int, default=3)
    args = ap.parse_args(argv)
    missing = [p for p in args.with_ + args.without if not os.path.isfile(p)]
    if missing:
        print(f"{args.name}: n/a (a run failed: {', '.join(missing)})")
        return 0
    def load(path):
        # viaduct's metrics.jsonl, or a peer's summary JSON (same step_s list).
        if path.endswith(".json"):
            with open(path) as f:
                j = json.loads(f.readline())
            if "step_s" not in j:
                fail(f"{path} has no per-step times (a failed run?)")
            return j
        return viaduct_summary(path, args.timing_warmup, 0.0, None)

    a = [load(p) for p in args.with_]
    b = [load(p) for p in args.without]

    def pooled(runs):
        return statistics.median(
            [t for r in runs for t in r["step_s"][args.timing_warmup:]])

    ta, tb = pooled(a), pooled(b)
    peak_a = max(r["peak_memory_bytes"] for r in a)
    peak_b = max(r["peak_memory_bytes"] for r in b)
    runs = "" if len(a) == len(b) == 1 else f" over {len(a)} + {len(b)} runs"
    line = (f"{args.name}: {100 * (ta / tb - 1):+.1f}% "
            f"(median step {1e3 * ta:.1f} ms vs {1e3 * tb:.1f} ms{runs}; "
            f"peak {peak_a / 2**30:.1f} vs {peak_b / 2**30:.1f} GiB)")
    if len(a) == len(b) > 1:
        pairs = ", ".join(f"{100 * (pooled([x]) / pooled([y]) - 1):+.1f}%"
                          for x, y in zip(a, b))
        line += f"; each pair: {pairs}"
    print(line)
    return 0


def main(argv):
    if argv and argv[0] == "report":
        return report_main(argv[1:])
    if argv and argv[0] == "overhead":
        return overhead_main(argv[1:])
    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
