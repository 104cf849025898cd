#!/usr/bin/env bash
# GPU-machine check of the Hugging Face paths against transformers and HF
# tokenizers (its python has torch, transformers, tokenizers, safetensors):
#
#  1. viaduct -> transformers: for the llama and gpt2 debug models in fp32,
#     viaduct trains one step from its saved initial weights (metrics.jsonl's
#     step-1 loss is the loss of the first batch under step-0's weights),
#     `viaduct convert --to hf` exports step-0, and AutoModelForCausalLM
#     loads it and computes the loss of the same batch (read by
#     reference/torch_llama.py's sampler). Passes at <= 1e-5 relative.
#  2. transformers -> viaduct: a random LlamaForCausalLM / GPT2LMHeadModel
#     of the same shape, saved with save_pretrained, goes through
#     `viaduct convert --to viaduct` and back `--to hf`; every tensor must
#     come back bitwise, and reference/torch_llama.py's reference of viaduct's
#     model on the converted checkpoint must give transformers' loss.
#  3. tokenizers: HF tokenizers encodes the fortunes documents with GPT-2's
#     and llama-3's tokenizer.json to the ids `viaduct prepare-data
#     --tokenizer` writes for them, and both throughputs are printed.
#
#   bash bench/gpu_checks/hf_transformers_check.sh     # after building build/viaduct
#
# Environment: VIADUCT (build/viaduct), PYTHON (python3), OUT
# (outputs/hf_transformers_check), TOKENIZERS (.cache/tokenizers, from
# scripts/fetch_tokenizers.sh), FORTUNES (/usr/share/games/fortunes).
set -euo pipefail
cd "$(dirname "$0")/../.."
VIADUCT=${VIADUCT:-build/viaduct}
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$PWD/outputs/hf_transformers_check}
TOKENIZERS=${TOKENIZERS:-.cache/tokenizers}
FORTUNES=${FORTUNES:-/usr/share/games/fortunes}
rm -rf "$OUT"
mkdir -p "$OUT"

DATA=$OUT/fortunes.tok
"$VIADUCT" prepare-data --input "$FORTUNES" --output "$DATA" >"$OUT/prepare.log" 2>&1

status=0
for family in llama gpt2; do
  dir=$OUT/$family
  "$VIADUCT" train --config "configs/${family}_debug.toml" --training.dtype=float32 \
    --training.steps=1 --training.eval_interval=0 --data.path="$DATA" \
    --job.dump_folder="$dir/viaduct" --checkpoint.enable=true \
    --checkpoint.save_initial=true --checkpoint.interval=1000000 \
    --metrics.log_freq=1 --metrics.progress_bar=false >"$dir.train.log" 2>&1
  "$VIADUCT" convert --to hf --input "$dir/viaduct/checkpoint/step-0" --output "$dir/hf"
  "$PYTHON" - "$family" "$dir" "$VIADUCT" <<'PY' || status=1
import json, os, subprocess, sys
import torch
sys.path.insert(0, "reference")
import torch_llama, torch_models
from transformers import AutoModelForCausalLM, AutoConfig
from safetensors.torch import load_file

family, d, viaduct = sys.argv[1:4]
step0 = f"{d}/viaduct/checkpoint/step-0"
meta = json.load(open(f"{step0}/metadata.json"))
cfg = torch_llama.parse_config_toml(meta["config_toml"])
ts = torch_llama.train_settings_from_config(cfg)
_, sampler = torch_llama.sampler_from_checkpoint(ts, meta)
spec = torch_models.spec_from_config(cfg)
(inp, tgt), = torch_llama.read_batches(sampler, 1, 1, ts.batch_size, ts.seq_len,
                                        spec.vocab_size, False)[0]
rel = lambda a, b: abs(a - b) / max(abs(b), 1e-30)
ok = True

# 1. viaduct's export in transformers.
vd = [json.loads(l) for l in open(f"{d}/viaduct/metrics.jsonl") if l.strip()]
viaduct_loss = next(j["loss"] for j in vd if j.get("step") == 1 and "loss" in j)
hf = AutoModelForCausalLM.from_pretrained(f"{d}/hf", torch_dtype=torch.float32).eval()
with torch.no_grad():
    logits = hf(inp).logits.float()
hf_loss = torch.nn.functional.cross_entropy(
    logits.reshape(-1, logits.size(-1)), tgt.reshape(-1)).item()
r = rel(hf_loss, viaduct_loss)
ok &= r <= 1e-5
print(f"{family}: viaduct step-1 loss {viaduct_loss:.9f}, transformers on the "
      f"export {hf_loss:.9f}, rel {r:.2e}")

# 2. transformers' own random model into viaduct and back.
config = AutoConfig.from_pretrained(f"{d}/hf")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config).float().eval()
model.save_pretrained(f"{d}/hf_random", safe_serialization=True)
subprocess.run([viaduct, "convert", "--to", "viaduct", "--input", f"{d}/hf_random",
                "--output", f"{d}/from_hf", "--config", f"configs/{family}_debug.toml",
                "--training.dtype=float32", f"--data.path={ts.data_path}"], check=True)
subprocess.run([viaduct, "convert", "--to", "hf", "--input", f"{d}/from_hf",
                "--output", f"{d}/hf_again"], check=True)
saved, again = load_file(f"{d}/hf_random/model.safetensors"), load_file(f"{d}/hf_again/model.safetensors")
drop = lambda n: n.endswith(".attn.bias") or n.endswith("masked_bias") or n == "lm_head.weight"
names = sorted(n for n in saved if not drop(n))
same = all(n in again and torch.equal(saved[n], again[n]) for n in names)
ok &= same
print(f"{family}: {len(names)} tensors transformers -> viaduct -> HF: "
      f"{'bitwise equal' if same else 'DIFFER'}")
with torch.no_grad():
    logits = model(inp).logits.float()
t_loss = torch.nn.functional.cross_entropy(
    logits.reshape(-1, logits.size(-1)), tgt.reshape(-1)).item()
meta2, ckpt = torch_llama.open_checkpoint(f"{d}/from_hf/step-0")
entries, _, _ = torch_llama.read_safetensors_header(ckpt)
ref = torch_llama.build_model(spec, ckpt, entries, "cpu", torch.float32, torch.float64)
with torch.no_grad():
    r_loss = float(ref(inp, tgt)) / tgt.numel()  # the reference sums token CE
r = rel(r_loss, t_loss)
ok &= r <= 1e-5
print(f"{family}: transformers' random model loss {t_loss:.9f}, viaduct's "
      f"reference on the converted checkpoint {r_loss:.9f}, rel {r:.2e}")
sys.exit(0 if ok else 1)
PY
done

# 3. tokenizers.
"$PYTHON" - "$VIADUCT" "$OUT" "$TOKENIZERS" "$FORTUNES" <<'PY' || status=1
import glob, json, os, subprocess, sys, time
import numpy as np
from tokenizers import Tokenizer
viaduct, out, cache, fortunes = sys.argv[1:5]
docs = []
for p in sorted(glob.glob(f"{fortunes}/*")):
    if p.endswith(".dat") or os.path.islink(p) or not os.path.isfile(p):
        continue
    text = open(p, "rb").read().decode("utf-8", errors="replace")
    docs += [d for d in text.split("\n%\n") if d.strip()]
with open(f"{out}/docs.jsonl", "w") as f:
    for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
mb = sum(len(d.encode()) for d in docs) / 1e6
ok = True
for name, sep in (("gpt2", 50256), ("llama3", 128001)):
    path = f"{cache}/node_modules/@lenml/tokenizer-{name}/models/tokenizer.json"
    tok = Tokenizer.from_file(path)
    t0 = time.perf_counter()
    ids = [tok.encode(d, add_special_tokens=False).ids for d in docs]
    hf_s = time.perf_counter() - t0
    want = [i for d in ids for i in [sep] + d]
    t0 = time.perf_counter()
    subprocess.run([viaduct, "prepare-data", "--input", f"{out}/docs.jsonl", "--output",
                    f"{out}/{name}.tok", "--tokenizer", path], check=True,
                   capture_output=True)
    vd_s = time.perf_counter() - t0
    raw = open(f"{out}/{name}.tok", "rb").read()
    bpt = int.from_bytes(raw[12:16], "little")
    got = np.frombuffer(raw[128:], dtype=np.uint16 if bpt == 2 else np.uint32).tolist()
    same = got == want
    ok &= same
    print(f"{name}: {len(docs)} documents, {len(want)} tokens: "
          f"{'same ids' if same else 'IDS DIFFER'}; HF tokenizers one thread "
          f"{mb / hf_s:.1f} MB/s, viaduct prepare-data (all cores, with load) "
          f"{mb / vd_s:.1f} MB/s")
sys.exit(0 if ok else 1)
PY
exit $status
