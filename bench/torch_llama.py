#!/usr/bin/env python3
"""PyTorch reference of viaduct's llama, for the side-by-side benchmark.

Loads the weights of a viaduct checkpoint (`<folder>/step-<N>/`), reads the
model shape and the training settings from its metadata.json (the effective
job config viaduct saved), trains on the same token windows viaduct's sampler
hands out, and reports tokens/s, MFU, peak device memory and the per-step
losses -- in eager mode or under torch.compile.

The model is viaduct's, op for op (src/model/layers.cpp,
src/model/chain_transformer.cpp, src/model/model.cpp):
  - fp32 master parameters; the embedding output is cast to bf16; every
    linear casts its fp32 weight to the activation dtype;
  - RMSNorm in fp32 (x * rsqrt(mean(x^2) + eps) * w), returning the input
    dtype; RoPE on interleaved pairs (x[2i], x[2i+1]) with fp64 tables.
    viaduct does not cast the fp64 tables down, so type promotion computes
    the rotation in fp64; --rope-dtype float32 casts them instead;
  - GQA by repeat_interleave of K/V over heads, causal SDPA; SwiGLU
    w2(silu(w1 x) * w3 x); final RMSNorm; untied lm_head;
  - loss = summed token cross-entropy over fp32 logits, backward of
    loss / (tokens of the step).
The optimizer step is viaduct's (src/train/optimizer.cpp, trainer.cpp):
global-norm clipping (coef = max_norm / (norm + 1e-6) when < 1), AdamW with
decoupled decay on params with dim >= 2 except embeddings, bias corrections,
lr_at's warmup + cosine/linear/constant schedule. By default torch's fused
AdamW and clip_grad_norm_ (the same formulas, the fast kernels a PyTorch user
would run); --exact-optimizer runs viaduct's per-tensor loop instead.

FLOPs per token (Note [FLOPs per token] in src/model/chain_transformer.cpp):
  6 * (L * (2 D^2 + 2 D * kv_dim + 3 D F) + V * D) + 12 * L * D * T
and MFU = flops_per_token * tokens/s / peak (989.4e12, H100/H200 dense bf16).

Two commands:
  torch_llama.py --checkpoint DIR/step-0 [--mode eager|compile] [...]
  torch_llama.py report --viaduct-metrics M.jsonl --peer A.json ... --out R.md

Only the standard library is needed for parsing (tests run without torch).
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

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:  # parsing and the report work without torch
    torch = None
    nn = None
    F = None

PEAK_BF16_FLOPS = 989.4e12  # H100 / H200 SXM, dense bf16 (src/core/device.cpp)


def fail(msg):
    sys.exit(f"torch_llama.py: error: {msg}")


# --------------------------------------------------------------- config


@dataclass
class LlamaSpec:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden: int
    max_seq_len: int
    norm_eps: float
    rope_theta: float
    tie_embeddings: bool = False

    @property
    def head_dim(self):
        return self.dim // self.n_heads


# src/model/llama.cpp: llama_flavor().
LLAMA_FLAVORS = {
    "debugmodel": LlamaSpec(8, 128, 8, 4, 320, 384, 2048, 1e-5, 10000.0),
    "1B": LlamaSpec(16, 2048, 32, 8, 128256, 8192, 8192, 1e-5, 500000.0),
    "8B": LlamaSpec(32, 4096, 32, 8, 128256, 14336, 8192, 1e-5, 500000.0),
}


def llama_ffn_hidden(dim, multiple_of=256, ffn_dim_multiplier=1.0):
    hidden = 4 * dim
    hidden = 2 * hidden // 3
    hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def parse_config_toml(text):
    if tomllib is None:
        fail("reading the checkpoint's config needs Python 3.11+ (tomllib)")
    return tomllib.loads(text)


def cfg_get(cfg, dotted, default=None):
    section, key = dotted.split(".", 1)
    return cfg.get(section, {}).get(key, default)


def llama_spec_from_config(cfg):
    """apply_model_overrides(llama_flavor(flavor), cfg) of chain_transformer.cpp."""
    family = cfg_get(cfg, "model.family", "llama")
    if family != "llama":
        fail(f"model.family is '{family}'; this reference implements llama only")
    flavor = cfg_get(cfg, "model.flavor", "debugmodel")
    if flavor not in LLAMA_FLAVORS:
        fail(f"unknown llama flavor '{flavor}' (known: {', '.join(LLAMA_FLAVORS)})")
    s = LlamaSpec(**asdict(LLAMA_FLAVORS[flavor]))
    m = cfg.get("model", {})
    s.n_layers = m.get("n_layers", s.n_layers)
    dim_changed = "dim" in m
    s.dim = m.get("dim", s.dim)
    s.n_heads = m.get("n_heads", s.n_heads)
    if "n_kv_heads" in m:
        s.n_kv_heads = m["n_kv_heads"]
    elif "n_heads" in m and (s.n_kv_heads > s.n_heads or s.n_heads % s.n_kv_heads):
        s.n_kv_heads = s.n_heads
    s.vocab_size = m.get("vocab_size", s.vocab_size)
    if "ffn_hidden_dim" in m:
        s.ffn_hidden = m["ffn_hidden_dim"]
    elif dim_changed:
        s.ffn_hidden = llama_ffn_hidden(s.dim, 256, 1.0)
    s.max_seq_len = m.get("max_seq_len", s.max_seq_len)
    s.norm_eps = float(m.get("norm_eps", s.norm_eps))
    s.rope_theta = float(m.get("rope_theta", s.rope_theta))
    s.tie_embeddings = bool(m.get("tie_embeddings", s.tie_embeddings))
    if s.dim % s.n_heads or s.n_heads % s.n_kv_heads or s.head_dim % 2:
        fail(f"inconsistent llama shape {s}")
    return s


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


def train_settings_from_config(cfg):
    pp = cfg_get(cfg, "parallelism.pipeline_parallel_degree", 1)
    dp = cfg_get(cfg, "parallelism.data_parallel_degree", 1)
    if pp != 1 or dp != 1:
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


def flops_per_token(s, seq_len):
    """Note [FLOPs per token] in src/model/chain_transformer.cpp."""
    kv = s.n_kv_heads * s.head_dim
    attn = 2 * s.dim * s.dim + 2 * s.dim * kv
    ffn = 3 * s.dim * s.ffn_hidden
    matmul_params = s.n_layers * (attn + ffn) + s.vocab_size * s.dim
    return 6.0 * matmul_params + 12.0 * s.n_layers * s.dim * seq_len


def parameter_count(s):
    kv = s.n_kv_heads * s.head_dim
    per_layer = 2 * s.dim * s.dim + 2 * s.dim * kv + 3 * s.dim * s.ffn_hidden + 2 * s.dim
    head = 0 if s.tie_embeddings else s.vocab_size * s.dim
    return s.vocab_size * s.dim + s.n_layers * per_layer + s.dim + head


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
            if version != 1 or bpt not in (2, 4):
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


def expected_shapes(spec):
    """{FQN: shape} of every parameter, in viaduct's registration order."""
    s, kv = spec, spec.n_kv_heads * spec.head_dim
    want = {"tok_embeddings.weight": [s.vocab_size, s.dim]}
    for i in range(s.n_layers):
        p = f"layers.{i}."
        want.update({
            p + "attention_norm.weight": [s.dim],
            p + "attention.wq.weight": [s.dim, s.dim],
            p + "attention.wk.weight": [kv, s.dim],
            p + "attention.wv.weight": [kv, s.dim],
            p + "attention.wo.weight": [s.dim, s.dim],
            p + "ffn_norm.weight": [s.dim],
            p + "feed_forward.w1.weight": [s.ffn_hidden, s.dim],
            p + "feed_forward.w2.weight": [s.dim, s.ffn_hidden],
            p + "feed_forward.w3.weight": [s.ffn_hidden, s.dim],
        })
    want["norm.weight"] = [s.dim]
    if not s.tie_embeddings:
        want["lm_head.weight"] = [s.vocab_size, s.dim]
    return want


def check_shapes(spec, entries):
    """Each tensor of the checkpoint against the spec from its config."""
    want = expected_shapes(spec)
    for name, shape in want.items():
        if name not in entries:
            fail(f"the checkpoint has no tensor '{name}'")
        if entries[name][1] != shape:
            fail(f"tensor '{name}' is {entries[name][1]} in the checkpoint, the "
                 f"config's shape says {shape}")
    extra = sorted(set(entries) - set(want))
    if extra:
        fail(f"the checkpoint holds tensors this llama lacks: {extra[:5]}")
    return list(want)


# ------------------------------------------------------------- the model

if torch is not None:

    def linear(x, w):
        # Note [Mixed precision]: the fp32 weight is cast to x's dtype.
        return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype))

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            xf = x if x.dtype == torch.float64 else x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (y * self.weight).to(x.dtype)

    def rope_tables(head_dim, max_seq_len, theta):
        # fp64 [max_seq_len, head_dim / 2], computed on the CPU as viaduct does.
        idx = torch.arange(0, head_dim, 2, dtype=torch.float64)
        inv_freq = 1.0 / torch.pow(theta, idx / float(head_dim))
        t = torch.arange(max_seq_len, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        return freqs.cos(), freqs.sin()

    def apply_rope(x, cos, sin):
        # x: [B, T, H, hd]; rotates interleaved pairs (x[2i], x[2i+1]).
        T = x.size(1)
        c = cos[:T].view(1, T, 1, -1)
        s = sin[:T].view(1, T, 1, -1)
        xf = (x if x.dtype == torch.float64 else x.float()).unflatten(-1, (-1, 2))
        x0, x1 = xf[..., 0], xf[..., 1]
        out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1)
        return out.flatten(-2).to(x.dtype)

    class Attention(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.n_heads, self.n_kv_heads, self.head_dim = s.n_heads, s.n_kv_heads, s.head_dim
            kv = s.n_kv_heads * s.head_dim
            self.wq = nn.Linear(s.dim, s.dim, bias=False)
            self.wk = nn.Linear(s.dim, kv, bias=False)
            self.wv = nn.Linear(s.dim, kv, bias=False)
            self.wo = nn.Linear(s.dim, s.dim, bias=False)

        def forward(self, x, cos, sin):
            # x: [B, T, D]
            B, T, _ = x.shape
            H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
            q = linear(x, self.wq.weight).view(B, T, H, hd)
            k = linear(x, self.wk.weight).view(B, T, KV, hd)
            v = linear(x, self.wv.weight).view(B, T, KV, hd)
            q = apply_rope(q, cos, sin).transpose(1, 2)  # [B, H, T, hd]
            k = apply_rope(k, cos, sin).transpose(1, 2)  # [B, KV, T, hd]
            v = v.transpose(1, 2)
            if KV != H:
                k = k.repeat_interleave(H // KV, 1)
                v = v.repeat_interleave(H // KV, 1)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
            y = y.transpose(1, 2).reshape(B, T, H * hd)
            return linear(y, self.wo.weight)

    class SwiGLU(nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.w1 = nn.Linear(dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, dim, bias=False)
            self.w3 = nn.Linear(dim, hidden, bias=False)

        def forward(self, x):
            return linear(F.silu(linear(x, self.w1.weight)) * linear(x, self.w3.weight),
                          self.w2.weight)

    class Block(nn.Module):
        def __init__(self, s):
            super().__init__()
            # Registration order = viaduct's parameter order.
            self.attention_norm = RMSNorm(s.dim, s.norm_eps)
            self.attention = Attention(s)
            self.ffn_norm = RMSNorm(s.dim, s.norm_eps)
            self.feed_forward = SwiGLU(s.dim, s.ffn_hidden)

        def forward(self, x, cos, sin):
            h = x + self.attention(self.attention_norm(x), cos, sin)
            return h + self.feed_forward(self.ffn_norm(h))

    class Llama(nn.Module):
        """Returns the summed fp32 token cross-entropy (ignore_index -100)."""

        def __init__(self, s, compute_dtype):
            super().__init__()
            self.spec, self.compute_dtype = s, compute_dtype
            self.tok_embeddings = nn.Embedding(s.vocab_size, s.dim)
            self.layers = nn.ModuleList(Block(s) for _ in range(s.n_layers))
            self.norm = RMSNorm(s.dim, s.norm_eps)
            self.lm_head = None if s.tie_embeddings else nn.Linear(s.dim, s.vocab_size, bias=False)

        def set_rope(self, cos, sin):
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

        def forward(self, tokens, targets):
            # tokens, targets: [B, T] int64
            h = self.tok_embeddings(tokens)  # [B, T, D] fp32
            if h.dtype != self.compute_dtype:
                h = h.to(self.compute_dtype)
            for layer in self.layers:
                h = layer(h, self.rope_cos, self.rope_sin)
            h = self.norm(h)
            w = self.tok_embeddings.weight if self.lm_head is None else self.lm_head.weight
            logits = linear(h, w)  # [B, T, V]
            V = logits.size(-1)
            t = torch.float64 if logits.dtype == torch.float64 else torch.float32
            return F.cross_entropy(logits.reshape(-1, V).to(t), targets.reshape(-1),
                                   reduction="sum", ignore_index=-100)


# --------------------------------------------------------------- training


def build_model(spec, ckpt_file, names, device, compute_dtype, rope_dtype):
    with torch.device("meta"):
        model = Llama(spec, compute_dtype)
    model = model.to_empty(device=device)
    cos, sin = rope_tables(spec.head_dim, spec.max_seq_len, spec.rope_theta)
    model.set_rope(cos.to(device=device, dtype=rope_dtype),
                   sin.to(device=device, dtype=rope_dtype))
    params = dict(model.named_parameters())
    if sorted(params) != sorted(names):
        fail(f"model parameters {sorted(set(params) ^ set(names))[:5]} do not match "
             "the checkpoint")
    with torch.no_grad():
        for name in names:  # one tensor at a time: host memory stays small
            t = load_safetensors(ckpt_file, [name], device)[name]
            params[name].copy_(t)
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


def train_main(argv):
    ap = argparse.ArgumentParser(
        description="PyTorch reference of viaduct's llama (see the file's top comment)")
    ap.add_argument("--checkpoint", required=True,
                    help="a viaduct step folder, e.g. outputs/x/checkpoint/step-0")
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode: default | max-autotune-no-cudagraphs | ...")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="compute dtype (bf16: mixed precision with fp32 master weights)")
    ap.add_argument("--rope-dtype", choices=["float64", "float32"], default="float64",
                    help="dtype of the RoPE tables at use (viaduct: float64 by promotion)")
    ap.add_argument("--optimizer-impl", choices=["fused", "foreach", "exact"],
                    default="fused", help="exact = viaduct's per-tensor loop and "
                    "per-tensor norm (slow: one sync per tensor)")
    ap.add_argument("--timing-warmup", type=int, default=3,
                    help="untimed steps first (compile happens in the first)")
    ap.add_argument("--peak-flops", type=float, default=None,
                    help="device peak FLOP/s for MFU (default: by GPU name, "
                    f"H100/H200 {PEAK_BF16_FLOPS:.4g})")
    ap.add_argument("--json", help="write the summary JSON here too")
    ap.add_argument("--label", default="", help="free text carried into the JSON")
    # Settings read from the checkpoint's config; given, they override it.
    ap.add_argument("--data", help="token file or glob (default: data.path)")
    ap.add_argument("--data-format", help="default: data.format")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--steps", type=int,
                    help="training.steps: steps to run and the LR schedule's total")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--warmup", type=int, help="lr_scheduler.warmup_steps")
    # Shapes: read from the checkpoint; given, they must agree with it.
    for flag in ("dim", "n-layers", "n-heads", "n-kv-heads", "vocab-size", "ffn-hidden"):
        ap.add_argument("--" + flag, type=int)
    ap.add_argument("--rope-theta", type=float)
    ap.add_argument("--norm-eps", type=float)
    ap.add_argument("--dry-run", action="store_true",
                    help="resolve the checkpoint, config and data, print them, "
                    "and stop (needs no torch)")
    args = ap.parse_args(argv)

    meta, ckpt_file = open_checkpoint(args.checkpoint)
    cfg = parse_config_toml(meta["config_toml"])
    spec = llama_spec_from_config(cfg)
    for flag, field in (("dim", "dim"), ("n_layers", "n_layers"), ("n_heads", "n_heads"),
                        ("n_kv_heads", "n_kv_heads"), ("vocab_size", "vocab_size"),
                        ("ffn_hidden", "ffn_hidden"), ("rope_theta", "rope_theta"),
                        ("norm_eps", "norm_eps")):
        given = getattr(args, flag)
        if given is not None and given != getattr(spec, field):
            fail(f"--{flag.replace('_', '-')} {given} disagrees with the checkpoint's "
                 f"{field} = {getattr(spec, field)}")
    entries, _, _ = read_safetensors_header(ckpt_file)
    names = check_shapes(spec, entries)

    ts = train_settings_from_config(cfg)
    for flag, field in (("data", "data_path"), ("data_format", "data_format"),
                        ("seq_len", "seq_len"), ("batch", "batch_size"),
                        ("steps", "steps"), ("lr", "lr"), ("warmup", "warmup")):
        if getattr(args, flag) is not None:
            setattr(ts, field, getattr(args, flag))
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

    # Data: the sampler from the checkpoint's cursor, every step's batch read
    # up front (pinned), so the timed loop does no file reads.
    stream = TokenStream(ts.data_path, ts.data_format)
    cursor = meta.get("data_cursor") or {}
    sampler = TokenSampler(stream, ts.batch_size, ts.seq_len, ts.seed, ts.shuffle,
                           cursor.get("epoch", 0), cursor.get("position", 0))
    B, T = ts.batch_size, ts.seq_len
    if args.dry_run:
        print(json.dumps({"spec": asdict(spec), "settings": asdict(ts),
                          "start_step": start_step, "steps": n_steps,
                          "params": parameter_count(spec),
                          "flops_per_token": flops_per_token(spec, T),
                          "lrs": [lr_at(ts, start_step + i + 1) for i in range(n_steps)],
                          "data_tokens": stream.size,
                          "num_windows": sampler.num_windows,
                          "first_windows": sampler.next_windows()}))
        return 0
    if torch is None:
        fail("PyTorch is not installed")
    if not torch.cuda.is_available():
        fail("no CUDA device")
    device = torch.device("cuda")
    batches = []
    max_tok = 0
    for _ in range(n_steps):
        step_batches = []
        for _ in range(ts.grad_accum):
            buf = torch.frombuffer(sampler.next(), dtype=torch.int64).view(B, T + 1)
            max_tok = max(max_tok, int(buf.max()))
            step_batches.append((buf[:, :T].contiguous().pin_memory(),
                                 buf[:, 1:].contiguous().pin_memory()))
        batches.append(step_batches)
    if max_tok >= spec.vocab_size:
        fail(f"the data holds token id {max_tok}, but vocab_size is {spec.vocab_size}")

    compute_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rope_dtype = torch.float64 if args.rope_dtype == "float64" else torch.float32
    t0 = time.perf_counter()
    model = build_model(spec, ckpt_file, names, device, compute_dtype, rope_dtype)
    model.train()
    named = named_params_for_training(model)
    optim_state = None
    if start_step > 0:
        optim_file = os.path.join(args.checkpoint, "optim.safetensors")
        keys = [f"optim.{slot}.{fqn}" for fqn, _, _ in named
                for slot in ("exp_avg", "exp_avg_sq")]
        optim_state = load_safetensors(optim_file, keys, device)
    steps_taken = int((meta.get("extra") or {}).get("optimizer_steps", start_step))
    if args.optimizer_impl == "exact":
        opt = ExactAdamW(named, ts, steps_taken, optim_state)
    else:
        opt = TorchAdamW(named, ts, args.optimizer_impl, steps_taken, optim_state)
    del optim_state
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0

    loss_fn = model
    if args.mode == "compile":
        kw = {} if args.compile_mode == "default" else {"mode": args.compile_mode}
        loss_fn = torch.compile(model, fullgraph=True, dynamic=False, **kw)
    params = [p for _, p, _ in named]

    tokens = B * T * ts.grad_accum  # no target is -100 in a token stream
    scale = 1.0 / tokens
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_steps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_steps)]
    step_losses, norms, lrs, wall = [], [], [], []
    torch.cuda.reset_peak_memory_stats()
    peak_warmup = 0
    for i in range(n_steps):
        if i == args.timing_warmup:
            torch.cuda.synchronize()
            peak_warmup = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        w0 = time.perf_counter()
        starts[i].record()
        mb_losses = []
        for inputs, targets in batches[i]:
            for inp, tgt in zip(inputs.chunk(ts.microbatches), targets.chunk(ts.microbatches)):
                loss = loss_fn(inp.to(device, non_blocking=True),
                               tgt.to(device, non_blocking=True))
                (loss * scale).backward()
                mb_losses.append(loss.detach())
        if args.optimizer_impl == "exact":
            norm = clip_exact(named, ts.max_norm)
        elif ts.max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, ts.max_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        lr = lr_at(ts, start_step + i + 1)
        opt.step(lr)
        opt.zero_grad()
        ends[i].record()
        step_losses.append(mb_losses)
        norms.append(norm.detach())
        lrs.append(lr)
        if i < args.timing_warmup:  # wall time of the warm-up steps (compile)
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - w0)
    torch.cuda.synchronize()
    peak_timed = torch.cuda.max_memory_allocated()

    losses = [sum(float(l.item()) for l in ls) / tokens for ls in step_losses]
    grad_norms = [float(n.item()) for n in norms]
    step_s = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
    timed = step_s[args.timing_warmup:]
    median = statistics.median(timed)
    fpt = flops_per_token(spec, T)
    dev_name = torch.cuda.get_device_name()
    peak = args.peak_flops or device_peak_flops(dev_name, compute_dtype)
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
        "spec": asdict(spec),
        "params": parameter_count(spec),
        "batch": B, "seq_len": T, "grad_accum": ts.grad_accum,
        "tokens_per_step": tokens,
        "start_step": start_step, "steps": n_steps, "timing_warmup": args.timing_warmup,
        "optimizer_impl": args.optimizer_impl, "rope_dtype": args.rope_dtype,
        "median_step_s": median,
        "step_s": step_s,
        "tokens_per_s": tok_s,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "mfu": fpt * tok_s / peak if peak else None,
        "peak_memory_bytes": peak_timed,
        "peak_memory_warmup_bytes": peak_warmup,
        "first_step_wall_s": wall[0] if wall else None,
        "compile_s": (wall[0] - median) if (wall and args.mode == "compile") else None,
        "load_s": load_s,
        "losses": losses,
        "grad_norms": grad_norms,
        "lrs": lrs,
    }
    for i, (l, g) in enumerate(zip(losses[:5], grad_norms)):
        print(f"step {start_step + i + 1:5d} | loss {l:.6f} | grad_norm {g:.4f} | "
              f"lr {lrs[i]:.3e} | {step_s[i] * 1e3:.1f} ms")
    if not all(math.isfinite(l) for l in losses):
        print("warning: a loss is not finite", file=sys.stderr)
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
                    help="a summary JSON of torch_llama.py (repeatable)")
    ap.add_argument("--checkpoint", help="step folder: the FLOP count when no peer ran")
    ap.add_argument("--timing-warmup", type=int, default=3)
    ap.add_argument("--peak-flops", type=float, default=PEAK_BF16_FLOPS)
    ap.add_argument("--loss-rtol", type=float, default=1e-2,
                    help="relative loss difference still called agreement (bf16)")
    ap.add_argument("--out", help="append the table here")
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
        fpt = flops_per_token(llama_spec_from_config(cfg),
                              train_settings_from_config(cfg).seq_len)
    rows = []
    vd = None
    if args.viaduct_metrics and os.path.isfile(args.viaduct_metrics) and fpt:
        vd = viaduct_summary(args.viaduct_metrics, args.timing_warmup, fpt,
                             args.peak_flops)
        rows.append(vd)
    elif args.viaduct_metrics:
        rows.append({"impl": "viaduct", "failed": True})
    rows.extend(peers)

    lines = []
    if args.header:
        lines += ["| cell | impl | tok/s | MFU | peak GiB | loss steps 1-5 | "
                  "rel Δloss vs viaduct: step 1 / max 1-5 | viaduct ÷ this: tok/s, mem |",
                  "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {args.cell} | {r['impl']} | failed | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        gib = r["peak_memory_bytes"] / 2**30
        dl = ratio = ""
        if vd is not None and r is not vd:
            n = min(len(vd["losses"]), len(r["losses"]), 5)
            rels = [abs(a - b) / max(abs(a), 1e-12)
                    for a, b in zip(vd["losses"][:n], r["losses"][:n])]
            dl = (f"{rels[0]:.1e} / {max(rels):.1e} "
                  f"{'ok' if max(rels) <= args.loss_rtol else 'DIFFERS'}")
            ratio = (f"{vd['tokens_per_s'] / r['tokens_per_s']:.2f}x, "
                     f"{vd['peak_memory_bytes'] / r['peak_memory_bytes']:.2f}x")
        extra = ""
        if r.get("compile_s") is not None:
            extra = f" (compile {r['compile_s']:.0f} s)"
        lines.append(f"| {args.cell} | {r['impl']}{extra} | {r['tokens_per_s']:.0f} | "
                     f"{mfu} | {gib:.1f} | {fmt_losses(r['losses'])} | {dl} | {ratio} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


def main(argv):
    if argv and argv[0] == "report":
        return report_main(argv[1:])
    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
