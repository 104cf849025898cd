#!/usr/bin/env bash
# viaduct's llama-1B step with its attention core on flash's ATen ops (what
# src/ops/rope.cpp's CausalFlashFn calls) against the same step with the
# core through at::scaled_dot_product_attention (compat::causal_sdpa: the
# backend PyTorch picks itself, cuDNN's on an H200 with LibTorch 2.11), in
# one GPU-machine call. First the attention ops alone at the 1B shape
# (bench/speed/attention_backends.py); then the build, viaduct trained
# WARMUP_STEPS + TIMED_STEPS + 1 steps with the last profiled (device kernels
# only), the one line of rope.cpp that picks CausalFlashFn replaced by
# causal_sdpa, an incremental build, the same run; ROUNDS pairs, the two
# binaries alternating. The kernel-class table of the two profiled steps
# side by side (bench/speed/kernel_classes.py) and each run's median step.
# The patch is an A/B only, undone on exit (the source file is restored;
# the build folder then holds the patched objects until the next build):
# the product keeps one path per op.
#
#   bash bench/speed/attention_ab.sh
#
# Environment (defaults): OUT (outputs/bench/attention_ab), ROUNDS (2),
# ROUND_BUDGET_S (unset: a round after the first starts only this many
# seconds after the script did), WARMUP_STEPS (3), TIMED_STEPS (4), BUILD
# (build-gpu), PYTHON (python3), CELL_TIMEOUT (120 s per process).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source bench/lib/gpu_build.sh
source bench/lib/gpu_log.sh

OUT=${OUT:-$PWD/outputs/bench/attention_ab}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
B=${BUILD:-build-gpu}
ROUNDS=${ROUNDS:-2}
WARM=${WARMUP_STEPS:-3}
TIMED=${TIMED_STEPS:-4}
STEPS=$((WARM + TIMED + 1))
CELL_TIMEOUT=${CELL_TIMEOUT:-120}
WORK=outputs/bench/attention_ab_work
SRC=src/ops/rope.cpp
LINE='  if (compat::flash_attention_applies(q, k, v)) return CausalFlashFn::apply(q, k, v);'
T0=$(date +%s)
say() { printf '[%4ds] %s\n' $(($(date +%s) - T0)) "$*"; }

say "attention ops alone"
"$PY" bench/speed/attention_backends.py >"$OUT/attention_backends.md" 2>&1
cat "$OUT/attention_backends.md"

rm -rf "$WORK"
mkdir -p "$WORK"
say "build: flash (the tree as it is)"
gpu_build . "$B" "$OUT/build.log" viaduct_app || { say "build failed"; exit 1; }
cp "$B/viaduct" "$WORK/viaduct_flash"
cp "$SRC" "$WORK/rope.cpp.orig"
trap 'cp "$WORK/rope.cpp.orig" "$SRC"' EXIT
grep -qxF "$LINE" "$SRC" || { say "$SRC: the CausalFlashFn line is not there"; exit 1; }
"$PY" - "$SRC" "$LINE" <<'PYEOF'
import sys
path, line = sys.argv[1], sys.argv[2]
s = open(path).read()
assert s.count(line + "\n") == 1
open(path, "w").write(s.replace(line + "\n", "  // attention_ab.sh: the core through causal_sdpa, SDPA's own pick\n"))
PYEOF
say "build: sdpa (CausalFlashFn's line replaced by causal_sdpa)"
gpu_build . "$B" "$OUT/build_sdpa.log" viaduct_app || { say "sdpa build failed"; exit 1; }
cp "$B/viaduct" "$WORK/viaduct_sdpa"
cp "$WORK/rope.cpp.orig" "$SRC"

DATA=outputs/bench/random_v128256.u32
if [ ! -f "$DATA" ]; then
  mkdir -p "$(dirname "$DATA")"
  "$PY" -c "
import array, random, sys
r = random.Random(1234)
a = array.array('I', (r.randrange(128256) for _ in range($(((STEPS + 4) * 4 * 4096 + 1)))))
open('$DATA', 'wb').write(a.tobytes())"
fi
: >"$OUT/gpu.md"
gpu_state "idle, before the runs" >>"$OUT/gpu.md"
run_vd() {  # variant round
  local dir=$WORK/$1_r$2
  local cmd=("$WORK/viaduct_$1" train --config configs/llama_debug.toml --model.flavor=1B
    --training.seq_len=4096 --training.local_batch_size=4 --optimizer.lr=3e-4
    --training.dtype=bfloat16 --training.device=cuda --training.steps="$STEPS"
    --training.eval_interval=0 --training.num_threads="$(nproc)"
    --training.deterministic=false --checkpoint.enable=false --metrics.log_freq=1
    --metrics.progress_bar=false --metrics.profile_step="$STEPS"
    --metrics.profile_host_ops=false --data.path="$DATA" --job.dump_folder="$dir")
  echo "${cmd[*]}" >"$OUT/$1_r$2.cmd"
  say "round $2: $1"
  with_gpu_log "$OUT/gpu.md" "round $2 $1" timeout "$CELL_TIMEOUT" "${cmd[@]}" \
    >"$OUT/$1_r$2.log" 2>&1 || { say "round $2: $1 failed"; tail -5 "$OUT/$1_r$2.log"; }
  cp "$dir/metrics.jsonl" "$OUT/$1_r$2.metrics.jsonl" 2>/dev/null
  cp "$dir/profile/step-$STEPS-rank-0.trace.json" "$OUT/$1_r$2.trace.json" 2>/dev/null
}
median_ms() {  # metrics.jsonl
  "$PY" -c "
import json, statistics, sys
try:
    s = [json.loads(l)['step_seconds'] for l in open('$1') if '\"loss\"' in l]
    print(f'{1000 * statistics.median(s[$WARM:$WARM + $TIMED]):.2f}')
except Exception:
    print('nan')"
}
for r in $(seq 1 "$ROUNDS"); do
  if [ "$r" -gt 1 ] && [ -n "${ROUND_BUDGET_S:-}" ] &&
    [ $(($(date +%s) - T0)) -gt "$ROUND_BUDGET_S" ]; then
    say "round $r: not started (ROUND_BUDGET_S=$ROUND_BUDGET_S)"
    ROUNDS=$((r - 1))
    break
  fi
  run_vd flash "$r"
  run_vd sdpa "$r"
done
rm -rf "$WORK"/*_r*

{
  echo "# viaduct's attention core: flash's ATen ops against SDPA's own pick"
  echo
  echo "llama 1B, 4 x 4096, bf16; $WARM warm-up + $TIMED timed steps, step $STEPS" \
    "profiled (device kernels only); rounds of flash then sdpa."
  echo
  cat "$OUT/attention_backends.md"
  echo
  cat "$OUT/gpu.md"
  for r in $(seq 1 "$ROUNDS"); do
    echo
    echo "## Round $r"
    echo
    echo "median step of the timed steps: flash $(median_ms "$OUT/flash_r$r.metrics.jsonl") ms," \
      "sdpa $(median_ms "$OUT/sdpa_r$r.metrics.jsonl") ms"
    echo
    [ -f "$OUT/flash_r$r.trace.json" ] && [ -f "$OUT/sdpa_r$r.trace.json" ] &&
      "$PY" bench/speed/kernel_classes.py --trace flash="$OUT/flash_r$r.trace.json" \
        --trace sdpa="$OUT/sdpa_r$r.trace.json" \
        --wall flash="$(median_ms "$OUT/flash_r$r.metrics.jsonl")" \
        --wall sdpa="$(median_ms "$OUT/sdpa_r$r.metrics.jsonl")" \
        --note flash="$(grep -F -- "- round $r flash:" "$OUT/gpu.md" | sed 's/^- [^:]*: //')" \
        --note sdpa="$(grep -F -- "- round $r sdpa:" "$OUT/gpu.md" | sed 's/^- [^:]*: //')" \
        --top 6 2>&1
    echo
    echo "losses, steps 1-5: flash $(grep -o '"loss":[0-9.e+-]*' "$OUT/flash_r$r.metrics.jsonl" |
      head -5 | cut -d: -f2 | tr '\n' ' '); sdpa $(grep -o '"loss":[0-9.e+-]*' \
      "$OUT/sdpa_r$r.metrics.jsonl" | head -5 | cut -d: -f2 | tr '\n' ' ')"
  done
} >"$OUT/results.md"
say "done"
cat "$OUT/results.md"
