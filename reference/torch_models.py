"""PyTorch references of viaduct's three model families, op for op.

torch_llama.py (the driver: checkpoint, data, training, timing, report)
imports this module; the family comes from the checkpoint's model.family.
Each family has a spec (a flavor with the config's [model] overrides, as
viaduct applies them), a FLOP count per token (viaduct's formula for that
family, so MFU is computed the same way for every row), and an nn.Module whose
forward(tokens, targets) returns the summed fp32 token cross-entropy.

  llama    src/model/llama.cpp, chain_transformer.cpp, layers.cpp
  gpt2     src/model/gpt2.cpp, chain_transformer.cpp, layers.cpp
  kimi_k3  src/model/kimi_k3.cpp, attn_res.cpp, kda.cpp, mla.cpp, moe.cpp
           (model.attn_res = false: plain residuals; the vision tower is not
           implemented)

Note [Mixed precision] of viaduct is followed everywhere: fp32 parameters,
the embedding output cast to the compute dtype, every linear casting its fp32
weight to the activation's dtype, norms / softmaxes / recurrences in fp32
returning the input dtype.

Peer kernels: with VIADUCT_PEER_ANCHOR set to a copy of
flash-linear-attention (../shared/anchors/kda), the K3 reference is the
strongest a PyTorch user could pick rather than op for op: KDA's gated delta
rule through fla's chunk_kda (the gate, beta and q/k normalisation in the
kernel, bf16 inputs), and the MoE's routed experts through torch._grouped_mm
over tokens dispatched into padded expert groups. Same parameters, same
formulas; the losses agree to bf16 noise, not bit for bit.

The spec part needs only the standard library (dry runs work without torch).
Torch 1.13 (Debian, CPU) and 2.x (the GPU wheel) both run the models: the
2.x-only APIs (scaled_dot_product_attention, torch.compile helpers) have
1.13 fallbacks below.
"""

import math
import sys
from dataclasses import asdict, dataclass, field

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:  # specs and FLOP counts work without torch
    torch = None
    nn = None
    F = None


PROG = "torch_llama.py"  # the program errors name (torch_pipeline.py sets its own)


def fail(msg):
    sys.exit(f"{PROG}: error: {msg}")


def cfg_get(cfg, dotted, default=None):
    section, key = dotted.split(".", 1)
    return cfg.get(section, {}).get(key, default)


# ================================================================= specs

# ------------------------------------------------------------ chain (llama, gpt2)


@dataclass
class ChainSpec:
    """src/model/chain_transformer.h ChainSpec (llama and gpt2)."""
    family: str
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
    gpt2: bool = False  # LayerNorm, GELU MLP, biases, learned positions

    @property
    def head_dim(self):
        return self.dim // self.n_heads


def _llama(*a):
    return ChainSpec("llama", *a)


# src/model/llama.cpp: llama_flavor().
LLAMA_FLAVORS = {
    "debugmodel": _llama(8, 128, 8, 4, 320, 384, 2048, 1e-5, 10000.0),
    "1B": _llama(16, 2048, 32, 8, 128256, 8192, 8192, 1e-5, 500000.0),
    "8B": _llama(32, 4096, 32, 8, 128256, 14336, 8192, 1e-5, 500000.0),
}
# src/model/gpt2.cpp: gpt2_flavor() (ffn 4 D, tied, LayerNorm eps 1e-5).
GPT2_FLAVORS = {
    "debugmodel": ChainSpec("gpt2", 8, 128, 4, 4, 320, 512, 1024, 1e-5, 10000.0, True, True),
    "124M": ChainSpec("gpt2", 12, 768, 12, 12, 50304, 3072, 1024, 1e-5, 10000.0, True, True),
}


def llama_ffn_hidden(dim, multiple_of=256, ffn_dim_multiplier=1.0):
    hidden = 4 * dim
    hidden = 2 * hidden // 3
    hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def chain_spec_from_config(cfg, family):
    """apply_model_overrides(<family>_flavor(flavor), cfg), chain_transformer.cpp."""
    flavors = LLAMA_FLAVORS if family == "llama" else GPT2_FLAVORS
    flavor = cfg_get(cfg, "model.flavor", "debugmodel")
    if flavor not in flavors:
        fail(f"unknown {family} flavor '{flavor}' (known: {', '.join(flavors)})")
    s = ChainSpec(**asdict(flavors[flavor]))
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
        s.ffn_hidden = 4 * s.dim if s.gpt2 else llama_ffn_hidden(s.dim, 256, 1.0)
    s.max_seq_len = m.get("max_seq_len", s.max_seq_len)
    s.norm_eps = float(m.get("norm_eps", s.norm_eps))
    s.rope_theta = float(m.get("rope_theta", s.rope_theta))
    s.tie_embeddings = bool(m.get("tie_embeddings", s.tie_embeddings))
    if s.dim % s.n_heads or s.n_heads % s.n_kv_heads or (not s.gpt2 and s.head_dim % 2):
        fail(f"inconsistent {family} shape {s}")
    return s


def chain_flops_per_token(s, seq_len):
    """Note [FLOPs per token] in src/model/chain_transformer.cpp."""
    kv = s.n_kv_heads * s.head_dim
    attn = 2 * s.dim * s.dim + 2 * s.dim * kv
    if s.gpt2:
        attn += 2 * s.dim + 2 * kv  # biases
        ffn = 2 * s.dim * s.ffn_hidden + s.ffn_hidden + s.dim
    else:
        ffn = 3 * s.dim * s.ffn_hidden
    matmul_params = s.n_layers * (attn + ffn) + s.vocab_size * s.dim
    return 6.0 * matmul_params + 12.0 * s.n_layers * s.dim * seq_len


# ------------------------------------------------------------------ kimi_k3


@dataclass
class KimiK3Spec:
    """src/model/kimi_k3.h KimiK3Options (with its KDA / MLA / MoE options)."""
    family: str = "kimi_k3"
    flavor: str = "debugmodel"
    n_layers: int = 24
    dim: int = 64
    n_heads: int = 2
    vocab_size: int = 320
    ffn_hidden_dim: int = 192
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    block_size: int = 12
    first_k_dense: int = 1
    mla_interval: int = 4
    moe_ffn: bool = True
    attn_res: bool = True
    # KDA
    kda_head_dim: int = 32
    kda_conv_size: int = 4
    kda_chunk_size: int = 16
    # MLA
    mla_q_lora_rank: int = 0
    mla_kv_lora_rank: int = 32
    mla_qk_nope_head_dim: int = 16
    mla_qk_rope_head_dim: int = 8
    mla_v_head_dim: int = 16
    mla_rope: bool = False
    rope_theta: float = 10000.0
    # MoE
    n_routed_experts: int = 8
    n_activated_experts: int = 2
    moe_hidden_dim: int = 64
    n_shared_experts: int = 1
    moe_route_scale: float = 1.0
    moe_bias_update_rate: float = 1e-3

    def is_mla(self, i):
        return i % self.mla_interval == self.mla_interval - 1 or i == self.n_layers - 1

    def is_moe(self, i):
        return self.moe_ffn and i >= self.first_k_dense

    def opens_block(self, i):
        return i % self.block_size == 0

    def block_of(self, i):
        return i // self.block_size


def k3_flavor(flavor):
    """flavor_defaults() of src/model/kimi_k3.cpp."""
    s = KimiK3Spec(flavor=flavor)
    if flavor == "debugmodel":
        s.n_layers = 24
    elif flavor == "debugmodel_deep":
        s.n_layers = 33
    elif flavor == "full":
        s.n_layers, s.dim, s.n_heads, s.vocab_size = 93, 2048, 16, 163840
        s.ffn_hidden_dim, s.max_seq_len = 9216, 8192
        s.kda_head_dim, s.kda_chunk_size = 128, 64
        s.mla_kv_lora_rank, s.mla_qk_nope_head_dim = 512, 128
        s.mla_qk_rope_head_dim, s.mla_v_head_dim = 64, 128
        s.n_routed_experts, s.n_activated_experts, s.moe_hidden_dim = 128, 8, 1024
        s.moe_route_scale = 2.446
    else:
        fail(f"model.flavor '{flavor}' is not a kimi_k3 flavor (debugmodel, "
             "debugmodel_deep, full)")
    return s


# [model] key -> KimiK3Spec field, as kimi_k3_options() reads them.
K3_KEYS = {
    "n_layers": "n_layers", "dim": "dim", "n_heads": "n_heads",
    "vocab_size": "vocab_size", "ffn_hidden_dim": "ffn_hidden_dim",
    "max_seq_len": "max_seq_len", "norm_eps": "norm_eps",
    "attn_res_block_size": "block_size", "first_k_dense": "first_k_dense",
    "mla_interval": "mla_interval", "moe_ffn": "moe_ffn", "attn_res": "attn_res",
    "kda_head_dim": "kda_head_dim", "kda_chunk_size": "kda_chunk_size",
    "kda_conv_size": "kda_conv_size", "mla_q_lora_rank": "mla_q_lora_rank",
    "mla_kv_lora_rank": "mla_kv_lora_rank",
    "mla_qk_nope_head_dim": "mla_qk_nope_head_dim",
    "mla_qk_rope_head_dim": "mla_qk_rope_head_dim",
    "mla_v_head_dim": "mla_v_head_dim", "mla_rope": "mla_rope",
    "rope_theta": "rope_theta", "n_routed_experts": "n_routed_experts",
    "n_activated_experts": "n_activated_experts",
    "moe_hidden_dim": "moe_hidden_dim", "n_shared_experts": "n_shared_experts",
    "moe_route_scale": "moe_route_scale",
    "moe_bias_update_rate": "moe_bias_update_rate",
}


def k3_spec_from_config(cfg):
    s = k3_flavor(cfg_get(cfg, "model.flavor", "debugmodel"))
    m = cfg.get("model", {})
    for key, fld in K3_KEYS.items():
        if key in m:
            cur = getattr(s, fld)
            setattr(s, fld, type(cur)(m[key]))
    if m.get("vision", False):
        fail("model.vision = true: the kimi_k3 reference has no vision tower")
    if s.dim <= 0 or s.n_heads <= 0 or s.block_size <= 0 or s.kda_head_dim <= 0:
        fail(f"inconsistent kimi_k3 shape {s}")
    return s


def k3_flops_per_token(s, seq_len):
    """describe_kimi_k3() and Note [Kimi-K3 FLOPs per token] of kimi_k3.cpp."""
    D, V = s.dim, s.vocab_size
    hk = s.n_heads * s.kda_head_dim
    dk = s.kda_head_dim
    kda_params = (3 * D * hk + 3 * hk * s.kda_conv_size + (D * dk + dk * hk)
                  + s.n_heads + hk + D * s.n_heads + (D * dk + dk * hk + hk)
                  + dk + hk * D)
    qk = s.mla_qk_nope_head_dim + s.mla_qk_rope_head_dim
    if s.mla_q_lora_rank > 0:
        mla_params = (D * s.mla_q_lora_rank + s.mla_q_lora_rank
                      + s.mla_q_lora_rank * s.n_heads * qk)
    else:
        mla_params = D * s.n_heads * qk
    mla_params += D * (s.mla_kv_lora_rank + s.mla_qk_rope_head_dim) + s.mla_kv_lora_rank
    mla_params += s.mla_kv_lora_rank * s.n_heads * (s.mla_qk_nope_head_dim + s.mla_v_head_dim)
    mla_params += s.n_heads * s.mla_v_head_dim * D
    moe_active = D * s.n_routed_experts + 3 * D * s.moe_hidden_dim * (
        s.n_activated_experts + s.n_shared_experts)
    C, d = float(s.kda_chunk_size), float(dk)
    kda_mixing = 3.0 * (4 * C * d + C * 2 * d + 2 * C * d + 6 * d * d) * s.n_heads
    mla_mixing = 6.0 * seq_len * s.n_heads * (qk + s.mla_v_head_dim)

    def read(n_sources):
        return 6.0 * n_sources * D

    active = V * D
    mixing = 0.0
    for i in range(s.n_layers):
        common = 2 * D + (4 * D if s.attn_res else 0)
        common += mla_params if s.is_mla(i) else kda_params
        active += common
        active += moe_active if s.is_moe(i) else 3 * D * s.ffn_hidden_dim
        mixing += mla_mixing if s.is_mla(i) else kda_mixing
        if s.attn_res:
            first = s.block_of(i) + (1 if s.opens_block(i) else 2)
            mixing += 3 * (read(first) + read(s.block_of(i) + 2))
    active += D + D * V + (2 * D if s.attn_res else 0)
    if s.attn_res:
        n_blocks = (s.n_layers + s.block_size - 1) // s.block_size
        mixing += 3 * read(n_blocks + 1)
    return 6.0 * (active - V * D) + mixing


# ------------------------------------------------------------ dispatch


def spec_from_config(cfg):
    family = cfg_get(cfg, "model.family", "llama")
    if family in ("llama", "gpt2"):
        return chain_spec_from_config(cfg, family)
    if family == "kimi_k3":
        return k3_spec_from_config(cfg)
    fail(f"model.family '{family}' has no reference (llama, gpt2, kimi_k3)")


def flops_per_token(spec, seq_len):
    if spec.family == "kimi_k3":
        return k3_flops_per_token(spec, seq_len)
    return chain_flops_per_token(spec, seq_len)


# ================================================================ models

if torch is not None:
    TORCH2 = int(torch.__version__.split(".")[0]) >= 2

    def _peer_kernels():
        """fla's chunk_kda and torch._grouped_mm when VIADUCT_PEER_ANCHOR asks
        for them (see the module's doc); (None, False) otherwise."""
        import os
        anchor = os.environ.get("VIADUCT_PEER_ANCHOR", "")
        if not anchor:
            return None, False
        sys.path.insert(0, anchor)
        try:
            from fla.ops.kda import chunk_kda
        except Exception as e:  # noqa: BLE001 -- say why, run op for op
            print(f"{PROG}: VIADUCT_PEER_ANCHOR={anchor}: fla not importable ({e}); "
                  "KDA runs op for op", file=sys.stderr)
            chunk_kda = None
        grouped = hasattr(torch, "_grouped_mm")
        print(f"{PROG}: peer kernels: KDA {'fla chunk_kda' if chunk_kda else 'op for op'}, "
              f"MoE {'torch._grouped_mm' if grouped else 'per-expert loop'}", file=sys.stderr)
        return chunk_kda, grouped

    FLA_CHUNK_KDA, GROUPED_MM = _peer_kernels()

    def linear(x, w, b=None):
        # Note [Mixed precision]: the fp32 weight (and bias) cast to x's dtype.
        w = w if w.dtype == x.dtype else w.to(x.dtype)
        if b is not None and b.dtype != x.dtype:
            b = b.to(x.dtype)
        return F.linear(x, w, b)

    def causal_sdpa(q, k, v):
        # compat::causal_sdpa of src/core/torch_compat.h. q, k, v: [B, H, T, hd].
        if TORCH2:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        return F._scaled_dot_product_attention(q, k, v, None, 0.0, False, True)[0]

    def compile_disable(fn):
        """Run fn eagerly under torch.compile (data-dependent MoE dispatch)."""
        compiler = getattr(torch, "compiler", None)
        if compiler is not None and hasattr(compiler, "disable"):
            return compiler.disable(fn)
        return fn

    def upcast(dtype):
        return torch.float64 if dtype == torch.float64 else torch.float32

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            xf = x if x.dtype == torch.float64 else x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (y * self.weight).to(x.dtype)

    class LayerNorm(nn.Module):
        def __init__(self, dim, eps):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))

        def forward(self, x):
            y = F.layer_norm(x.to(upcast(x.dtype)), (self.weight.size(0),),
                             self.weight, self.bias, self.eps)
            return y.to(x.dtype)

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

    def summed_cross_entropy(logits, targets):
        # summed_cross_entropy of src/model/model.cpp: fp32 (fp64 for fp64).
        V = logits.size(-1)
        t = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return F.cross_entropy(logits.reshape(-1, V).to(t), targets.reshape(-1),
                               reduction="sum", ignore_index=-100)

    class SwiGLU(nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.w1 = nn.Linear(dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, dim, bias=False)
            self.w3 = nn.Linear(dim, hidden, bias=False)

        def forward(self, x):
            return linear(F.silu(linear(x, self.w1.weight)) * linear(x, self.w3.weight),
                          self.w2.weight)

    # -------------------------------------------------------- chain models

    class Attention(nn.Module):
        """AttentionImpl of layers.cpp: GQA by repeat_interleave, causal SDPA."""

        def __init__(self, s):
            super().__init__()
            self.n_heads, self.n_kv_heads, self.head_dim = s.n_heads, s.n_kv_heads, s.head_dim
            self.rope = not s.gpt2
            kv = s.n_kv_heads * s.head_dim
            self.wq = nn.Linear(s.dim, s.dim, bias=s.gpt2)
            self.wk = nn.Linear(s.dim, kv, bias=s.gpt2)
            self.wv = nn.Linear(s.dim, kv, bias=s.gpt2)
            self.wo = nn.Linear(s.dim, s.dim, bias=s.gpt2)

        def forward(self, x, cos, sin):
            # x: [B, T, D]
            B, T, _ = x.shape
            H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
            q = linear(x, self.wq.weight, self.wq.bias).view(B, T, H, hd)
            k = linear(x, self.wk.weight, self.wk.bias).view(B, T, KV, hd)
            v = linear(x, self.wv.weight, self.wv.bias).view(B, T, KV, hd)
            if self.rope:
                q = apply_rope(q, cos, sin)
                k = apply_rope(k, cos, sin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if KV != H:
                k = k.repeat_interleave(H // KV, 1)
                v = v.repeat_interleave(H // KV, 1)
            y = causal_sdpa(q, k, v)  # [B, H, T, hd]
            y = y.transpose(1, 2).reshape(B, T, H * hd)
            return linear(y, self.wo.weight, self.wo.bias)

    class GeluMLP(nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.w1 = nn.Linear(dim, hidden, bias=True)
            self.w2 = nn.Linear(hidden, dim, bias=True)

        def forward(self, x):
            h = F.gelu(linear(x, self.w1.weight, self.w1.bias), approximate="tanh")
            return linear(h, self.w2.weight, self.w2.bias)

    class ChainBlock(nn.Module):
        def __init__(self, s):
            super().__init__()
            norm = LayerNorm if s.gpt2 else RMSNorm
            # Registration order = viaduct's parameter order.
            self.attention_norm = norm(s.dim, s.norm_eps)
            self.attention = Attention(s)
            self.ffn_norm = norm(s.dim, s.norm_eps)
            self.feed_forward = GeluMLP(s.dim, s.ffn_hidden) if s.gpt2 else \
                SwiGLU(s.dim, s.ffn_hidden)

        def forward(self, x, cos, sin):
            h = x + self.attention(self.attention_norm(x), cos, sin)
            return h + self.feed_forward(self.ffn_norm(h))

    class ChainTransformer(nn.Module):
        """llama and gpt2 (ChainTransformer of chain_transformer.cpp).
        forward returns the summed fp32 token cross-entropy."""

        def __init__(self, s, compute_dtype):
            super().__init__()
            self.spec, self.compute_dtype = s, compute_dtype
            self.tok_embeddings = nn.Embedding(s.vocab_size, s.dim)
            if s.gpt2:
                self.pos_embeddings = nn.Embedding(s.max_seq_len, s.dim)
            self.layers = nn.ModuleList(ChainBlock(s) for _ in range(s.n_layers))
            self.norm = (LayerNorm if s.gpt2 else RMSNorm)(s.dim, s.norm_eps)
            self.lm_head = None if s.tie_embeddings else \
                nn.Linear(s.dim, s.vocab_size, bias=False)
            self.register_buffer("rope_cos", None, persistent=False)
            self.register_buffer("rope_sin", None, persistent=False)

        def init_buffers(self, device, rope_dtype):
            if self.spec.gpt2:
                return
            cos, sin = rope_tables(self.spec.head_dim, self.spec.max_seq_len,
                                   self.spec.rope_theta)
            self.register_buffer("rope_cos", cos.to(device=device, dtype=rope_dtype),
                                 persistent=False)
            self.register_buffer("rope_sin", sin.to(device=device, dtype=rope_dtype),
                                 persistent=False)

        def forward(self, tokens, targets):
            # tokens, targets: [B, T] int64
            T = tokens.size(1)
            h = self.tok_embeddings(tokens)  # [B, T, D] fp32
            if self.spec.gpt2:
                h = h + self.pos_embeddings.weight[:T].unsqueeze(0)
            if h.dtype != self.compute_dtype:
                h = h.to(self.compute_dtype)
            for layer in self.layers:
                h = layer(h, self.rope_cos, self.rope_sin)
            h = self.norm(h)
            w = self.tok_embeddings.weight if self.lm_head is None else self.lm_head.weight
            return summed_cross_entropy(linear(h, w), targets)  # logits [B, T, V]

    # -------------------------------------------------------------- kimi_k3

    class AttnResRead(nn.Module):
        """Note [AttnRes stack]: softmax over depth of w . RMSNorm(v)."""

        def __init__(self, dim, eps):
            super().__init__()
            self.query = nn.Parameter(torch.zeros(dim))
            self.norm = RMSNorm(dim, eps)

        def forward(self, sources):
            # sources: N tensors [B, T, D] -> [B, T, D] in their dtype
            dtype = sources[0].dtype
            v = torch.stack(sources, 0)  # [N, B, T, D]
            v = v if v.dtype == torch.float64 else v.float()
            q = self.query.to(v.dtype)
            logits = torch.matmul(self.norm(v), q)  # [N, B, T]
            alpha = torch.softmax(logits, 0)
            return (alpha.unsqueeze(-1) * v).sum(0).to(dtype)

    def l2_normalize(x, eps):
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)

    def kda_chunked(q, k, v, g, beta, C):
        """kda_chunked of src/model/kda.cpp: the WY form per chunk, a scan over
        chunks. q, k: [B, T, H, dk]; v: [B, T, H, dv]; g: [B, T, H, dk];
        beta: [B, T, H] -> [B, T, H, dv] in the inner type."""
        st = upcast(q.dtype)
        B, T, H, dk = q.shape
        dv = v.size(3)
        pad = (C - T % C) % C
        N = (T + pad) // C

        def prep(x):
            h = x.to(st).transpose(1, 2)  # [B, H, T, d]
            if pad:
                h = F.pad(h, (0, 0, 0, pad))
            return h.reshape(B, H, N, C, h.size(-1))

        qc, kc, vc, gc = prep(q), prep(k), prep(v), prep(g)
        bc = beta.to(st).transpose(1, 2)
        if pad:
            bc = F.pad(bc, (0, pad))
        bc = bc.reshape(B, H, N, C)
        G = gc.cumsum(-2)
        incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        diff = G.unsqueeze(-2) - G.unsqueeze(-3)
        decay = diff.masked_fill(incl.logical_not().unsqueeze(-1), float("-inf")).exp()
        Aqk = (qc.unsqueeze(-2) * kc.unsqueeze(-3) * decay).sum(-1)
        strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
        Lm = ((kc.unsqueeze(-2) * kc.unsqueeze(-3) * decay).sum(-1)
              * bc.unsqueeze(-1)).masked_fill(strict.logical_not(), 0.0)
        eye = torch.eye(C, dtype=qc.dtype, device=qc.device)
        eG = G.exp()
        rhs = torch.cat((eG * kc, vc), -1) * bc.unsqueeze(-1)
        WU = torch.linalg.solve_triangular(Lm + eye, rhs, upper=False, left=True,
                                           unitriangular=True)
        W = WU.narrow(-1, 0, dk)
        U = WU.narrow(-1, dk, dv)
        qe = qc * eG
        G_last = G.narrow(-2, C - 1, 1)
        k_to_end = kc * (G_last - G).exp()
        decay_chunk = G_last.exp().transpose(-1, -2)  # [B, H, N, dk, 1]
        o = kda_scan(W, U, qe, Aqk, k_to_end, decay_chunk)  # [B, H, N, C, dv]
        o = o.reshape(B, H, N * C, dv).narrow(2, 0, T)
        return o.transpose(1, 2)

    @compile_disable
    def kda_scan(W, U, qe, Aqk, k_to_end, decay_chunk):
        """The sequential scan over chunks (eager under torch.compile: unrolled,
        its N steps would make every KDA layer's graph N times larger)."""
        B, H, N, _, dk = W.shape
        dv = U.size(-1)
        S = torch.zeros(B, H, dk, dv, dtype=W.dtype, device=W.device)
        outs = []
        for n in range(N):
            v_new = U[:, :, n] - torch.matmul(W[:, :, n], S)
            outs.append(torch.matmul(qe[:, :, n], S) + torch.matmul(Aqk[:, :, n], v_new))
            S = decay_chunk[:, :, n] * S + torch.matmul(
                k_to_end[:, :, n].transpose(-1, -2), v_new)
        return torch.stack(outs, 2)

    class ShortConv(nn.Module):
        def __init__(self, channels, kernel):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(channels, kernel))

        def forward(self, x):
            # x: [B, T, C]; depthwise causal convolution, then SiLU.
            T, K = x.size(1), self.weight.size(1)
            w = self.weight.to(x.dtype).unsqueeze(1)  # [C, 1, K]
            y = F.conv1d(x.transpose(1, 2), w, None, 1, K - 1, 1, self.weight.size(0))
            return F.silu(y.narrow(2, 0, T).transpose(1, 2))

    class Kda(nn.Module):
        """KdaImpl of src/model/kda.cpp."""

        def __init__(self, s):
            super().__init__()
            H, d, D = s.n_heads, s.kda_head_dim, s.dim
            hk = H * d
            self.H, self.d, self.C = H, d, s.kda_chunk_size
            self.q_proj = nn.Linear(D, hk, bias=False)
            self.k_proj = nn.Linear(D, hk, bias=False)
            self.v_proj = nn.Linear(D, hk, bias=False)
            self.q_conv = ShortConv(hk, s.kda_conv_size)
            self.k_conv = ShortConv(hk, s.kda_conv_size)
            self.v_conv = ShortConv(hk, s.kda_conv_size)
            self.f_a = nn.Linear(D, d, bias=False)
            self.f_b = nn.Linear(d, hk, bias=False)
            self.A_log = nn.Parameter(torch.zeros(H))
            self.dt_bias = nn.Parameter(torch.zeros(hk))
            self.b_proj = nn.Linear(D, H, bias=False)
            self.g_a = nn.Linear(D, d, bias=False)
            self.g_b = nn.Linear(d, hk, bias=True)
            self.o_norm = RMSNorm(d, s.norm_eps)
            self.o_proj = nn.Linear(hk, D, bias=False)

        def forward(self, x):
            # x: [B, T, D]
            if FLA_CHUNK_KDA is not None and x.is_cuda:
                return self.forward_fla(x)
            B, T, _ = x.shape
            H, d = self.H, self.d
            st = upcast(x.dtype)
            q = self.q_conv(linear(x, self.q_proj.weight)).view(B, T, H, d)
            k = self.k_conv(linear(x, self.k_proj.weight)).view(B, T, H, d)
            v = self.v_conv(linear(x, self.v_proj.weight)).view(B, T, H, d)
            q = l2_normalize(q.to(st), 1e-6) * (1.0 / math.sqrt(d))
            k = l2_normalize(k.to(st), 1e-6)
            f = linear(linear(x, self.f_a.weight), self.f_b.weight).to(st) + \
                self.dt_bias.to(st)
            g = -(self.A_log.to(st).exp().view(1, 1, H, 1)) * F.softplus(f.view(B, T, H, d))
            beta = torch.sigmoid(linear(x, self.b_proj.weight).to(st))  # [B, T, H]
            o = kda_chunked(q, k, v, g, beta, self.C)
            return self.output(x, o)

        def forward_fla(self, x):
            # The same layer with fla's chunk_kda as the mixer (peer kernels).
            B, T, _ = x.shape
            H, d = self.H, self.d
            q = self.q_conv(linear(x, self.q_proj.weight)).view(B, T, H, d)
            k = self.k_conv(linear(x, self.k_proj.weight)).view(B, T, H, d)
            v = self.v_conv(linear(x, self.v_proj.weight)).view(B, T, H, d)
            f = linear(linear(x, self.f_a.weight), self.f_b.weight).view(B, T, H, d)
            b = linear(x, self.b_proj.weight)  # [B, T, H]
            o, _ = FLA_CHUNK_KDA(q, k, v, f, b, A_log=self.A_log, dt_bias=self.dt_bias,
                                 use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                 use_beta_sigmoid_in_kernel=True)  # scale d^-1/2
            return self.output(x, o.to(upcast(x.dtype)))

        def output(self, x, o):
            B, T, _ = x.shape
            H, d = self.H, self.d
            st = upcast(x.dtype)
            gate = torch.sigmoid(
                linear(linear(x, self.g_a.weight), self.g_b.weight, self.g_b.bias).to(st)
            ).view(B, T, H, d)
            o = self.o_norm(o) * gate  # [B, T, H, dv]
            return linear(o.reshape(B, T, H * d).to(x.dtype), self.o_proj.weight)

    class Mla(nn.Module):
        """MlaImpl of src/model/mla.cpp (non-absorbed training form)."""

        def __init__(self, s):
            super().__init__()
            D, H = s.dim, s.n_heads
            self.H, self.nope, self.pe = H, s.mla_qk_nope_head_dim, s.mla_qk_rope_head_dim
            self.vd, self.kv_lora = s.mla_v_head_dim, s.mla_kv_lora_rank
            qk = self.nope + self.pe
            self.q_lora = s.mla_q_lora_rank
            if self.q_lora > 0:
                self.wq_a = nn.Linear(D, self.q_lora, bias=False)
                self.q_norm = RMSNorm(self.q_lora, s.norm_eps)
                self.wq_b = nn.Linear(self.q_lora, H * qk, bias=False)
            else:
                self.wq = nn.Linear(D, H * qk, bias=False)
            self.wkv_a = nn.Linear(D, self.kv_lora + self.pe, bias=False)
            self.kv_norm = RMSNorm(self.kv_lora, s.norm_eps)
            self.wkv_b = nn.Linear(self.kv_lora, H * (self.nope + self.vd), bias=False)
            self.wo = nn.Linear(H * self.vd, D, bias=False)
            self.rope = s.mla_rope and self.pe > 0
            self.rope_args = (self.pe, s.max_seq_len, s.rope_theta)
            self.register_buffer("rope_cos", None, persistent=False)
            self.register_buffer("rope_sin", None, persistent=False)

        def init_buffers(self, device, rope_dtype=torch.float32):
            if self.rope:
                cos, sin = rope_tables(*self.rope_args)  # fp64, cast at use as viaduct
                self.register_buffer("rope_cos", cos.to(device=device, dtype=rope_dtype),
                                     persistent=False)
                self.register_buffer("rope_sin", sin.to(device=device, dtype=rope_dtype),
                                     persistent=False)

        def forward(self, x):
            B, T, _ = x.shape
            H, nope, pe, vd = self.H, self.nope, self.pe, self.vd
            if self.q_lora > 0:
                q = linear(self.q_norm(linear(x, self.wq_a.weight)), self.wq_b.weight)
            else:
                q = linear(x, self.wq.weight)
            q = q.view(B, T, H, nope + pe)
            kv_a = linear(x, self.wkv_a.weight)  # [B, T, kv_lora + pe]
            c_kv = self.kv_norm(kv_a.narrow(-1, 0, self.kv_lora))
            k_pe = kv_a.narrow(-1, self.kv_lora, pe).view(B, T, 1, pe)
            q_nope = q.narrow(-1, 0, nope)
            q_pe = q.narrow(-1, nope, pe)
            if self.rope:
                q_pe = apply_rope(q_pe, self.rope_cos, self.rope_sin)
                k_pe = apply_rope(k_pe, self.rope_cos, self.rope_sin)
            kv = linear(c_kv, self.wkv_b.weight).view(B, T, H, nope + vd)
            k_nope = kv.narrow(-1, 0, nope)
            v = kv.narrow(-1, nope, vd)
            qf = torch.cat((q_nope, q_pe), -1).transpose(1, 2)
            kf = torch.cat((k_nope, k_pe.expand(B, T, H, pe)), -1).transpose(1, 2)
            y = causal_sdpa(qf, kf, v.transpose(1, 2))  # [B, H, T, vd]
            return linear(y.transpose(1, 2).reshape(B, T, H * vd), self.wo.weight)

    def routed_grouped(moe, xf, idx):
        """The routed experts through torch._grouped_mm (peer kernels): slots
        dispatched into expert groups padded to 16 rows, on the device."""
        N, D = xf.shape
        K, E, A = moe.K, moe.E, 16
        flat = idx.reshape(-1)
        with torch.no_grad():
            order = torch.sort(flat, dim=0, stable=True)[1]
            expert = flat[order]
            counts = torch.bincount(flat, minlength=E)
            padded = ((counts + A - 1) // A * A).clamp_min(A)
            end = torch.cumsum(padded, 0)
            first = torch.cumsum(counts, 0) - counts
            pos_sorted = (end - padded)[expert] + torch.arange(N * K, device=xf.device) - \
                first[expert]
            pos = torch.empty_like(pos_sorted)
            pos[order] = pos_sorted
            offs = end.to(torch.int32)
        if torch.is_grad_enabled():
            if moe.tokens_per_expert is None:
                moe.tokens_per_expert = torch.zeros(E, dtype=torch.int64,
                                                    device=moe.expert_bias.device)
            moe.tokens_per_expert += counts.to(moe.tokens_per_expert.device)
        slots = xf.unsqueeze(1).expand(N, K, D).reshape(N * K, D)
        xs = torch.zeros(N * K + A * E, D, dtype=xf.dtype, device=xf.device).index_copy(
            0, pos, slots)
        w = [p.to(xf.dtype).transpose(-2, -1) for p in
             (moe.experts.w1, moe.experts.w2, moe.experts.w3)]
        h = F.silu(torch._grouped_mm(xs, w[0], offs=offs)) * \
            torch._grouped_mm(xs, w[2], offs=offs)
        ys = torch._grouped_mm(h, w[1], offs=offs)
        return ys.index_select(0, pos).view(N, K, D)

    class GroupedExperts(nn.Module):
        def __init__(self, n, dim, hidden):
            super().__init__()
            self.w1 = nn.Parameter(torch.zeros(n, hidden, dim))
            self.w2 = nn.Parameter(torch.zeros(n, dim, hidden))
            self.w3 = nn.Parameter(torch.zeros(n, hidden, dim))

        def forward_expert(self, e, x):
            return linear(F.silu(linear(x, self.w1[e])) * linear(x, self.w3[e]), self.w2[e])

    class Moe(nn.Module):
        """MoeImpl of src/model/moe.cpp: sigmoid router, top-k with the
        selection-only bias, experts in expert order, shared expert."""

        def __init__(self, s):
            super().__init__()
            self.E, self.K = s.n_routed_experts, s.n_activated_experts
            self.route_scale, self.rate = s.moe_route_scale, s.moe_bias_update_rate
            self.router = nn.Linear(s.dim, self.E, bias=False)
            self.experts = GroupedExperts(self.E, s.dim, s.moe_hidden_dim)
            self.shared_expert = SwiGLU(s.dim, s.moe_hidden_dim * s.n_shared_experts) \
                if s.n_shared_experts > 0 else None
            self.register_buffer("expert_bias", torch.zeros(self.E))
            self.tokens_per_expert = None  # [E] int64 on the bias's device

        def route(self, x):
            st = upcast(x.dtype)
            scores = torch.sigmoid(linear(x.to(st), self.router.weight))  # [N, E]
            with torch.no_grad():
                # MoeImpl::route: a stable sort, ties to the lower expert id.
                idx = torch.sort(scores.detach() + self.expert_bias.to(st), dim=-1,
                                 descending=True, stable=True)[1][..., :self.K]
            w = scores.gather(-1, idx)
            return idx, w / w.sum(-1, keepdim=True) * self.route_scale

        @compile_disable
        def routed(self, xf, idx):
            # Data-dependent (per-expert token counts): eager under torch.compile.
            N, D = xf.shape
            K, E = self.K, self.E
            flat = idx.reshape(-1)
            with torch.no_grad():
                order = torch.sort(flat, dim=0, descending=False, stable=True)[1]
                counts = torch.bincount(flat, minlength=E).cpu()
            if torch.is_grad_enabled():  # only training forwards count
                if self.tokens_per_expert is None:
                    self.tokens_per_expert = torch.zeros(E, dtype=torch.int64,
                                                         device=self.expert_bias.device)
                self.tokens_per_expert += counts.to(self.tokens_per_expert.device)
            token_of = torch.div(order, K, rounding_mode="floor")
            outs, start = [], 0
            for e, c in enumerate(counts.tolist()):
                if c == 0:
                    continue
                tok = token_of.narrow(0, start, c)
                outs.append(self.experts.forward_expert(e, xf.index_select(0, tok)))
                start += c
            sorted_out = torch.cat(outs, 0)  # [N K, D]
            inverse = torch.argsort(order)
            return sorted_out.index_select(0, inverse).view(N, K, D)

        def forward(self, x):
            D = x.size(-1)
            xf = x.reshape(-1, D)
            idx, w = self.route(xf)
            if GROUPED_MM and xf.is_cuda and xf.dtype == torch.bfloat16:
                y = routed_grouped(self, xf, idx)
            else:
                y = self.routed(xf, idx)
            y = (y * w.to(y.dtype).unsqueeze(-1)).sum(1)
            if self.shared_expert is not None:
                y = y + self.shared_expert(xf)
            return y.view(x.shape)

        @torch.no_grad()
        def update_bias(self):
            if self.tokens_per_expert is None:
                return
            load = self.tokens_per_expert.to(self.expert_bias.dtype)
            if float(load.sum()) > 0:
                delta = self.rate * torch.sign(load.mean() - load)
                self.expert_bias.add_(delta - delta.mean())
            self.tokens_per_expert.zero_()

    class KimiK3Layer(nn.Module):
        """KimiK3LayerImpl: AttnRes reads (or plain residuals), KDA or MLA,
        dense SwiGLU or MoE."""

        def __init__(self, s, i):
            super().__init__()
            self.attn_res = s.attn_res
            self.opens_block = s.attn_res and s.opens_block(i)
            if s.attn_res:
                self.attn_res_attn = AttnResRead(s.dim, s.norm_eps)
            self.attention_norm = RMSNorm(s.dim, s.norm_eps)
            self.attention = Mla(s) if s.is_mla(i) else Kda(s)
            if s.attn_res:
                self.attn_res_ffn = AttnResRead(s.dim, s.norm_eps)
            self.ffn_norm = RMSNorm(s.dim, s.norm_eps)
            self.is_moe = s.is_moe(i)
            if self.is_moe:
                self.moe = Moe(s)
            else:
                self.feed_forward = SwiGLU(s.dim, s.ffn_hidden_dim)

        def ffn(self, x):
            return self.moe(x) if self.is_moe else self.feed_forward(x)

        def forward(self, hidden, blocks):
            if not self.attn_res:
                h = hidden + self.attention(self.attention_norm(hidden))
                return h + self.ffn(self.ffn_norm(h))
            if self.opens_block:
                blocks.append(hidden)  # the incoming block is complete
                partial = None
                sources = list(blocks)
            else:
                partial = hidden
                sources = blocks + [partial]
            h = self.attn_res_attn(sources)
            a = self.attention(self.attention_norm(h))
            partial = a if partial is None else partial + a
            h = self.attn_res_ffn(blocks + [partial])
            return partial + self.ffn(self.ffn_norm(h))

    class KimiK3(nn.Module):
        """KimiK3Part holding every module; forward returns the summed fp32
        token cross-entropy."""

        def __init__(self, s, compute_dtype):
            super().__init__()
            self.spec, self.compute_dtype = s, compute_dtype
            self.tok_embeddings = nn.Embedding(s.vocab_size, s.dim)
            self.layers = nn.ModuleList(KimiK3Layer(s, i) for i in range(s.n_layers))
            self.norm = RMSNorm(s.dim, s.norm_eps)
            self.lm_head = nn.Linear(s.dim, s.vocab_size, bias=False)
            if s.attn_res:
                self.attn_res_final = AttnResRead(s.dim, s.norm_eps)

        def init_buffers(self, device, rope_dtype):
            for m in self.modules():
                if isinstance(m, Mla):
                    m.init_buffers(device, rope_dtype)

        def moe_layers(self):
            return [m for m in self.modules() if isinstance(m, Moe)]

        def after_optimizer_step(self):
            for m in self.moe_layers():
                if m.rate > 0:
                    m.update_bias()

        def forward(self, tokens, targets):
            h = F.embedding(tokens, self.tok_embeddings.weight)  # [B, T, D]
            hidden = h.to(self.compute_dtype)
            blocks = []
            for layer in self.layers:
                hidden = layer(hidden, blocks)
            if self.spec.attn_res:
                hidden = self.attn_res_final(blocks + [hidden])
            logits = linear(self.norm(hidden), self.lm_head.weight)  # [B, T, V]
            return summed_cross_entropy(logits, targets)

    def make_model(spec, compute_dtype):
        if spec.family == "kimi_k3":
            return KimiK3(spec, compute_dtype)
        return ChainTransformer(spec, compute_dtype)

    def compile_model(model, compile_kw):
        """torch.compile as a PyTorch user would: the chain models whole
        (fullgraph); kimi_k3 per layer (its MoE dispatch is data-dependent and
        runs eagerly), with a recompile limit that covers its layer variants."""
        if not hasattr(torch, "compile"):
            fail(f"torch {torch.__version__} has no torch.compile (2.x needed)")
        if model.spec.family != "kimi_k3":
            return torch.compile(model, fullgraph=True, dynamic=False, **compile_kw)
        dyn = torch._dynamo.config
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(dyn, name):
                setattr(dyn, name, max(getattr(dyn, name), 256))
        for i, layer in enumerate(model.layers):
            if hasattr(layer, "compile"):  # in place: FQNs unchanged
                layer.compile(dynamic=False, **compile_kw)
            else:
                model.layers[i] = torch.compile(layer, dynamic=False, **compile_kw)
        return model

    def after_optimizer_step(model):
        if hasattr(model, "after_optimizer_step"):
            model.after_optimizer_step()
