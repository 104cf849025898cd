#!/usr/bin/env bash
# The pipeline executor's per-step overhead on one GPU: pp = 1 with 4 stages
# on the rank (Interleaved1F1B, every hand-over local) against the same
# micro-batches run without a pipeline, llama-1B shape, bf16. Prints the
# median tokens/s of each and their ratio.
# usage: bench/speed/executor_overhead.sh BUILD_DIR DATA_FILE [STEPS]
set -euo pipefail
BIN=$1/viaduct
DATA=$2
STEPS=${3:-10}
OUT=${OUT:-/tmp}/executor_overhead
rm -rf "$OUT"; mkdir -p "$OUT"
common=(--config configs/llama_debug.toml --model.flavor=1B --training.seq_len=2048
        --training.local_batch_size=8 --training.dtype=bfloat16 --training.steps=$STEPS
        --training.eval_interval=0 --checkpoint.enable=false --metrics.log_freq=1
        --metrics.progress_bar=false --data.path=$DATA --data.format=uint32
        --parallelism.pipeline_parallel_microbatches=4)
"$BIN" train "${common[@]}" --job.dump_folder="$OUT/direct" > "$OUT/direct.log" 2>&1
"$BIN" train "${common[@]}" --job.dump_folder="$OUT/executor" \
  --parallelism.pipeline_parallel_stages_per_rank=4 \
  --parallelism.pipeline_parallel_schedule=Interleaved1F1B > "$OUT/executor.log" 2>&1
python3 - "$OUT" <<'PY'
import json, sys, statistics
out = sys.argv[1]
def med(name):
    rows = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl") if '"loss"' in l]
    rows = rows[2:]  # warm-up steps
    return statistics.median(r["step_seconds"] for r in rows), rows[-1]["peak_memory_bytes"], [r["loss"] for r in rows]
d, dm, dl = med("direct")
e, em, el = med("executor")
print(f"| run | median step s | peak GiB |")
print(f"|---|---|---|")
print(f"| no pipeline, 4 micro-batches | {d:.4f} | {dm/2**30:.2f} |")
print(f"| pp1 x 4 stages Interleaved1F1B | {e:.4f} | {em/2**30:.2f} |")
print(f"executor overhead: {100*(e/d-1):+.2f}% of a step; losses equal: {dl == el}")
PY
