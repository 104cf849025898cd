#!/usr/bin/env bash
# Activation checkpointing on one GPU: step time and peak memory of the
# llama-3.1-8B layer shape (dim 4096, 14336 FFN, 32 heads / 8 KV heads, 128k
# vocabulary) cut to a few layers, with activation_checkpoint none and each
# checkpointing mode, beside the plan's estimate of the same run; then, per
# mode, the largest local batch the estimate lets start on this device and
# the largest batch at or below it that runs.
#
#   VIADUCT=build-gpu/viaduct bash bench/memory/ac_memory.sh
#
# Environment (defaults): VIADUCT (build-gpu/viaduct), LAYERS (4), SEQ
# (8192), BATCH (1), STEPS (6: the median of steps 2.. is reported), MODES
# ("none selective:op selective:2 full"), MAXBATCH (1: also search the
# largest batch per mode), DATA (data/fortunes.tok), OUT (outputs/ac_memory),
# EXTRA (more overrides), RUN_TIMEOUT (150 s per run), MODEL (the model's
# overrides; default the llama-8B layer shape above), TRIES (3: runs below
# the admitted batch, each 7/8 of the last, when the admitted one fails),
# TABLE (1: the step-time table at BATCH; 0 skips it, for a search alone).
# The allocator's settings come from the environment
# (PYTORCH_CUDA_ALLOC_CONF; viaduct sets expandable_segments:True when it
# is unset).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
V=${VIADUCT:-build-gpu/viaduct}
OUT=${OUT:-$PWD/outputs/ac_memory}
mkdir -p "$OUT"
LAYERS=${LAYERS:-4}; SEQ=${SEQ:-8192}; BATCH=${BATCH:-1}; STEPS=${STEPS:-6}
MODES=${MODES:-none selective:op selective:2 full}
DATA=${DATA:-data/fortunes.tok}
read -r -a model <<<"${MODEL:---model.family=llama --model.flavor=8B --model.n_layers=$LAYERS}"
common=(--config configs/llama_debug.toml "${model[@]}"
  --training.seq_len="$SEQ" --training.steps="$STEPS" --training.eval_interval=0
  --checkpoint.enable=false --metrics.progress_bar=false --data.path="$DATA" ${EXTRA:-})
ac_args() {  # none | full | selective:<option>
  case $1 in
    selective:*) echo "--activation_checkpoint.mode=selective --activation_checkpoint.selective_ac_option=${1#selective:}" ;;
    *) echo "--activation_checkpoint.mode=$1" ;;
  esac
}
# The median step seconds (steps 2..), the last peak and the plan's bytes.
summarise() {
  python3 - "$1" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if l.strip()]
rows = [r for r in rows if "step_seconds" in r]
t = statistics.median([r["step_seconds"] for r in rows[1:]] or [rows[0]["step_seconds"]])
print(f'{t:.4f} {rows[-1]["peak_memory_bytes"]/2**30:.2f} {rows[-1].get("plan_memory_bytes", 0)/2**30:.2f} {rows[-1]["loss"]}')
PY
}
if [ "${TABLE:-1}" = 1 ]; then
  echo "| activation_checkpoint | batch x seq | step s | x none | peak GiB | plan GiB | peak / plan | step-$STEPS loss |"
  echo "|---|---|---|---|---|---|---|---|"
  base=""
  for m in $MODES; do
    d="$OUT/${m/:/_}_b$BATCH"
    rm -rf "$d"
    if ! timeout "${RUN_TIMEOUT:-150}" "$V" train "${common[@]}" --training.local_batch_size="$BATCH" $(ac_args "$m") \
        --job.dump_folder="$d" >"$d.log" 2>&1; then
      echo "| $m | $BATCH x $SEQ | failed: $(grep -m1 -iE "error|memory" "$d.log" | cut -c1-120) |"
      continue
    fi
    read -r t peak plan loss < <(summarise "$d")
    [ -z "$base" ] && base=$t
    ratio=$(python3 -c "print(f'{$t/$base:.3f}')")
    pr=$(python3 -c "print(f'{$peak/$plan:.3f}' if $plan > 0 else 'n/a')")
    echo "| $m | $BATCH x $SEQ | $t | $ratio | $peak | $plan | $pr | $loss |"
  done
fi
[ "${MAXBATCH:-1}" = 1 ] || exit 0
FREE=$(python3 -c 'import torch; print(torch.cuda.mem_get_info()[0])')
echo
echo "free device memory: $(python3 -c "print(f'{$FREE/2**30:.1f}')") GiB"
echo "| activation_checkpoint | largest batch the estimate admits | its failure, if it failed | largest batch that ran |"
echo "|---|---|---|---|"
for m in $MODES; do
  # The plan's rank-0 total (the figure the trainer refuses a run by)
  # against the device's free memory; double, then bisect.
  admits() {
    local total
    total=$("$V" plan "${common[@]}" --training.local_batch_size="$1" $(ac_args "$m") --json |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["ranks"][0]["memory"]["total"])') || return 1
    python3 -c "import sys; sys.exit(0 if $total <= $FREE else 1)"
  }
  lo=0; hi=1
  while admits $hi && [ $hi -le 256 ]; do lo=$hi; hi=$((hi * 2)); done
  while [ $((hi - lo)) -gt 1 ]; do mid=$(((lo + hi) / 2)); if admits $mid; then lo=$mid; else hi=$mid; fi; done
  if [ $lo -eq 0 ]; then echo "| $m | none |  |  |"; continue; fi
  # Run the admitted batch; when it fails, up to TRIES smaller ones (7/8
  # of the last each) until one runs: the largest batch that ran.
  b=$lo; ran=""; first=""
  for _ in $(seq 0 "${TRIES:-3}"); do
    d="$OUT/${m/:/_}_max_b$b"
    rm -rf "$d"
    if timeout "${RUN_TIMEOUT:-150}" "$V" train "${common[@]}" --training.local_batch_size=$b --training.steps=2 $(ac_args "$m") \
        --job.dump_folder="$d" >"$d.log" 2>&1; then
      read -r t peak plan loss < <(summarise "$d")
      ran="$b ($peak GiB peak, plan $plan GiB)"
      break
    fi
    [ -n "$first" ] || first="$(grep -m1 -iE "out of memory|error" "$d.log" | cut -c1-100)"
    b=$((b * 7 / 8)); [ $b -ge 1 ] || break
  done
  echo "| $m | $lo | ${first:-yes} | ${ran:-none of the tries} |"
done
