#!/usr/bin/env bash
# AttnRes transports on CPU: the rank cache with the deposit backward
# (default), the rank cache with the whole-stack backward
# (parallelism.attn_res_cache_backward = whole_stack) and the whole stack
# (parallelism.attn_res_cache = false), kimi_k3 debugmodel_deep, fp32,
# Interleaved1F1B at pp4 x 2 and pp2 x 2 stages per rank, one thread per
# rank. Prints per layout and mode the forward and backward bytes per hop of
# one step (metrics.jsonl hop_bytes / hop_grad_bytes), the store peaks, the
# median and fastest step time (after 2 warm-up steps) against the deposit
# backward's, and whether the final checkpoint equals one process's
# (`viaduct checkpoint compare`). Step times share the machine's cores with
# whatever else runs: the script prints the load average before and after.
# usage: bench/speed/attn_res_backward_modes.sh BUILD_DIR [DATA_FILE] [STEPS]
set -euo pipefail
BIN=$1/viaduct
DATA=${2:-data/fortunes.tok}
STEPS=${3:-10}
OUT=${OUT:-/tmp}/attn_res_backward_modes
rm -rf "$OUT"; mkdir -p "$OUT"
common=(--config configs/kimi_k3_debug.toml --model.flavor=debugmodel_deep
        --training.seq_len=128 --training.local_batch_size=8 --training.dtype=float32
        --training.num_threads=1 --training.steps=$STEPS --training.eval_interval=0
        --checkpoint.enable=true --checkpoint.interval=$STEPS --metrics.log_freq=1
        --metrics.progress_bar=false --data.path=$DATA
        --parallelism.pipeline_parallel_microbatches=8)
declare -A MODE=(
  [deposit]="--parallelism.attn_res_cache=true --parallelism.attn_res_cache_backward=deposit"
  [cache_wsb]="--parallelism.attn_res_cache=true --parallelism.attn_res_cache_backward=whole_stack"
  [whole]="--parallelism.attn_res_cache=false")
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
"$BIN" train "${common[@]}" --job.dump_folder="$OUT/one" > "$OUT/one.log" 2>&1
for pp in 4 2; do
  for m in deposit cache_wsb whole; do
    # shellcheck disable=SC2086
    "$BIN" launch --nproc-per-node $pp -- "$BIN" train "${common[@]}" \
      --parallelism.pipeline_parallel_degree=$pp \
      --parallelism.pipeline_parallel_schedule=Interleaved1F1B \
      --parallelism.pipeline_parallel_stages_per_rank=2 ${MODE[$m]} \
      --job.dump_folder="$OUT/pp${pp}_$m" > "$OUT/pp${pp}_$m.log" 2>&1
    "$BIN" checkpoint compare "$OUT/one/checkpoint" "$OUT/pp${pp}_$m/checkpoint" \
      > "$OUT/pp${pp}_$m.compare" 2>&1 || true
  done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$OUT" <<'PY'
import json, sys, statistics
out = sys.argv[1]
names = {"deposit": "cache, deposit backward", "cache_wsb": "cache, whole_stack backward",
         "whole": "whole stack"}
def rows(run):
    return [json.loads(l) for l in open(f"{out}/{run}/metrics.jsonl") if '"loss"' in l]
one = [r["loss"] for r in rows("one")]
for pp in (4, 2):
    print(f"## debugmodel_deep pp{pp} x 2 (Interleaved1F1B, seq 128, batch 8, 8 micro-batches, fp32)")
    print("| mode | forward bytes per hop | backward bytes per hop | fwd + bwd per step | "
          "store peak per rank | median step s (vs deposit) | fastest step s (vs deposit) | "
          "losses = one process | checkpoint |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = fast = None
    for m in ("deposit", "cache_wsb", "whole"):
        rs = rows(f"pp{pp}_{m}")
        fwd, bwd = rs[0]["hop_bytes"], rs[0]["hop_grad_bytes"]
        assert all(r["hop_bytes"] == fwd and r["hop_grad_bytes"] == bwd for r in rs)
        t = statistics.median(r["step_seconds"] for r in rs[2:])  # 2 warm-up steps
        f = min(r["step_seconds"] for r in rs[2:])
        base, fast = base or t, fast or f
        cmp = open(f"{out}/pp{pp}_{m}.compare").read().strip().splitlines()[-1]
        print(f"| {names[m]} | {' '.join(str(b // 1024) for b in fwd)} KiB "
              f"| {' '.join(str(b // 1024) for b in bwd)} KiB | {(sum(fwd) + sum(bwd)) / 2**20:.2f} MiB "
              f"| {' '.join(str(b // 1024) for b in rs[0]['attn_res_store_peak_bytes'])} KiB "
              f"| {t:.3f} ({t / base:.3f}) | {f:.3f} ({f / fast:.3f}) "
              f"| {[r['loss'] for r in rs] == one} | {cmp} |")
    print()
PY
