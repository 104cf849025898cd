#!/usr/bin/env bash
# viaduct's step and the torch.compile peer's step on the same cell, profiled
# in one GPU-machine call, with one table of device time per kernel class
# side by side. Builds viaduct (bench/lib/gpu_build.sh), then ROUNDS times,
# alternating: viaduct trains WARMUP_STEPS + TIMED_STEPS + 1 steps and
# profiles the last (metrics.profile_step, device kernels only), then the
# PyTorch peer (reference/torch_llama.py --mode compile) trains the same
# steps from viaduct's step-0 (written in round 1) on the same tokens and
# profiles its last step the same way (--profile-step). nvidia-smi samples
# the SM clock and power of each process (bench/lib/gpu_log.sh).
# bench/speed/kernel_classes.py classifies both traces' kernels with one set
# of rules and prints, per round: device ms and kernel counts per class,
# busy, idle and span of the profiled step, the median unprofiled step time
# of each side, the top inductor kernels and the top kernels outside GEMMs
# and attention.
#
#   bash bench/speed/profile_vs_compile.sh            # the llama-1B cell, 2 rounds
#   STAGES=run ROUNDS=1 bash bench/speed/profile_vs_compile.sh
#
# Environment (defaults): OUT (outputs/bench/profile_vs_compile: logs,
# traces, gpu.md and results.md), ROUNDS (2), WARMUP_STEPS (3), TIMED_STEPS
# (6), COMPILE_MODE (default), STAGES ("build run"), BUILD (build-gpu),
# PYTHON (python3), VD_EXTRA (more viaduct overrides), CELL_TIMEOUT (240 s
# per process), ROUND_BUDGET_S (unset; set: a round after the first starts
# only this many seconds after the script did, so a lease's limit cuts no
# round in half). The cell: llama 1B, 4 x 4096 tokens, bf16, one GPU.
set -uo pipefail  # no -e: a failed round must not cost the others
cd "$(dirname "$0")/../.." || exit 1
source bench/lib/gpu_build.sh
source bench/lib/gpu_log.sh
source bench/lib/tokens.sh  # random_tokens

OUT=${OUT:-$PWD/outputs/bench/profile_vs_compile}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
B=${BUILD:-build-gpu}
ROUNDS=${ROUNDS:-2}
WARM=${WARMUP_STEPS:-3}
TIMED=${TIMED_STEPS:-6}
STEPS=$((WARM + TIMED + 1))  # the last one is profiled
COMPILE_MODE=${COMPILE_MODE:-default}
STAGES=${STAGES:-build run}
CELL_TIMEOUT=${CELL_TIMEOUT:-240}
WORK=outputs/bench/profile_vs_compile_work
T0=$(date +%s)
say() { printf '[%4ds] %s\n' $(($(date +%s) - T0)) "$*"; }

if [[ " $STAGES " == *" build "* ]]; then
  say "build (log: $OUT/build.log)"
  gpu_build . "$B" "$OUT/build.log" viaduct_app || { say "build: failed"; exit 1; }
  say "build: $B/viaduct ready"
fi
[[ " $STAGES " == *" run "* ]] || exit 0
[ -x "$B/viaduct" ] || { say "no $B/viaduct: build first"; exit 1; }

DATA=outputs/bench/random_v128256.u32
random_tokens "$DATA" 128256 $(((STEPS + 4) * 4 * 4096 + 1))

rm -rf "$WORK"
mkdir -p "$WORK"
: >"$OUT/gpu.md"
gpu_state "idle, before the runs" >>"$OUT/gpu.md"
CK=$WORK/vd_r1/checkpoint/step-0
extra=()
read -r -a extra <<<"${VD_EXTRA:-}"

for r in $(seq 1 "$ROUNDS"); do
  if [ "$r" -gt 1 ] && [ -n "${ROUND_BUDGET_S:-}" ] &&
    [ $(($(date +%s) - T0)) -gt "$ROUND_BUDGET_S" ]; then
    say "round $r: not started (ROUND_BUDGET_S=$ROUND_BUDGET_S)"
    ROUNDS=$((r - 1))
    break
  fi
  dir=$WORK/vd_r$r
  # Round 1 writes step-0, the peer's weights and data cursor.
  ck_args=(--checkpoint.enable=false)
  [ "$r" = 1 ] && ck_args=(--checkpoint.enable=true --checkpoint.save_initial=true
    --checkpoint.interval=1000000 --checkpoint.keep_latest_k=0 --checkpoint.save_final=false)
  vd_cmd=("$B/viaduct" train --config configs/llama_debug.toml --model.flavor=1B
    --training.seq_len=4096 --training.local_batch_size=4 --optimizer.lr=3e-4
    --training.dtype=bfloat16 --training.device=cuda --training.steps="$STEPS"
    --training.eval_interval=0 --training.num_threads="$(nproc)"
    --training.deterministic=false "${ck_args[@]}" --metrics.log_freq=1
    --metrics.progress_bar=false --metrics.profile_step="$STEPS"
    --metrics.profile_host_ops=false --data.path="$DATA" --job.dump_folder="$dir"
    "${extra[@]}")
  echo "${vd_cmd[*]}" >"$OUT/vd_r$r.cmd"
  say "round $r: viaduct, $STEPS steps, step $STEPS profiled"
  with_gpu_log "$OUT/gpu.md" "round $r viaduct" timeout "$CELL_TIMEOUT" "${vd_cmd[@]}" \
    >"$OUT/vd_r$r.log" 2>&1 ||
    { say "round $r: viaduct failed"; grep -v '^frame #' "$OUT/vd_r$r.log" | tail -8; }
  cp "$dir/metrics.jsonl" "$OUT/vd_r$r.metrics.jsonl" 2>/dev/null
  cp "$dir/profile/step-$STEPS-rank-0.trace.json" "$OUT/vd_r$r.trace.json" 2>/dev/null ||
    say "round $r: no viaduct trace"
  if [ -f "$CK/metadata.json" ]; then
    peer_cmd=("$PY" reference/torch_llama.py --checkpoint "$CK" --mode compile
      --compile-mode "$COMPILE_MODE" --timing-warmup "$WARM" --steps "$STEPS"
      --profile-step "$STEPS" --profile-trace "$OUT/peer_r$r.trace.json"
      --label "llama 1B, 4x4096, round $r" --json "$OUT/peer_r$r.json")
    echo "${peer_cmd[*]}" >"$OUT/peer_r$r.cmd"
    say "round $r: torch.compile peer, $STEPS steps, step $STEPS profiled"
    with_gpu_log "$OUT/gpu.md" "round $r torch.compile" timeout "$CELL_TIMEOUT" "${peer_cmd[@]}" \
      >"$OUT/peer_r$r.log" 2>&1 ||
      { say "round $r: peer failed"; tail -6 "$OUT/peer_r$r.log"; }
  else
    say "round $r: no $CK (viaduct's step-0): no peer run"
  fi
done
rm -rf "$WORK/vd_r1/checkpoint"  # 18 GB

# Each side's unprofiled step time: the median of the timed steps (the
# warm-up and the profiled last step left out), and each run's clock line.
wall_of() {  # vd|peer file
  "$PY" - "$1" "$2" "$WARM" "$TIMED" <<'PYEOF'
import json, statistics, sys
kind, path, warm, timed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
try:
    if kind == "vd":
        rows = [json.loads(l) for l in open(path) if l.strip()]
        s = [r["step_seconds"] for r in rows if "step_seconds" in r and "loss" in r]
    else:
        s = json.loads(open(path).read())["step_s"]
    print(f"{1000 * statistics.median(s[warm:warm + timed]):.2f}")
except (OSError, ValueError, KeyError, statistics.StatisticsError):
    print("nan")
PYEOF
}
clock_of() { grep -F -- "- $1:" "$OUT/gpu.md" | head -1 | sed 's/^- [^:]*: //'; }

{
  echo "# viaduct against torch.compile, kernel classes of one profiled step"
  echo
  echo "llama 1B, 4 x 4096, bf16; $ROUNDS rounds of viaduct then the peer;" \
    "$WARM warm-up + $TIMED timed steps, step $STEPS profiled (device kernels only)."
  echo "torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)," \
    "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo
  echo "GPU 0 (nvidia-smi, 200 ms samples over each process):"
  echo
  cat "$OUT/gpu.md"
  for r in $(seq 1 "$ROUNDS"); do
    echo
    echo "## Round $r"
    echo
    if [ ! -f "$OUT/vd_r$r.trace.json" ] || [ ! -f "$OUT/peer_r$r.trace.json" ]; then
      echo "(a trace is missing: see vd_r$r.log, peer_r$r.log)"
      continue
    fi
    "$PY" bench/speed/kernel_classes.py \
      --trace viaduct="$OUT/vd_r$r.trace.json" --trace compile="$OUT/peer_r$r.trace.json" \
      --wall viaduct="$(wall_of vd "$OUT/vd_r$r.metrics.jsonl")" \
      --wall compile="$(wall_of peer "$OUT/peer_r$r.json")" \
      --note viaduct="$(clock_of "round $r viaduct")" \
      --note compile="$(clock_of "round $r torch.compile")" \
      --top "${TOP:-15}" --json "$OUT/classes_r$r.json" 2>&1
    echo
    echo "losses, steps 1-5: viaduct" \
      "$(grep -o '"loss":[0-9.e+-]*' "$OUT/vd_r$r.metrics.jsonl" 2>/dev/null | head -5 |
        cut -d: -f2 | tr '\n' ' ')"
    grep -E '^step +[0-9]+ \|' "$OUT/peer_r$r.log" | sed 's/^/  peer: /'
  done
} >"$OUT/results.md"
say "done; logs, traces and results.md in $OUT"
cat "$OUT/results.md"
