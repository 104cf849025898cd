#!/usr/bin/env bash
# One GPU-machine call for the checks that need a GPU but no peer:
#  1. bitwise on GPU: llama debugmodel, bf16, deterministic kernels, one
#     process without a pipeline against pp1 x 4 stages (Interleaved1F1B) and
#     pp1 x 2 stages (LoopedBFS), same micro-batches: losses and checkpoints;
#  2. the executor's overhead at the llama-1B shape
#     (bench/speed/executor_overhead.sh);
#  3. the AttnRes block store's host offload on kimi_k3 debugmodel_deep
#     widened (dim 2048, MLA layers only by default): peak device memory and
#     step time, cache on / on + offload / off.
# usage: bench/gpu_checks/gpu_checks.sh BUILD_DIR   (writes under $OUT)
# From the repository root; a BUILD_DIR without viaduct is built first
# (bench/lib/gpu_build.sh; a fresh machine).
set -uo pipefail
source "$(dirname "$0")/../lib/gpu_build.sh"
B=${1:-build-gpu}
V=$B/viaduct
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
if [ ! -x "$V" ]; then
  gpu_build . "$B" "$OUT/build.log" viaduct_app || { echo "gpu_checks: build failed"; exit 1; }
fi

SECTIONS=${SECTIONS:-1 2 3}
# Sections 1 and 3 train on the configs' fortunes tokens (data/fortunes.tok,
# README). A GPU machine has no fortunes package: the tokens are made from
# a carried copy of its files (data/fortunes_src, a copy of
# /usr/share/games/fortunes) when they did not travel themselves.
if [[ " $SECTIONS " == *" 1 "* || " $SECTIONS " == *" 3 "* ]] && [ ! -f data/fortunes.tok ]; then
  src=""
  for d in data/fortunes_src /usr/share/games/fortunes; do
    if [ -d "$d" ]; then src=$d; break; fi
  done
  if [ -z "$src" ]; then
    echo "gpu_checks: no data/fortunes.tok and no fortunes files to make it from" \
      "(carry data/ holding fortunes.tok, or data/fortunes_src: a copy of /usr/share/games/fortunes)"
    exit 1
  fi
  "$V" prepare-data --input "$src" --output data/fortunes.tok --val-fraction 0.05 \
    > "$OUT/prepare_data.log" 2>&1 ||
    { echo "gpu_checks: prepare-data from $src failed:"; tail -3 "$OUT/prepare_data.log"; exit 1; }
fi
if [[ " $SECTIONS " == *" 1 "* ]]; then
echo "== 1. bitwise on GPU (bf16, deterministic) =="
common=(--config configs/llama_debug.toml --training.dtype=bfloat16 --training.steps=4
        --training.eval_interval=0 --checkpoint.enable=true --checkpoint.interval=4
        --metrics.progress_bar=false --parallelism.pipeline_parallel_microbatches=4)
"$V" train "${common[@]}" --job.dump_folder="$OUT/det_ref" > "$OUT/det_ref.log" 2>&1 || tail -5 "$OUT/det_ref.log"
"$V" train "${common[@]}" --job.dump_folder="$OUT/det_ref2" > "$OUT/det_ref2.log" 2>&1 || tail -5 "$OUT/det_ref2.log"
"$V" train "${common[@]}" --job.dump_folder="$OUT/det_i4" --parallelism.pipeline_parallel_stages_per_rank=4 \
  --parallelism.pipeline_parallel_schedule=Interleaved1F1B > "$OUT/det_i4.log" 2>&1 || tail -5 "$OUT/det_i4.log"
"$V" train "${common[@]}" --job.dump_folder="$OUT/det_bfs" --parallelism.pipeline_parallel_stages_per_rank=2 \
  --parallelism.pipeline_parallel_schedule=LoopedBFS > "$OUT/det_bfs.log" 2>&1 || tail -5 "$OUT/det_bfs.log"
for run in det_ref2 det_i4 det_bfs; do
  echo "$run vs det_ref: $("$V" checkpoint compare "$OUT/det_ref/checkpoint" "$OUT/$run/checkpoint" | tail -1)"
done
grep -h '"loss"' "$OUT"/det_ref/metrics.jsonl | head -2 | cut -c1-60

fi
if [[ " $SECTIONS " == *" 2 "* ]]; then
echo "== 2. executor overhead (llama 1B, bf16, deterministic) =="
D=$(ls outputs/bench/random_v128256.u32 2>/dev/null | head -1)
if [ -n "$D" ]; then OUT=$OUT timeout 240 bash bench/speed/executor_overhead.sh "$B" "$D" 8 | tail -5; fi
fi

# Section 3's shape: K3_DIM (2048), K3_SEQ (2048), K3_BATCH (8), K3_MICRO
# (8 micro-batches), K3_BLOCK (3 layers per AttnRes block: 11 blocks),
# K3_MLA_INTERVAL (1: MLA everywhere, so the step is GEMM-bound rather than
# KDA-bound — the KDA step at dim 1024, batch 8 did not finish one run in
# 200 s), K3_STEPS (4), K3_RUN_TIMEOUT (150 s per run); small blocks and many
# micro-batches in flight make the store large. SECTIONS ("1 2 3") picks.
K3_DIM=${K3_DIM:-2048}
K3_SEQ=${K3_SEQ:-2048}
K3_BATCH=${K3_BATCH:-8}
K3_MICRO=${K3_MICRO:-8}
K3_BLOCK=${K3_BLOCK:-3}
K3_MLA_INTERVAL=${K3_MLA_INTERVAL:-1}
K3_STEPS=${K3_STEPS:-4}
K3_RUN_TIMEOUT=${K3_RUN_TIMEOUT:-150}
SECTIONS=${SECTIONS:-1 2 3}
[[ " $SECTIONS " == *" 3 "* ]] || exit 0
echo "== 3. AttnRes store offload (kimi_k3 debugmodel_deep, dim $K3_DIM, MLA every $K3_MLA_INTERVAL, $K3_BATCH x $K3_SEQ in $K3_MICRO micro-batches, blocks of $K3_BLOCK, pp1 x 4 stages) =="
k3=(--config configs/kimi_k3_debug.toml --model.flavor=debugmodel_deep --model.dim="$K3_DIM"
    --model.attn_res_block_size="$K3_BLOCK" --model.mla_interval="$K3_MLA_INTERVAL"
    --training.seq_len="$K3_SEQ" --training.local_batch_size="$K3_BATCH" --training.dtype=bfloat16
    --training.steps="$K3_STEPS" --training.eval_interval=0 --checkpoint.enable=false
    --training.deterministic=false --metrics.progress_bar=false
    --parallelism.pipeline_parallel_stages_per_rank=4
    --parallelism.pipeline_parallel_schedule=Interleaved1F1B
    --parallelism.pipeline_parallel_microbatches="$K3_MICRO")
for mode in "cache:--parallelism.attn_res_cache=true" \
            "cache+offload:--parallelism.attn_res_cache=true --parallelism.attn_res_cache_offload=true" \
            "whole-stack:--parallelism.attn_res_cache=false"; do
  name=${mode%%:*}; args=${mode#*:}
  echo "   $name ..."
  timeout "$K3_RUN_TIMEOUT" "$V" train "${k3[@]}" $args ${K3_EXTRA:-} --job.dump_folder="$OUT/k3_$name" \
    > "$OUT/k3_$name.log" 2>&1 || { echo "   $name failed or timed out:"; grep -v '^frame #' "$OUT/k3_$name.log" | tail -8; }
done
python3 - "$OUT" <<'PY'
import json, sys, statistics, os
out = sys.argv[1]
print("| kimi_k3 transport | median step s | peak device GiB | store peak MiB | final loss |")
print("|---|---|---|---|---|")
for name in ["cache", "cache+offload", "whole-stack"]:
    f = f"{out}/k3_{name}/metrics.jsonl"
    if not os.path.exists(f):
        print(f"| {name} | failed | | | |"); continue
    rows = [json.loads(l) for l in open(f) if '"loss"' in l]
    st = statistics.median(r["step_seconds"] for r in rows[1:]) if len(rows) > 1 else float("nan")
    sp = rows[-1].get("attn_res_store_peak_bytes", [0])
    sp = max(sp) if isinstance(sp, list) else sp
    print(f"| {name} | {st:.3f} | {rows[-1]['peak_memory_bytes']/2**30:.2f} | {sp/2**20:.1f} | {rows[-1]['loss']} |")
PY
