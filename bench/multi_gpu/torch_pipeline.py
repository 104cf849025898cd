#!/usr/bin/env python3
"""PyTorch's own pipeline parallelism as the multi-GPU peer of a viaduct
pipeline run (issue 8): the llama of reference/torch_models.py, cut into the
stages viaduct cut it into, trained with torch.distributed.pipelining.

Everything that decides the numbers comes from viaduct, not from here:
  - the weights: the checkpoint's step-0 (model.safetensors of a pp=1 save or
    model-rank<r>.safetensors of a pipeline save; FQN-keyed, any layout);
  - the settings: the checkpoint's metadata.json (the effective job config),
    read by torch_llama.py exactly as the single-GPU reference does (data,
    cursor, batch, seq_len, LR schedule, AdamW, clipping);
  - the layout: `viaduct split --config ... --json` (--split-json), i.e. per
    stage its modules and rank, the schedule's name and the placement
    (loop: stage s on rank s % pp; v: rank r holds stages r and 2 pp - 1 - r).
    The script checks that torch's stage-to-rank map for that schedule is the
    same, and refuses a split that does not cover the checkpoint's model.

Each rank builds its stages as nn.Modules holding exactly their modules
(tok_embeddings / layers.<i> / norm + lm_head, FQNs as in the checkpoint),
wraps them in PipelineStage and runs the schedule class of viaduct's name
(GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
ZBVZeroBubble, DualPipeV) with the config's micro-batch count. The loss is
viaduct's Note [Loss scaling]: per micro-batch the summed fp32 token
cross-entropy times 1 / (tokens of the whole step), so the gradients torch's
schedule accumulates over micro-batches (scale_grads=False) are those of the
step's mean loss. The optimizer step is viaduct's: one global gradient norm
(per-tensor norms, squared and summed in fp64, all-reduced over every rank),
clip coefficient max_norm / (norm + 1e-6) when below 1, then AdamW with
viaduct's decay groups and lr_at(step) (torch_llama.py's optimizers).

Timing as torch_llama.py: warm-up steps, then CUDA-event step times (the
step's time is the slowest rank's), tokens/s = tokens per step / median step,
MFU over all devices (viaduct's own mfu divides by the world size too), peak
max_memory_allocated per rank over the timed steps. Rank 0 prints the lines
and writes one JSON that `torch_llama.py report --peer` reads.

  torchrun --nproc-per-node 2 bench/multi_gpu/torch_pipeline.py \\
      --checkpoint outputs/x/viaduct/checkpoint/step-0 --split-json split.json
  python3 bench/multi_gpu/torch_pipeline.py --checkpoint ... --split-json ... --dry-run
  python3 bench/multi_gpu/torch_pipeline.py ... --single-process --device cpu --dtype fp32
      (every stage in one process, chained by hand, no torch.distributed: the
       CPU check of stage building, weight loading and loss scaling against
       viaduct's own pipeline run; works on torch 1.13)

Only llama (untied) is supported. torch.distributed.pipelining is imported
inside the functions that use it, so --help and --dry-run need no torch 2.x.
"""

import argparse
import inspect
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

# torch_models and torch_llama live in reference/ at the repository root.
sys.path.insert(0, os.path.normpath(os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "reference")))
import torch_models  # noqa: E402
import torch_llama as tl  # noqa: E402
from torch_models import cfg_get, fail, flops_per_token, spec_from_config  # noqa: E402

torch_models.PROG = "torch_pipeline.py"
torch = torch_models.torch
nn = torch_models.nn


# ------------------------------------------------------------- schedules


@dataclass(frozen=True)
class ScheduleTraits:
    torch_class: str   # in torch.distributed.pipelining.schedules
    placement: str     # "loop" or "v": torch's stage-to-rank map for the class
    single_stage: bool  # one stage per rank: the class takes one stage, not a list
    splits_backward: bool  # I/W actions: torch refuses compiled stages


# viaduct's names (src/pipeline/schedule/generators.cpp) -> torch's classes.
SCHEDULES = {
    "GPipe": ScheduleTraits("ScheduleGPipe", "loop", True, False),
    "1F1B": ScheduleTraits("Schedule1F1B", "loop", True, False),
    "Interleaved1F1B": ScheduleTraits("ScheduleInterleaved1F1B", "loop", False, False),
    "LoopedBFS": ScheduleTraits("ScheduleLoopedBFS", "loop", False, False),
    "InterleavedZeroBubble": ScheduleTraits("ScheduleInterleavedZeroBubble", "loop",
                                            False, True),
    "ZBVZeroBubble": ScheduleTraits("ScheduleZBVZeroBubble", "v", False, True),
    "DualPipeV": ScheduleTraits("ScheduleDualPipeV", "v", False, True),
}


def torch_stage_rank(placement, pp, stage):
    """The rank torch's schedules put a stage on (generate_stage_to_rank_mapping)."""
    if placement == "v":  # down the ranks, then back up: rank r holds r and 2 pp - 1 - r
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def check_microbatches(name, m, pp, num_stages):
    """The shapes torch's constructors refuse, refused first with the key's name."""
    key = "parallelism.pipeline_parallel_microbatches (or --microbatches)"
    if m < 1:
        fail(f"{key} must be >= 1, got {m}")
    if name in ("1F1B", "DualPipeV") and m < num_stages:
        fail(f"schedule {name} needs at least as many micro-batches as stages: "
             f"{key} = {m} < {num_stages}")
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, m // pp)
        if m % rounds:
            fail(f"schedule {name} needs the micro-batch count to be a multiple of "
                 f"max(1, m / pp) = {rounds}: {key} = {m} on pp = {pp}")


# ----------------------------------------------------------------- split


@dataclass
class StagePlan:
    stage: int
    rank: int
    modules: list  # top-level FQNs in model order, e.g. ["layers.7", "norm", "lm_head"]


def llama_module_order(spec):
    return (["tok_embeddings"] + [f"layers.{i}" for i in range(spec.n_layers)]
            + ["norm", "lm_head"])


def read_split(path, spec):
    """`viaduct split --json` -> (split dict, [StagePlan] by stage), checked
    against the checkpoint's model and torch's placement for the schedule."""
    if not path or not os.path.isfile(path):
        fail(f"--split-json '{path}' does not exist (write it with "
             "`build-gpu/viaduct split --config F [overrides] --json > split.json`)")
    try:
        with open(path) as f:
            sp = json.load(f)
    except json.JSONDecodeError as e:
        fail(f"{path} is not JSON ({e}); expected `viaduct split --json`'s output")
    for k in ("stages", "pp", "num_stages", "stages_per_rank", "placement", "schedule",
              "n_layers"):
        if k not in sp:
            fail(f"{path} has no '{k}': not `viaduct split --json`'s output")
    name, pp, S = sp["schedule"], int(sp["pp"]), int(sp["num_stages"])
    if name not in SCHEDULES:
        fail(f"{path}: schedule '{name}' has no torch.distributed.pipelining class "
             f"here (known: {', '.join(SCHEDULES)}; a schedule CSV has none)")
    tr = SCHEDULES[name]
    if sp["placement"] != tr.placement:
        fail(f"{path}: placement '{sp['placement']}' but torch's {tr.torch_class} "
             f"places stages '{tr.placement}'")
    if S != pp * int(sp["stages_per_rank"]) or len(sp["stages"]) != S:
        fail(f"{path}: {len(sp['stages'])} stages listed, num_stages {S}, pp {pp} x "
             f"stages_per_rank {sp['stages_per_rank']}: inconsistent")
    if tr.single_stage and S != pp:
        fail(f"{path}: schedule {name} runs one stage per rank, the split has "
             f"{sp['stages_per_rank']}")
    if tr.placement == "v" and S != 2 * pp:
        fail(f"{path}: schedule {name} needs exactly 2 stages per rank")
    if int(sp["n_layers"]) != spec.n_layers:
        fail(f"{path} splits {sp['n_layers']} layers, the checkpoint's model has "
             f"{spec.n_layers} (run `viaduct split` with the checkpoint's config and "
             "overrides)")
    plans = sorted((StagePlan(int(s["stage"]), int(s["rank"]), list(s["modules"]))
                    for s in sp["stages"]), key=lambda p: p.stage)
    if [p.stage for p in plans] != list(range(S)):
        fail(f"{path}: stage ids {[p.stage for p in plans]} are not 0..{S - 1}")
    for p in plans:
        want = torch_stage_rank(tr.placement, pp, p.stage)
        if p.rank != want:
            fail(f"{path}: stage {p.stage} is on rank {p.rank}, torch's {tr.torch_class} "
                 f"puts it on rank {want}")
        if not p.modules:
            fail(f"{path}: stage {p.stage} holds no module")
    flat = [m for p in plans for m in p.modules]
    if flat != llama_module_order(spec):
        fail(f"{path}: the stages' modules in order are {flat[:3]}...{flat[-3:]}, not "
             f"the llama's tok_embeddings, layers.0..{spec.n_layers - 1}, norm, lm_head")
    if "lm_head" in plans[-1].modules and "norm" not in plans[-1].modules:
        fail(f"{path}: norm and lm_head must be in the last stage together")
    return sp, plans


# ------------------------------------------------------------ checkpoint


def open_checkpoint_parts(step_dir):
    """(metadata, {tensor: (dtype, shape, begin, end)}, {tensor: file}, optim
    files): a checkpoint of any layout (viaduct's part files are FQN-keyed)."""
    meta_path = os.path.join(step_dir, "metadata.json")
    if not os.path.isfile(meta_path):
        fail(f"'{meta_path}' does not exist (pass --checkpoint <folder>/step-<N>; "
             "viaduct writes step-0 with --checkpoint.save_initial=true)")
    with open(meta_path) as f:
        meta = json.load(f)
    names = [r["name"] for r in meta.get("files", [])]
    model_files = sorted(n for n in names if n.startswith("model") and n.endswith(".safetensors"))
    optim_files = sorted(n for n in names if n.startswith("optim") and n.endswith(".safetensors"))
    if not model_files:
        fail(f"{step_dir}: metadata.json lists no model*.safetensors")
    entries, file_of = {}, {}
    for name in model_files:
        path = os.path.join(step_dir, name)
        if not os.path.isfile(path):
            fail(f"{path} is listed in metadata.json but missing")
        part, _, _ = tl.read_safetensors_header(path)
        for t, e in part.items():
            if t in file_of:
                fail(f"tensor '{t}' is in both {file_of[t]} and {path}")
            entries[t], file_of[t] = e, path
    return meta, entries, file_of, [os.path.join(step_dir, n) for n in optim_files]


def load_optimizer_state(optim_files, named, device):
    """{"optim.exp_avg.<fqn>": tensor, ...} for this rank's parameters."""
    where = {}
    for path in optim_files:
        part, _, _ = tl.read_safetensors_header(path)
        for t in part:
            where[t] = path
    out = {}
    for fqn, _, _ in named:
        for slot in ("exp_avg", "exp_avg_sq"):
            key = f"optim.{slot}.{fqn}"
            if key not in where:
                fail(f"the checkpoint's optimizer state has no '{key}'")
            out.update(tl.load_safetensors(where[key], [key], device))
    return out


# ---------------------------------------------------------------- stages

if torch is not None:

    class LlamaStage(nn.Module):
        """A contiguous run of the llama's top-level modules, as
        ChainTransformer of torch_models.py computes them; FQNs as in the
        checkpoint (layers keyed by their global index). forward: tokens
        [mb, T] int64 (first stage) or hidden [mb, T, D] -> hidden, or
        logits [mb, T, V] in the compute dtype (last stage)."""

        def __init__(self, spec, compute_dtype, fqns):
            super().__init__()
            self.spec, self.compute_dtype, self.fqns = spec, compute_dtype, list(fqns)
            if "tok_embeddings" in fqns:
                self.tok_embeddings = nn.Embedding(spec.vocab_size, spec.dim)
            ids = [int(m.split(".", 1)[1]) for m in fqns if m.startswith("layers.")]
            self.layers = nn.ModuleDict({str(i): torch_models.ChainBlock(spec) for i in ids})
            if "norm" in fqns:
                self.norm = torch_models.RMSNorm(spec.dim, spec.norm_eps)
            if "lm_head" in fqns:
                self.lm_head = nn.Linear(spec.dim, spec.vocab_size, bias=False)
            self.register_buffer("rope_cos", None, persistent=False)
            self.register_buffer("rope_sin", None, persistent=False)

        @property
        def is_first(self):
            return "tok_embeddings" in self.fqns

        @property
        def is_last(self):
            return "lm_head" in self.fqns

        def init_buffers(self, device, rope_dtype):
            if len(self.layers):
                cos, sin = torch_models.rope_tables(self.spec.head_dim, self.spec.max_seq_len,
                                                    self.spec.rope_theta)
                self.register_buffer("rope_cos", cos.to(device=device, dtype=rope_dtype),
                                     persistent=False)
                self.register_buffer("rope_sin", sin.to(device=device, dtype=rope_dtype),
                                     persistent=False)

        def forward(self, x):
            h = x
            if self.is_first:
                h = self.tok_embeddings(x)  # [mb, T, D] fp32
                if h.dtype != self.compute_dtype:
                    h = h.to(self.compute_dtype)
            for layer in self.layers.values():
                h = layer(h, self.rope_cos, self.rope_sin)
            if "norm" in self.fqns:
                h = self.norm(h)
            if self.is_last:
                h = torch_models.linear(h, self.lm_head.weight)  # logits [mb, T, V]
            return h


def build_stage_module(spec, plan, entries, file_of, device, compute_dtype, rope_dtype):
    """The stage's module on device with the checkpoint's weights."""
    if torch_models.TORCH2:  # no host copy of the weights before the load
        with torch.device("meta"):
            mod = LlamaStage(spec, compute_dtype, plan.modules)
        mod = mod.to_empty(device=device)
    else:
        mod = LlamaStage(spec, compute_dtype, plan.modules).to(device)
    names = tl.check_shapes(mod, entries, allow_extra=True)
    mod.init_buffers(device, rope_dtype)
    state = dict(mod.named_parameters())
    state.update(dict(mod.named_buffers()))
    with torch.no_grad():
        for name in names:  # one tensor at a time: host memory stays small
            state[name].copy_(tl.load_safetensors(file_of[name], [name], device)[name])
    return mod


def global_clip_(params, max_norm, device, all_reduce=None):
    """viaduct's global_grad_norm + scale_grads with no host sync: per-tensor
    fp32 norms, squared and summed in fp64, summed over the ranks
    (all_reduce), coef = max_norm / (norm + 1e-6) applied when < 1 (a factor
    of exactly 1 otherwise). Returns the norm, an fp64 device scalar."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        if hasattr(torch, "_foreach_norm"):
            norms = torch._foreach_norm(grads)
        else:
            norms = [torch.linalg.vector_norm(g) for g in grads]
        sq = torch.stack([n.float() for n in norms]).double().pow(2).sum()
    else:
        sq = torch.zeros((), dtype=torch.float64, device=device)
    if all_reduce is not None:
        all_reduce(sq)
    norm = sq.sqrt()
    if max_norm > 0 and grads:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).float()
        if torch_models.TORCH2:
            torch._foreach_mul_(grads, coef)
        else:
            for g in grads:
                g.mul_(coef)
    return norm


# ----------------------------------------------------------------- main


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description="torch.distributed.pipelining peer of a viaduct pipeline run "
        "(see the file's top comment); launch with torchrun --nproc-per-node <pp>")
    ap.add_argument("--checkpoint", required=True,
                    help="a viaduct step folder, e.g. outputs/x/checkpoint/step-0")
    ap.add_argument("--split-json", required=True,
                    help="`viaduct split --config F [overrides] --json` of the run")
    ap.add_argument("--microbatches", type=int,
                    help="default: parallelism.pipeline_parallel_microbatches, "
                    "else pp x stages per rank (viaduct's default)")
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager",
                    help="compile: torch.compile per transformer block (not with "
                    "the zero-bubble schedules, which torch refuses compiled)")
    ap.add_argument("--compile-mode", default="default",
                    help="torch.compile mode: default | max-autotune-no-cudagraphs | ...")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: Gloo instead of NCCL (a smoke test), or with "
                    "--single-process the fp32 CPU check")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU intra-op threads (default: training.num_threads)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                    help="compute dtype (bf16: mixed precision with fp32 master weights)")
    ap.add_argument("--rope-dtype", choices=["float64", "float32"], default="float32",
                    help="dtype of the RoPE tables at use (as torch_llama.py)")
    ap.add_argument("--optimizer-impl", choices=["fused", "foreach", "exact"],
                    default="fused", help="AdamW: torch's fused (CUDA, torch 2.x) or "
                    "foreach, or viaduct's per-tensor loop; the clipping is the "
                    "global-norm one above in every case")
    ap.add_argument("--timing-warmup", type=int, default=3,
                    help="untimed steps first (NCCL set-up, compile)")
    ap.add_argument("--peak-flops", type=float, default=None,
                    help="one device's peak FLOP/s for MFU (default: by GPU name, "
                    f"H100/H200 {tl.PEAK_BF16_FLOPS:.4g})")
    ap.add_argument("--json-out", "--json", dest="json_out",
                    help="write the summary JSON here (rank 0)")
    ap.add_argument("--label", default="", help="free text carried into the JSON")
    ap.add_argument("--single-process", action="store_true",
                    help="run every stage in this process, chained in order, "
                    "without torch.distributed (the stage/loss check; torch 1.13 works)")
    tl.add_config_override_args(ap)
    ap.add_argument("--dry-run", action="store_true",
                    help="resolve checkpoint, config, split, schedule and data, print "
                    "them, and stop (needs no torch)")
    return ap.parse_args(argv)


def resolve(args):
    """Everything decided from files and flags, before any torch or NCCL call,
    so every rank fails the same way on bad input."""
    meta, entries, file_of, optim_files = open_checkpoint_parts(args.checkpoint)
    cfg = tl.parse_config_toml(meta["config_toml"])
    spec = spec_from_config(cfg)
    if spec.family != "llama":
        fail(f"model.family is '{spec.family}'; the pipelining peer implements llama only")
    if spec.tie_embeddings:
        fail("model.tie_embeddings = true: a tied head spans the first and last "
             "stages; the pipelining peer implements the untied llama only")
    tl.check_shape_flags(args, spec)
    sp, plans = read_split(args.split_json, spec)
    pp, S = int(sp["pp"]), int(sp["num_stages"])
    dp = cfg_get(cfg, "parallelism.data_parallel_degree", 1)
    if dp != 1:
        fail(f"the checkpoint's run has parallelism.data_parallel_degree = {dp}; the "
             "peer runs pipeline parallelism only (world = pp)")
    ck_pp = cfg_get(cfg, "parallelism.pipeline_parallel_degree", 1)
    ck_sched = cfg_get(cfg, "parallelism.pipeline_parallel_schedule", "1F1B")
    if (ck_pp != pp or (ck_pp > 1 and ck_sched != sp["schedule"])) \
            and os.environ.get("RANK", "0") == "0":
        print(f"note: the checkpoint's config says pp={ck_pp} {ck_sched}, the split "
              f"pp={pp} {sp['schedule']}; the split decides the layout (the weights "
              "are FQN-keyed)", file=sys.stderr)
    m = args.microbatches or cfg_get(cfg, "parallelism.pipeline_parallel_microbatches") or S
    check_microbatches(sp["schedule"], m, pp, S)
    ts, start_step, n_steps = tl.resolve_settings(args, cfg, spec, meta, microbatches=m,
                                                  single_process=False)
    if args.mode == "compile" and SCHEDULES[sp["schedule"]].splits_backward \
            and not args.single_process:
        fail(f"schedule {sp['schedule']} splits the backward into input and weight "
             "passes, which torch.distributed.pipelining refuses for compiled stages; "
             "use --mode eager")
    return dict(meta=meta, cfg=cfg, spec=spec, entries=entries, file_of=file_of,
                optim_files=optim_files, split=sp, plans=plans, pp=pp, S=S, ts=ts,
                start_step=start_step, n_steps=n_steps)


def dry_run(args, c):
    ts, spec = c["ts"], c["spec"]
    stream, sampler = tl.sampler_from_checkpoint(ts, c["meta"])
    print(json.dumps({
        "spec": asdict(spec), "settings": asdict(ts),
        "schedule": c["split"]["schedule"],
        "torch_class": SCHEDULES[c["split"]["schedule"]].torch_class,
        "pp": c["pp"], "num_stages": c["S"], "microbatches": ts.microbatches,
        "microbatch_rows": ts.batch_size // ts.microbatches,
        "stages": [asdict(p) for p in c["plans"]],
        "rank_stages": {r: [p.stage for p in c["plans"] if p.rank == r]
                        for r in range(c["pp"])},
        "start_step": c["start_step"], "steps": c["n_steps"],
        "params": tl.parameter_count(c["entries"]),
        "checkpoint_files": sorted(set(c["file_of"].values())),
        "flops_per_token": flops_per_token(spec, ts.seq_len),
        "lrs": [tl.lr_at(ts, c["start_step"] + i + 1) for i in range(c["n_steps"])],
        "data_tokens": stream.size, "num_windows": sampler.num_windows,
        "first_windows": sampler.next_windows()}))
    return 0


def train(args, c):
    plans, pp = c["plans"], c["pp"]
    name = c["split"]["schedule"]
    traits = SCHEDULES[name]
    distributed = not args.single_process
    if torch is None:
        fail("PyTorch is not installed")
    if distributed:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            if k not in os.environ:
                fail(f"${k} is not set: launch with `torchrun --nproc-per-node {pp} "
                     "bench/multi_gpu/torch_pipeline.py ...` (or pass --single-process)")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        fail("no CUDA device (--device cpu runs Gloo on the CPU)")

    dist = PipelineStage = schedule_cls = None
    if distributed:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        local_rank = int(os.environ["LOCAL_RANK"])
        if world != pp:
            fail(f"WORLD_SIZE is {world} but the split has pp = {pp}: launch "
                 f"--nproc-per-node {pp}")
        try:
            import torch.distributed as dist
            from torch.distributed.pipelining import PipelineStage
            from torch.distributed.pipelining import schedules as pipe_schedules
        except ImportError as e:
            fail(f"torch {torch.__version__} has no torch.distributed.pipelining "
                 f"({e}); it needs torch 2.4+ (or pass --single-process)")
        schedule_cls = getattr(pipe_schedules, traits.torch_class, None)
        if schedule_cls is None:
            fail(f"torch {torch.__version__} has no "
                 f"torch.distributed.pipelining.schedules.{traits.torch_class}")
        if cuda:
            if local_rank >= torch.cuda.device_count():
                fail(f"LOCAL_RANK {local_rank} but {torch.cuda.device_count()} CUDA devices")
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
        kw = {}
        if cuda and "device_id" in inspect.signature(dist.init_process_group).parameters:
            kw["device_id"] = device  # binds the communicator to this rank's GPU
        dist.init_process_group(backend="nccl" if cuda else "gloo", **kw)
        local = [p for p in plans if p.rank == rank]
    else:
        world, rank = 1, 0
        device = torch.device(args.device)
        local = list(plans)
    if device.type == "cpu":
        torch.set_num_threads(args.threads or cfg_get(c["cfg"], "training.num_threads", 2))
    try:
        return _train(args, c, dist, rank, world, device, local, schedule_cls, traits,
                      name, PipelineStage)
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


def _train(args, c, dist, rank, world, device, local, schedule_cls, traits, name,
           PipelineStage):
    spec, ts, S = c["spec"], c["ts"], c["S"]
    cuda = device.type == "cuda"
    has_first = any(p.stage == 0 for p in local)
    has_last = any(p.stage == S - 1 for p in local)
    B, T, m = ts.batch_size, ts.seq_len, ts.microbatches
    start_step, n_steps = c["start_step"], c["n_steps"]

    # Data: only the ranks of the first stage (inputs) and the last (targets).
    batches = None
    if has_first or has_last:
        _, sampler = tl.sampler_from_checkpoint(ts, c["meta"])
        batches = tl.read_batches(sampler, n_steps, ts.grad_accum, B, T, spec.vocab_size,
                                  cuda)

    compute_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rope_dtype = torch.float64 if args.rope_dtype == "float64" else torch.float32
    t0 = time.perf_counter()
    mods = [build_stage_module(spec, p, c["entries"], c["file_of"], device, compute_dtype,
                               rope_dtype) for p in local]
    for mod in mods:
        mod.train()
    named = [x for mod in mods for x in tl.named_params_for_training(mod)]
    optim_state = None
    if start_step > 0:
        optim_state = load_optimizer_state(c["optim_files"], named, device)
    steps_taken = int((c["meta"].get("extra") or {}).get("optimizer_steps", start_step))
    opt_impl = args.optimizer_impl
    if opt_impl == "fused" and not (torch_models.TORCH2 and cuda):
        opt_impl = "foreach"  # fused AdamW: torch 2.x on CUDA
    if opt_impl == "exact":
        opt = tl.ExactAdamW(named, ts, steps_taken, optim_state)
    else:
        opt = tl.TorchAdamW(named, ts, opt_impl, steps_taken, optim_state)
    del optim_state
    params = [p for _, p, _ in named]

    if args.mode == "compile":
        if not hasattr(torch, "compile"):
            fail(f"torch {torch.__version__} has no torch.compile (2.x needed)")
        ckw = {} if args.compile_mode == "default" else {"mode": args.compile_mode}
        for mod in mods:  # per block, in place: FQNs unchanged
            for layer in mod.layers.values():
                layer.compile(dynamic=False, **ckw)

    # Note [Loss scaling] of viaduct: each micro-batch's summed CE over the
    # tokens of the whole step; torch sums the micro-batches' gradients.
    tokens = B * T * ts.grad_accum  # no target is -100 in a token stream
    scale = 1.0 / tokens
    ce_log = []  # the unscaled sums of this step, for the reported loss

    def loss_fn(logits, targets):
        ce = torch_models.summed_cross_entropy(logits, targets)
        ce_log.append(ce.detach())
        return ce * scale

    if PipelineStage is not None:
        mb = B // m
        D, V = spec.dim, spec.vocab_size
        stages = []
        for p, mod in zip(local, mods):
            # Shapes given: no shape-inference forward or object send at step 1.
            inp = torch.empty(mb, T, dtype=torch.int64, device="meta") if p.stage == 0 \
                else torch.empty(mb, T, D, dtype=compute_dtype, device="meta")
            out = torch.empty(mb, T, V if mod.is_last else D, dtype=compute_dtype,
                              device="meta")
            stages.append(PipelineStage(mod, p.stage, S, device, input_args=inp,
                                        output_args=out))
        skw = {"loss_fn": loss_fn}
        if "scale_grads" in inspect.signature(schedule_cls.__init__).parameters:
            skw["scale_grads"] = False  # the loss is scaled already
        schedule = schedule_cls(stages[0] if traits.single_stage else stages, m, **skw)
        step_kw = {}
        if "return_outputs" in inspect.signature(schedule.step).parameters:
            step_kw["return_outputs"] = False  # keeps no logits past their backward

        def run_batch(inp, tgt):
            args_ = (inp.to(device, non_blocking=True),) if has_first else ()
            kw = dict(step_kw)
            if has_last:
                kw["target"] = tgt.to(device, non_blocking=True)
            schedule.step(*args_, **kw)
            for st in stages:  # a torch without return_outputs kept the logits
                if getattr(st, "output_chunks", None):
                    st.output_chunks.clear()

        all_reduce = dist.all_reduce
        logits_kept = "return_outputs" not in step_kw
    else:
        logits_kept = False

        def run_batch(inp, tgt):  # the stages chained by hand, micro-batch by micro-batch
            for x, y in zip(inp.chunk(m), tgt.chunk(m)):
                h = x.to(device, non_blocking=True)
                for mod in mods:
                    h = mod(h)
                loss_fn(h, y.to(device, non_blocking=True)).backward()

        all_reduce = None
    if cuda:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0

    clock = tl.StepClock(device, n_steps)
    step_ce, norms, lrs, wall = [], [], [], []
    tl.reset_peak_memory(device)
    peak_warmup = 0
    for i in range(n_steps):
        if i == args.timing_warmup:
            tl.synchronize(device)
            peak_warmup = tl.peak_memory(device)
            tl.reset_peak_memory(device)
        w0 = time.perf_counter()
        clock.start(i)
        for a in range(ts.grad_accum):
            inp, tgt = batches[i][a] if batches is not None else (None, None)
            run_batch(inp, tgt)
        norm = global_clip_(params, ts.max_norm, device, all_reduce)
        lr = tl.lr_at(ts, start_step + i + 1)
        opt.step(lr)
        opt.zero_grad()
        clock.end(i)
        step_ce.append(list(ce_log))
        ce_log.clear()
        norms.append(norm.detach())
        lrs.append(lr)
        if i < args.timing_warmup:  # wall time of the warm-up steps (set-up, compile)
            tl.synchronize(device)
            wall.append(time.perf_counter() - w0)
    tl.synchronize(device)
    peak_timed = tl.peak_memory(device)

    # Gather to every rank: losses from the last stage's rank (zeros elsewhere,
    # so a sum is exact), step times as the slowest rank's, peaks per rank.
    step_s = clock.seconds()
    losses = [sum(float(x.item()) for x in ls) / tokens for ls in step_ce] if has_last \
        else [0.0] * n_steps
    grad_norms = [float(n.item()) for n in norms]
    per_rank = [0.0] * (2 * world)
    per_rank[rank], per_rank[world + rank] = float(peak_timed), float(peak_warmup)
    if dist is not None:
        def reduce(values, op):
            t = torch.tensor(values, dtype=torch.float64, device=device)
            dist.all_reduce(t, op=op)
            return t.tolist()
        losses = reduce(losses, dist.ReduceOp.SUM)
        step_s = reduce(step_s, dist.ReduceOp.MAX)
        wall = reduce(wall, dist.ReduceOp.MAX) if wall else wall
        per_rank = reduce(per_rank, dist.ReduceOp.SUM)
    peaks = [int(x) for x in per_rank[:world]]
    peaks_warmup = [int(x) for x in per_rank[world:]]
    if rank != 0:
        return 0

    timed = step_s[args.timing_warmup:]
    median = statistics.median(timed)
    fpt = flops_per_token(spec, T)
    dev_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = args.peak_flops or (tl.device_peak_flops(dev_name, compute_dtype) if cuda else None)
    tok_s = tokens / median
    mode = args.mode + ("" if args.mode == "eager" or args.compile_mode == "default"
                        else f"[{args.compile_mode}]")
    impl = ("torch-stages-single-process" if dist is None else "torch-pipelining") + \
        f"-{mode} {name}"
    summary = {
        "impl": impl,
        "label": args.label,
        "checkpoint": args.checkpoint,
        "split_json": args.split_json,
        "data": ts.data_path,
        "device": dev_name,
        "torch": torch.__version__,
        "family": spec.family,
        "spec": asdict(spec),
        "params": tl.parameter_count(c["entries"]),
        "schedule": name,
        "torch_schedule": traits.torch_class if dist is not None else None,
        "placement": c["split"]["placement"],
        "pp": c["pp"], "num_stages": S, "world_size": world,
        "microbatches": m,
        # True: this torch's step() had no return_outputs, so the last stage
        # held every micro-batch's logits until the step's end (peak memory)
        "logits_kept_per_step": logits_kept,
        "stages": [asdict(p) for p in c["plans"]],
        "batch": B, "seq_len": T, "grad_accum": ts.grad_accum,
        "tokens_per_step": tokens,
        "start_step": start_step, "steps": n_steps, "timing_warmup": args.timing_warmup,
        "optimizer_impl": opt_impl, "rope_dtype": args.rope_dtype,
        "compute_dtype": args.dtype,
        "median_step_s": median,
        "step_s": step_s,
        "tokens_per_s": tok_s,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "mfu": fpt * tok_s / (peak * world) if peak else None,
        # rank 0's, as viaduct's metrics.jsonl (its logging rank) reports
        "peak_memory_bytes": peaks[0],
        "peak_memory_bytes_per_rank": peaks,
        "peak_memory_bytes_max": max(peaks),
        "peak_memory_warmup_bytes": max(peaks_warmup),
        "peak_memory_warmup_bytes_per_rank": peaks_warmup,
        "first_step_wall_s": wall[0] if wall else None,
        "compile_s": (wall[0] - median) if (wall and args.mode == "compile") else None,
        "load_s": load_s,
        "losses": losses,
        "grad_norms": grad_norms,
        "lrs": lrs,
    }
    tl.print_steps(start_step, losses, grad_norms, lrs, step_s)
    mfu = f"{100 * summary['mfu']:.1f}%" if summary["mfu"] is not None else "n/a"
    print(f"summary: {impl}, pp={c['pp']} x {S // c['pp']} stages/rank, m={m}: "
          f"{tok_s:.0f} tok/s, MFU {mfu}, median step {1e3 * median:.1f} ms, peak GiB "
          f"per rank {' / '.join(f'{b / 2**30:.1f}' for b in peaks)}, loss "
          f"{' '.join(f'{l:.4f}' for l in losses[:5])}")
    line = json.dumps(summary)
    print(line)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    return 0


def main(argv):
    args = parse_args(argv)
    c = resolve(args)
    if args.dry_run:
        return dry_run(args, c)
    return train(args, c)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
