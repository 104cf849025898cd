#!/usr/bin/env bash
# CPU check that the PyTorch references (reference/torch_llama.py, models in
# reference/torch_models.py) compute viaduct's models: for each family at its
# debug shape in fp32, viaduct trains a few steps from its initial weights
# (saved as step-0 by checkpoint.save_initial), the reference trains from that
# step-0 on the same data with viaduct's exact optimizer loop, and the per-step
# losses and gradient norms are compared. Also checks that the reference's
# FLOPs per token equal `viaduct describe`'s. ctest runs a few cases (the
# test Reference.TorchCrossCheck, label reference, tests/reference/CMakeLists.txt);
# run every case after changing a model or its reference.
#
#   bash reference/check_references.sh                  # every case
#   CASES="gpt2 k3plain" bash reference/check_references.sh
#
# Exit status: 0 when every case agrees, 1 when one disagrees or fails, 77
# when no python imports torch (ctest reports the test as skipped).
#
# Environment (defaults): VIADUCT (build/viaduct), PYTHON (the first of
# python3, /usr/bin/python3 that imports torch; Debian's python3-torch is
# enough), OUT (outputs/check_references), STEPS (5), RTOL (1e-5: the largest
# relative loss difference still called agreement), DATA (data/fortunes.tok,
# else random tokens written to $OUT), OVERRIDES (none: config keys added to
# every case, e.g. "--training.seq_len=32"; the reference reads them from the
# checkpoint).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

VIADUCT=${VIADUCT:-build/viaduct}
OUT=${OUT:-$PWD/outputs/check_references}
STEPS=${STEPS:-5}
read -r -a OVERRIDES_ARR <<<"${OVERRIDES:-}"
RTOL=${RTOL:-1e-5}
CASES=${CASES:-llama gpt2 k3 k3deep k3plain k3deepplain k3gemm k3mla3}
if [ -z "${PYTHON:-}" ]; then
  for p in python3 /usr/bin/python3; do
    if "$p" -c 'import torch' 2>/dev/null; then PYTHON=$p; break; fi
  done
fi
[ -n "${PYTHON:-}" ] || { echo "no python with torch (apt-get install python3-torch)"; exit 77; }
[ -x "$VIADUCT" ] || { echo "no $VIADUCT (build it, or set VIADUCT)"; exit 1; }
mkdir -p "$OUT"

DATA=${DATA:-data/fortunes.tok}
if [ ! -f "$DATA" ]; then
  DATA=$OUT/random_v257.u16
  "$PYTHON" - "$DATA" <<'EOF'
import array, random, sys
r = random.Random(1234)
a = array.array("H", (r.randrange(257) for _ in range(1 << 20)))
open(sys.argv[1], "wb").write(a.tobytes())
EOF
fi

# One case: viaduct (writes step-0 and metrics.jsonl), then the reference.
run_case() {  # name config overrides...
  local name=$1 config=$2
  shift 2
  local dir=$OUT/$name
  rm -rf "$dir"
  mkdir -p "$dir"
  local common=(--config "$config" "$@" "${OVERRIDES_ARR[@]}" --training.dtype=float32 --training.device=cpu
    --training.steps="$STEPS" --training.eval_interval=0 --data.path="$DATA")
  "$VIADUCT" describe "${common[@]}" --json >"$dir/describe.json" 2>"$dir/describe.log"
  local train=("$VIADUCT" train "${common[@]}" --job.dump_folder="$dir/viaduct"
    --checkpoint.enable=true --checkpoint.save_initial=true
    --checkpoint.interval=1000000 --checkpoint.keep_latest_k=0
    --metrics.log_freq=1 --metrics.progress_bar=false)
  echo "${train[*]}" >"$dir/viaduct.cmd"
  "${train[@]}" >"$dir/viaduct.log" 2>&1 ||
    { echo "$name: viaduct failed:"; tail -5 "$dir/viaduct.log"; return 1; }
  "$PYTHON" reference/torch_llama.py --checkpoint "$dir/viaduct/checkpoint/step-0" \
    --device cpu --dtype fp32 --optimizer-impl exact --timing-warmup 1 \
    --json "$dir/torch.json" >"$dir/torch.log" 2>&1 ||
    { echo "$name: reference failed:"; tail -5 "$dir/torch.log"; return 1; }
}

compare() {  # name label
  "$PYTHON" - "$OUT/$1" "$2" "$RTOL" <<'EOF'
import json, sys
d, label, rtol = sys.argv[1], sys.argv[2], float(sys.argv[3])
vd = [json.loads(l) for l in open(f"{d}/viaduct/metrics.jsonl") if l.strip()]
vd = sorted((j for j in vd if "loss" in j and "step_seconds" in j), key=lambda j: j["step"])
ref = json.load(open(f"{d}/torch.json"))
desc = json.load(open(f"{d}/describe.json"))
rel = lambda a, b: abs(a - b) / max(abs(a), 1e-30)
print(f"{label}: {ref['params']:,} parameters")
print(f"  step   viaduct loss     torch loss       rel diff    "
      f"viaduct |g|      torch |g|        rel diff")
worst = 0.0
for j, l, g in zip(vd, ref["losses"], ref["grad_norms"]):
    rl, rg = rel(j["loss"], l), rel(j["grad_norm"], g)
    worst = max(worst, rl)
    print(f"  {j['step']:4d}   {j['loss']:.9f}  {l:.9f}  {rl:9.2e}   "
          f"{j['grad_norm']:.9f}  {g:.9f}  {rg:9.2e}")
n = min(len(vd), len(ref["losses"]))
fr = rel(desc["flops_per_token"], ref["flops_per_token"])
ok = n > 0 and worst <= rtol and fr <= 1e-12
print(f"  max rel loss diff over {n} steps: {worst:.2e} (rtol {rtol:g}); "
      f"FLOPs/token viaduct {desc['flops_per_token']:.6g}, reference "
      f"{ref['flops_per_token']:.6g}: {'ok' if ok else 'DIFFERS'}")
sys.exit(0 if ok else 1)
EOF
}

status=0
for c in $CASES; do
  case $c in
    llama) args=(llama configs/llama_debug.toml); label="llama debugmodel" ;;
    gpt2) args=(gpt2 configs/gpt2_debug.toml); label="gpt2 debugmodel" ;;
    k3) args=(k3 configs/kimi_k3_debug.toml); label="kimi_k3 debugmodel" ;;
    k3deep) args=(k3deep configs/kimi_k3_debug.toml --model.flavor=debugmodel_deep)
      label="kimi_k3 debugmodel_deep" ;;
    k3plain) args=(k3plain configs/kimi_k3_debug.toml --model.attn_res=false)
      label="kimi_k3 debugmodel, model.attn_res=false" ;;
    k3deepplain) args=(k3deepplain configs/kimi_k3_debug.toml
      --model.flavor=debugmodel_deep --model.attn_res=false)
      label="kimi_k3 debugmodel_deep, model.attn_res=false" ;;
    k3gemm) args=(k3gemm configs/kimi_k3_debug.toml --model.flavor=debugmodel_deep
      --model.mla_interval=1 --model.moe_ffn=false)
      label="kimi_k3 debugmodel_deep, MLA everywhere, dense FFNs" ;;
    k3mla3) args=(k3mla3 configs/kimi_k3_debug.toml --model.mla_interval=3)
      label="kimi_k3 debugmodel, MLA every third layer" ;;
    *) echo "unknown case '$c' (llama gpt2 k3 k3deep k3plain k3deepplain k3gemm k3mla3)"
      status=1; continue ;;
  esac
  if run_case "${args[@]}"; then
    compare "$c" "$label" || status=1
  else
    status=1
  fi
done
echo "logs and JSON in $OUT"
exit $status
