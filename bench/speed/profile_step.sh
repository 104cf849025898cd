#!/usr/bin/env bash
# Profiles one training step (default: the llama-1B shape, 4 x 4096 tokens,
# bf16) on the GPU machine with metrics.profile_step and prints the per-op
# breakdown (reference/profile_summary.py). Each extra argument is one variant: a
# quoted list of viaduct overrides ("" is the plain config).
#
#   bash bench/speed/profile_step.sh BUILD_DIR "" "--model.loss_chunk_tokens=4096"
#   MODEL=k3 bash bench/speed/profile_step.sh BUILD_DIR ""   # run_single_gpu.sh's k3 cell
#   MODEL=gpt2 bash bench/speed/profile_step.sh BUILD_DIR ""   # and its gpt2 cell
#   MODEL=k3 bash bench/speed/profile_step.sh BUILD_DIR "" "--metrics.profile_host_ops=false"
#     # the second variant: device kernels only, the step near its unprofiled
#     # speed, so its idle gaps are the unprofiled step's (named by the
#     # kernels around them)
#
# Writes $OUT/<i>.log, <i>.summary.md and <i>.summary.json per variant.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
B=${1:?usage: profile_step.sh BUILD_DIR [variant ...]}
shift
OUT=${OUT:-outputs/bench/profile}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
MODEL=${MODEL:-1B}
case "$MODEL" in
  1B) model_args=(--model.flavor=1B --training.seq_len=4096 --training.local_batch_size=4)
      VOCAB=${VOCAB:-128256} ;;
  # kimi_k3 deep at d2048 with KDA at chunk 64, 4 x 2048 tokens
  k3) model_args=(--model.family=kimi_k3 --model.flavor=debugmodel_deep --model.dim=2048
        --model.n_heads=16 --model.kda_head_dim=64 --model.mla_kv_lora_rank=512
        --model.mla_qk_nope_head_dim=128 --model.mla_qk_rope_head_dim=64
        --model.mla_v_head_dim=128 --model.ffn_hidden_dim=5632 --model.moe_hidden_dim=512
        --model.kda_chunk_size=64 --training.seq_len=2048 --training.local_batch_size=4)
      VOCAB=${VOCAB:-320} ;;
  # gpt2 124M, 8 x 1024 tokens (run_single_gpu.sh's gpt2 cell)
  gpt2) model_args=(--model.family=gpt2 --model.flavor=124M --training.seq_len=1024
          --training.local_batch_size=8)
        VOCAB=${VOCAB:-50257} ;;
  *) echo "profile_step.sh: MODEL must be 1B, k3 or gpt2, not '$MODEL'" >&2; exit 2 ;;
esac  # the random data's vocabulary (a variant may change the model)
DATA=${DATA:-outputs/bench/random_v$VOCAB.u32}
STEPS=${STEPS:-4}
if [ ! -f "$DATA" ]; then
  mkdir -p "$(dirname "$DATA")"
  "$PY" - "$DATA" "$VOCAB" $(((STEPS + 4) * 4 * 4096 + 1)) <<'PYEOF'
import array, os, random, sys
path, vocab, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
r = random.Random(1234)
a = array.array("I", (r.randrange(vocab) for _ in range(n)))
with open(path + ".tmp", "wb") as f:
    f.write(a.tobytes())
os.replace(path + ".tmp", path)
PYEOF
fi
[ $# -gt 0 ] || set -- ""
i=0
for variant in "$@"; do
  i=$((i + 1))
  dir=outputs/bench/profile_run$i
  rm -rf "$dir"
  read -r -a extra <<<"$variant"
  echo "== variant $i: ${variant:-(plain)}"
  timeout 300 "$B/viaduct" train --config configs/llama_debug.toml "${model_args[@]}" --optimizer.lr=3e-4 \
    --training.dtype=bfloat16 --training.device=cuda --training.steps="$STEPS" \
    --training.eval_interval=0 --training.deterministic=false --checkpoint.enable=false \
    --metrics.progress_bar=false --metrics.profile_step="$STEPS" --data.path="$DATA" \
    --job.dump_folder="$dir" "${extra[@]}" >"$OUT/$i.log" 2>&1 ||
    { echo "variant $i failed:"; tail -5 "$OUT/$i.log"; continue; }
  grep -E "^step" "$OUT/$i.log" | tail -2
  "$PY" reference/profile_summary.py "$dir"/profile/step-"$STEPS"-rank-0.trace.json --top "${TOP:-25}" \
    --json "$OUT/$i.summary.json" >"$OUT/$i.summary.md" 2>&1
  cat "$OUT/$i.summary.md"
done
