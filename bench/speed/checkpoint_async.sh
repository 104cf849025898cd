#!/usr/bin/env bash
# What a checkpoint costs the training loop, sync against async
# (checkpoint.async_mode), for llama-1B on one GPU: three runs of the same
# STEPS steps -- no checkpoint, a synchronous save every INTERVAL steps, an
# asynchronous one -- and per mode the wall time, the median step time, the
# median time of the steps right after a save (where an async writer
# competes with training) and the cost per save, (wall - wall without
# saves) / saves. One markdown table in $OUT/checkpoint_async.md.
#
#   bash bench/speed/checkpoint_async.sh          # needs a CUDA build (VIADUCT)
#
# An asynchronous save only hides its write when the interval's training
# outlasts the write (llama-1B's 18 GB take about half a minute on the GPU
# machine's disk): the defaults give 300 steps (about 40 s) between saves.
# The per-save write and host-copy seconds come from the runs' log lines.
#
# Environment (defaults): VIADUCT (build/viaduct), OUT
# (outputs/bench/ckpt_async), STEPS (601), INTERVAL (300), BATCH x SEQ (4 x
# 2048), PYTHON (python3). The checkpoints go to $OUT/<mode>/checkpoint: a
# local disk, as in training, not a network mount.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
V=${VIADUCT:-build/viaduct}
OUT=${OUT:-$PWD/outputs/bench/ckpt_async}
STEPS=${STEPS:-601}
INTERVAL=${INTERVAL:-300}
BATCH=${BATCH:-4}
SEQ=${SEQ:-2048}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
DATA=$OUT/random_v128256.u32
[ -f "$DATA" ] || "$PY" -c "
import array, random
r = random.Random(1234)
a = array.array('I', (r.randrange(128256) for _ in range(($STEPS + 4) * $BATCH * $SEQ + 1)))
open('$DATA', 'wb').write(a.tobytes())"

run() {  # mode, extra overrides...
  local mode=$1; shift
  rm -rf "${OUT:?}/$mode"
  local t0 t1
  t0=$(date +%s.%N)
  "$V" train --config configs/llama_debug.toml --model.flavor=1B --training.device=cuda \
    --training.dtype=bfloat16 --training.seq_len="$SEQ" --training.local_batch_size="$BATCH" \
    --training.steps="$STEPS" --training.eval_interval=0 --metrics.progress_bar=false \
    --data.path="$DATA" --job.dump_folder="$OUT/$mode" "$@" > "$OUT/$mode.log" 2>&1 ||
    { echo "$mode failed:"; tail -5 "$OUT/$mode.log"; return 1; }
  t1=$(date +%s.%N)
  echo "$t0 $t1" > "$OUT/$mode.wall"
}
run none --checkpoint.enable=false
run sync --checkpoint.enable=true --checkpoint.interval="$INTERVAL" --checkpoint.save_final=false \
  --checkpoint.keep_latest_k=1
run async --checkpoint.enable=true --checkpoint.interval="$INTERVAL" --checkpoint.save_final=false \
  --checkpoint.keep_latest_k=1 --checkpoint.async_mode=async

"$PY" - "$OUT" "$STEPS" "$INTERVAL" > "$OUT/checkpoint_async.md" <<'PY'
import json, re, statistics, sys
out, steps, interval = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
saves = (steps - 1) // interval  # the last step saves nothing (save_final off)
def wall(mode):
    t0, t1 = map(float, open(f"{out}/{mode}.wall").read().split())
    return t1 - t0
def step_times(mode):
    rows = [json.loads(l) for l in open(f"{out}/{mode}/metrics.jsonl") if '"loss"' in l]
    return {r["step"]: r["step_seconds"] for r in rows}
def logged(mode, pattern):
    return [float(m) for m in re.findall(pattern, open(f"{out}/{mode}.log").read())]
def med(xs):
    return f"{statistics.median(xs):.2f}" if xs else "-"
base = wall("none")
print(f"llama-1B, {steps} steps, a save every {interval} steps ({saves} saves)\n")
print("| mode | wall s | median step s | median step after a save s | cost per save s "
      "| write s (median) | host copy s | waited for the previous write s |")
print("|---|---|---|---|---|---|---|---|")
for mode in ("none", "sync", "async"):
    t = step_times(mode)
    after = [t[s + 1] for s in range(interval, steps, interval) if s + 1 in t]
    cost = (wall(mode) - base) / saves if mode != "none" and saves else 0.0
    writes = logged(mode, r"saved checkpoint \S+ in ([0-9.]+) s")
    copies = logged(mode, r"copied to host memory in ([0-9.]+) s")
    waits = logged(mode, r"waited ([0-9.]+) s for the previous")
    print(f"| {mode} | {wall(mode):.1f} | {statistics.median(t.values()):.3f} | "
          f"{statistics.median(after) if after else float('nan'):.3f} | {cost:.2f} | "
          f"{med(writes)} | {med(copies)} | {sum(waits):.1f} |")
PY
cat "$OUT/checkpoint_async.md"
