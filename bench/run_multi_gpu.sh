#!/usr/bin/env bash
# Issue 8 on one host with several GPUs (nvidia-h200-x2 and up), in one
# device call, each section under its own time limit:
#   smoke    llama debugmodel at pp = NGPU over NCCL, with VIADUCT_TRACE_P2P
#            on: on a hang, each rank's last actions (and gdb stacks when gdb
#            exists); the other sections run only if this one passes;
#   bitwise  llama debugmodel, bf16, deterministic kernels: pp = NGPU (1F1B
#            and Interleaved1F1B x 2 stages a rank) against one process, same
#            micro-batches: every checkpoint tensor after 4 steps;
#   layers   an 8B-class layer shape (dim 4096, 32 heads, 8 KV heads, FFN
#            14336, vocabulary 128256; LAYERS layers, default 8) at pp = NGPU
#            for SCHEDULES: tok/s, MFU, rank 0's peak memory, measured bubble
#            (mean over ranks) against the simulator's;
#   peer     the same shape and layout trained by torch.distributed.pipelining
#            (bench/torch_pipeline.py) from viaduct's step-0, same data: the
#            side-by-side row of the first schedule in SCHEDULES.
#
#   SECTIONS="smoke bitwise layers peer" bash bench/run_multi_gpu.sh build-gpu
# Results: $OUT/multi.md (one table) and stdout.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
B=${1:-build-gpu}
V=$B/viaduct
OUT=${OUT:-/tmp/multi_gpu}
mkdir -p "$OUT"
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c GPU)}
SECTIONS=${SECTIONS:-smoke bitwise layers peer}
SCHEDULES=${SCHEDULES:-1F1B Interleaved1F1B GPipe ZBVZeroBubble}
LAYERS=${LAYERS:-8}
MICRO=${MICRO:-8}
STEPS=${STEPS:-8}
RUN_TIMEOUT=${RUN_TIMEOUT:-120}
PY=${PYTHON:-python3}
# For a CPU rehearsal of this script (Gloo): DEVICE=cpu DTYPE=float32 NGPU=2,
# and L8_EXTRA shrinking the layer shape.
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
MD=$OUT/multi.md
: >"$MD"
say() { echo "$*" | tee -a "$MD"; }
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
[ "$NGPU" -ge 2 ] || { say "run_multi_gpu: $NGPU GPU(s): needs 2 or more"; exit 1; }
launch() { timeout "$RUN_TIMEOUT" "$V" launch --nproc-per-node "$NGPU" -- "$V" train "$@"; }
errors() { grep -v '^\[rank [0-9]*\] frame #' "$1" | grep -iE "error|fail|what\(\)|timed out" | head -6; }

if has smoke; then
  say "## smoke: llama debugmodel, pp $NGPU, 1F1B, NCCL"
  log=$OUT/smoke.log
  VIADUCT_TRACE_P2P=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN} timeout 60 "$V" launch \
    --nproc-per-node "$NGPU" -- "$V" train --config configs/llama_debug.toml \
    --parallelism.pipeline_parallel_degree="$NGPU" --training.device="$DEVICE" \
    --training.dtype="$DTYPE" --training.steps=20 --metrics.log_freq=10 \
    --training.eval_interval=0 --checkpoint.enable=false --metrics.progress_bar=false \
    --job.dump_folder="$OUT/smoke" >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 45); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  if kill -0 $pid 2>/dev/null; then
    say "smoke: still running after 45 s (a hang); each rank's last traced actions:"
    for r in $(seq 0 $((NGPU - 1))); do
      grep "^\[rank $r\] trace:" "$log" | tail -3 | tee -a "$MD"
    done
    if command -v gdb >/dev/null; then
      for p in $(pgrep -f "$V train"); do
        say "--- stack of $p"
        gdb -p "$p" -batch -ex "thread apply all bt 14" 2>/dev/null |
          grep -E "^#|^Thread" | grep -E "viaduct::|c10d::|nccl|Thread" | head -30 | tee -a "$MD"
      done
    fi
    grep -E "NCCL (WARN|INFO)" "$log" | head -8 | tee -a "$MD"
  fi
  wait $pid
  rc=$?
  if [ $rc -ne 0 ]; then
    say "smoke failed (exit $rc):"
    grep -v "trace:" "$log" | grep -v "frame #" | tail -10 | tee -a "$MD"
    exit 1
  fi
  grep -E "step +(10|20) \|" "$log" | tee -a "$MD"
fi

if has bitwise; then
  say "## bitwise: llama debugmodel, bf16, deterministic, 4 steps, 4 micro-batches"
  common=(--config configs/llama_debug.toml --training.dtype="$DTYPE" --training.device="$DEVICE"
    --training.steps=4 --training.eval_interval=0 --training.deterministic=true
    --checkpoint.enable=true --checkpoint.interval=4 --metrics.progress_bar=false
    --parallelism.pipeline_parallel_microbatches=4)
  timeout "$RUN_TIMEOUT" "$V" train "${common[@]}" --job.dump_folder="$OUT/bw_ref" \
    >"$OUT/bw_ref.log" 2>&1 || { say "pp1 reference failed"; errors "$OUT/bw_ref.log"; }
  for lay in "1F1B:1" "Interleaved1F1B:2"; do
    sched=${lay%%:*} v=${lay#*:}
    name=bw_${sched}_$v
    launch "${common[@]}" --parallelism.pipeline_parallel_degree="$NGPU" \
      --parallelism.pipeline_parallel_schedule="$sched" \
      --parallelism.pipeline_parallel_stages_per_rank="$v" \
      --job.dump_folder="$OUT/$name" >"$OUT/$name.log" 2>&1 ||
      { say "$name failed"; errors "$OUT/$name.log"; continue; }
    say "pp $NGPU x $v $sched vs one process: $("$V" checkpoint compare "$OUT/bw_ref/checkpoint" \
      "$OUT/$name/checkpoint" 2>&1 | tail -1)"
  done
fi

L8=(--config configs/llama_debug.toml --model.flavor=8B --model.n_layers="$LAYERS"
  --training.seq_len=4096 --training.local_batch_size="$MICRO" --training.dtype="$DTYPE"
  --training.device="$DEVICE" --training.steps="$STEPS" --training.eval_interval=0
  --training.deterministic=false --optimizer.lr=3e-4 --metrics.log_freq=1
  --metrics.progress_bar=false --parallelism.pipeline_parallel_degree="$NGPU"
  --parallelism.pipeline_parallel_microbatches="$MICRO" ${L8_EXTRA:-})
DATA=outputs/bench/random_v128256_multi.u32
if has layers || has peer; then
  mkdir -p outputs/bench
  [ -f "$DATA" ] || "$PY" -c "
import array, random, sys
r = random.Random(1234)
a = array.array('I', (r.randrange(128256) for _ in range(($STEPS + 4) * $MICRO * 4096 + 1)))
open('$DATA', 'wb').write(a.tobytes())"
fi
stages_for() { case $1 in Interleaved1F1B | LoopedBFS | InterleavedZeroBubble | ZBVZeroBubble) echo 2 ;; *) echo 1 ;; esac; }

if has layers; then
  say "## layers: llama 8B layer shape, $LAYERS layers, $MICRO x 4096 tokens in $MICRO micro-batches, pp $NGPU"
  say "| schedule | stages/rank | tok/s | MFU | rank-0 peak GiB | bubble measured (mean) | simulated | P2P MB/step |"
  say "|---|---|---|---|---|---|---|---|"
  first=1
  for sched in $SCHEDULES; do
    v=$(stages_for "$sched")
    name=l8_$sched
    extra=()
    if [ $first = 1 ] && has peer; then
      extra=(--checkpoint.enable=true --checkpoint.save_initial=true
        --checkpoint.interval=1000000 --checkpoint.keep_latest_k=0)
    else
      extra=(--checkpoint.enable=false)
    fi
    launch "${L8[@]}" "${extra[@]}" --parallelism.pipeline_parallel_schedule="$sched" \
      --parallelism.pipeline_parallel_stages_per_rank="$v" --data.path="$DATA" \
      --job.dump_folder="$OUT/$name" >"$OUT/$name.log" 2>&1 ||
      { say "| $sched | $v | failed: $(errors "$OUT/$name.log" | head -1 | cut -c1-150) | | | | | |"; first=0; continue; }
    "$PY" - "$OUT/$name/metrics.jsonl" "$sched" "$v" <<'PY' | tee -a "$MD"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
t = rows[3:] if len(rows) > 4 else rows[1:]
def med(k):
    v = [r[k] for r in t if r.get(k) is not None]
    return statistics.median(v) if v else float("nan")
mfu = med("mfu")
print(f"| {sys.argv[2]} | {sys.argv[3]} | {med('tokens_per_sec'):.0f} | {100 * mfu:.1f}% | "
      f"{max(r['peak_memory_bytes'] for r in t) / 2**30:.1f} | "
      f"{100 * med('bubble_measured_mean'):.1f}% | {100 * t[-1].get('bubble_simulated', float('nan')):.1f}% | "
      f"{med('p2p_bytes') / 1e6:.0f} |")
PY
    first=0
  done
fi

if has peer; then
  sched=${SCHEDULES%% *}
  v=$(stages_for "$sched")
  ck=$OUT/l8_$sched/checkpoint/step-0
  say "## peer: torch.distributed.pipelining, $sched, pp $NGPU x $v"
  if [ -f "$ck/metadata.json" ]; then
    "$V" split "${L8[@]}" --parallelism.pipeline_parallel_schedule="$sched" \
      --parallelism.pipeline_parallel_stages_per_rank="$v" --json >"$OUT/split.json" 2>"$OUT/split.err"
    timeout "$RUN_TIMEOUT" torchrun --nproc-per-node "$NGPU" bench/torch_pipeline.py \
      --checkpoint "$ck" --split-json "$OUT/split.json" --timing-warmup 3 \
      --json-out "$OUT/peer.json" >"$OUT/peer.log" 2>&1 ||
      { say "peer failed:"; grep -v "^ " "$OUT/peer.log" | grep -iE "error|exception" | head -6 | tee -a "$MD"; }
    if [ -f "$OUT/peer.json" ]; then
      "$PY" bench/torch_llama.py report --cell "llama 8B-layer x$LAYERS pp$NGPU $sched" \
        --timing-warmup 3 --viaduct-metrics "$OUT/l8_$sched/metrics.jsonl" \
        --peer "$OUT/peer.json" --checkpoint "$ck" 2>&1 | tee -a "$MD"
    fi
  else
    say "no $ck (the layers section's first run saves it)"
  fi
fi
say "done"
