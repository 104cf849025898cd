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
#            (bench/multi_gpu/torch_pipeline.py) from viaduct's step-0 (saved by a
#            separate untimed run), same data: the side-by-side row of the
#            first schedule in SCHEDULES;
#   k3       kimi_k3 debugmodel_deep as it is and widened (dim 2048, MLA in
#            every layer, AttnRes blocks of 3), pp = NGPU x 2 stages
#            (Interleaved1F1B, 8 micro-batches): rank cache, rank cache +
#            host offload, whole stack: tok/s, peak memory and block-store
#            peak per rank, P2P bytes and wait per step;
#   ep       expert parallelism: kimi_k3 with the full flavor's MoE shape
#            (128 experts top-8, expert width 1024, dim 2048; EP_LAYERS
#            layers, default 4) at dp = NGPU for ep 1, 2, 4, ... up to NGPU
#            (each dividing it): tok/s, MFU, peak memory, the all-to-all's
#            bytes and host seconds per step and their share of the step, the
#            busiest expert over the mean, and whether the losses of the
#            first steps equal ep 1's.
#
#   SECTIONS="smoke bitwise layers peer k3 ep" bash bench/multi_gpu/run_multi_gpu.sh build-gpu
# Results: $OUT/multi.md (one table) and stdout. A BUILD_DIR without
# viaduct is built first (bench/lib/gpu_build.sh; a fresh machine).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source bench/lib/gpu_build.sh
B=${1:-build-gpu}
V=$B/viaduct
OUT=${OUT:-/tmp/multi_gpu}
mkdir -p "$OUT"
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c GPU)}
SECTIONS=${SECTIONS:-smoke bitwise layers peer k3 ep}
# A schedule name with "+flops" runs with parallelism.pipeline_parallel_balance
# = flops (Note [Split balanced by FLOPs]).
SCHEDULES=${SCHEDULES:-1F1B Interleaved1F1B Interleaved1F1B+flops GPipe ZBVZeroBubble}
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
if [ ! -x "$V" ]; then
  gpu_build . "$B" "$OUT/build.log" viaduct_app || { say "run_multi_gpu: build failed"; exit 1; }
fi
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

first_sched=${SCHEDULES%% *}
first_sched=${first_sched%+flops}
if has peer; then  # the peer's step-0: an untimed run of the first schedule
  launch "${L8[@]}" --training.steps=1 --checkpoint.enable=true --checkpoint.save_initial=true \
    --checkpoint.save_final=false --parallelism.pipeline_parallel_schedule="$first_sched" \
    --parallelism.pipeline_parallel_stages_per_rank="$(stages_for "$first_sched")" \
    --data.path="$DATA" --job.dump_folder="$OUT/l8_ck" >"$OUT/l8_ck.log" 2>&1 ||
    { say "step-0 save for the peer failed:"; errors "$OUT/l8_ck.log"; }
fi

if has layers; then
  say "## layers: llama 8B layer shape, $LAYERS layers, $MICRO x 4096 tokens in $MICRO micro-batches, pp $NGPU"
  say "| schedule | stages/rank | tok/s | MFU | peak GiB per rank | bubble measured (mean) | simulated | P2P MB/step |"
  say "|---|---|---|---|---|---|---|---|"
  for entry in $SCHEDULES; do
    sched=${entry%+flops}
    balance=layers
    [ "$sched" != "$entry" ] && balance=flops
    v=$(stages_for "$sched")
    name=l8_$entry
    launch "${L8[@]}" --checkpoint.enable=false --parallelism.pipeline_parallel_schedule="$sched" \
      --parallelism.pipeline_parallel_balance="$balance" \
      --parallelism.pipeline_parallel_stages_per_rank="$v" --data.path="$DATA" \
      --job.dump_folder="$OUT/$name" >"$OUT/$name.log" 2>&1 ||
      { say "| $entry | $v | failed: $(errors "$OUT/$name.log" | head -1 | cut -c1-150) | | | | | |"; continue; }
    "$PY" bench/multi_gpu/multi_gpu_row.py layers "$OUT/$name/metrics.jsonl" "$entry" "$v" | tee -a "$MD"
  done
fi

if has peer; then
  sched=$first_sched
  v=$(stages_for "$sched")
  ck=$OUT/l8_ck/checkpoint/step-0
  say "## peer: torch.distributed.pipelining, $sched, pp $NGPU x $v"
  if [ -f "$ck/metadata.json" ]; then
    "$V" split "${L8[@]}" --parallelism.pipeline_parallel_schedule="$sched" \
      --parallelism.pipeline_parallel_stages_per_rank="$v" --json >"$OUT/split.json" 2>"$OUT/split.err"
    timeout "$RUN_TIMEOUT" torchrun --nproc-per-node "$NGPU" bench/multi_gpu/torch_pipeline.py \
      --checkpoint "$ck" --split-json "$OUT/split.json" --timing-warmup 3 --steps "$STEPS" \
      --json-out "$OUT/peer.json" >"$OUT/peer.log" 2>&1 ||
      { say "peer failed:"; grep -v "^ " "$OUT/peer.log" | grep -iE "error|exception" | head -6 | tee -a "$MD"; }
    if [ -f "$OUT/peer.json" ]; then
      "$PY" reference/torch_llama.py report --cell "llama 8B-layer x$LAYERS pp$NGPU $sched" \
        --timing-warmup 3 --viaduct-metrics "$OUT/l8_$sched/metrics.jsonl" \
        --peer "$OUT/peer.json" --checkpoint "$ck" 2>&1 | tee -a "$MD"
    fi
  else
    say "no $ck (the untimed save run failed)"
  fi
fi
if has k3; then
  mkdir -p outputs/bench
  K3DATA=outputs/bench/random_v320_multi.u32
  [ -f "$K3DATA" ] || "$PY" -c "
import array, random
r = random.Random(1234)
a = array.array('I', (r.randrange(320) for _ in range(($STEPS + 4) * 8 * 2048 + 1)))
open('$K3DATA', 'wb').write(a.tobytes())"
  k3=(--config configs/kimi_k3_debug.toml --model.flavor=debugmodel_deep --training.seq_len=2048
    --training.local_batch_size=8 --training.dtype="$DTYPE" --training.device="$DEVICE"
    --training.steps="$STEPS" --training.eval_interval=0 --checkpoint.enable=false
    --training.deterministic=false --metrics.log_freq=1 --metrics.progress_bar=false
    --parallelism.pipeline_parallel_degree="$NGPU" --parallelism.pipeline_parallel_stages_per_rank=2
    --parallelism.pipeline_parallel_schedule=Interleaved1F1B
    --parallelism.pipeline_parallel_microbatches=8 --data.path="$K3DATA")
  say "## k3: kimi_k3 debugmodel_deep, 8 x 2048 tokens in 8 micro-batches, pp $NGPU x 2 stages, Interleaved1F1B"
  say "| shape | transport | tok/s | peak GiB per rank | store peak MiB per rank | P2P MB/step | P2P wait s/step | final loss |"
  say "|---|---|---|---|---|---|---|---|"
  for shape in "deep:" "wide:--model.dim=2048 --model.mla_interval=1 --model.attn_res_block_size=3"; do
    sname=${shape%%:*} sargs=${shape#*:}
    for mode in "cache:--parallelism.attn_res_cache=true" \
        "cache+offload:--parallelism.attn_res_cache=true --parallelism.attn_res_cache_offload=true" \
        "whole-stack:--parallelism.attn_res_cache=false"; do
      name=${mode%%:*} args=${mode#*:}
      dir=$OUT/k3_${sname}_$name
      # shellcheck disable=SC2086
      launch "${k3[@]}" $sargs $args ${K3_EXTRA:-} --job.dump_folder="$dir" >"$dir.log" 2>&1 ||
        { say "| $sname | $name | failed: $(errors "$dir.log" | head -1 | cut -c1-150) | | | | | |"; continue; }
      "$PY" bench/multi_gpu/multi_gpu_row.py k3 "$dir/metrics.jsonl" "$sname" "$name" | tee -a "$MD"
    done
  done
fi
if has ep; then
  mkdir -p outputs/bench
  EPDATA=outputs/bench/random_v163840_ep.u32
  [ -f "$EPDATA" ] || "$PY" -c "
import array, random
r = random.Random(1234)
a = array.array('I', (r.randrange(163840) for _ in range(($STEPS + 4) * $NGPU * 4 * 4096 + 1)))
open('$EPDATA', 'wb').write(a.tobytes())"
  EP_LAYERS=${EP_LAYERS:-4}
  ep_run=(--config configs/kimi_k3_debug.toml --model.flavor=full --model.n_layers="$EP_LAYERS"
    --model.vision=false --training.seq_len=4096 --training.local_batch_size=4
    --training.dtype="$DTYPE" --training.device="$DEVICE" --training.steps="$STEPS"
    --training.eval_interval=0 --checkpoint.enable=false --metrics.log_freq=1
    --metrics.progress_bar=false --parallelism.data_parallel_degree="$NGPU"
    --data.path="$EPDATA" ${EP_EXTRA:-})
  say "## ep: kimi_k3 full-flavor MoE shape, $EP_LAYERS layers, 4 x 4096 tokens a rank, dp $NGPU"
  say "| ep | tok/s | MFU | peak GiB per rank | all-to-all MB/step | all-to-all s/step (share) | busiest expert / mean | losses = ep 1 |"
  say "|---|---|---|---|---|---|---|---|"
  for ep in 1 2 4 8 16; do
    [ "$ep" -le "$NGPU" ] && [ $((NGPU % ep)) -eq 0 ] || continue
    dir=$OUT/ep$ep
    launch "${ep_run[@]}" --parallelism.expert_parallel_degree="$ep" --job.dump_folder="$dir" \
      >"$dir.log" 2>&1 ||
      { say "| $ep | failed: $(errors "$dir.log" | head -1 | cut -c1-150) | | | | | | |"; continue; }
    "$PY" bench/multi_gpu/multi_gpu_row.py ep "$dir/metrics.jsonl" "$ep" "$OUT/ep1/metrics.jsonl" | tee -a "$MD"
  done
fi
say "done"
