#!/usr/bin/env bash
# Speed of two source trees in one GPU-machine call: builds both with CUDA
# (side by side, each with half the cores), then trains each cell with the
# trees in alternating processes, ROUNDS rounds (A, B, A, B, ...), and prints
# per process the median step time of the timed steps (and of its host
# wait for the device at the step's end), tokens/s, energy per
# token (metrics.jsonl's energy_joules, summed over the timed steps), peak
# memory, the SM clock and power while it ran, and B / A per round.
#
#   bash bench/speed/ab_trees.sh .cache/base.tar .            # trees: A, B
#   CELLS="k3 1B" ROUNDS=2 VD_EXTRA="--training.deterministic=false" bash ...
#
# A tree is a folder or a .tar of one (git archive), unpacked under $WORK.
# Cells: k3 (kimi_k3 debugmodel_deep at d2048, 4 x 2048, random tokens of
# its vocabulary 320), 1B (llama 1B, 4 x 4096, vocabulary 128256) and gpt2
# (124M, 8 x 1024, vocabulary 50257), as bench/speed/run_single_gpu.sh's.
# Every run uses the config's defaults (training.deterministic = true) plus
# VD_EXTRA. Environment: OUT (outputs/ab), WORK (outputs/ab_work), CELLS
# ("k3"), ROUNDS (2), WARMUP_STEPS (3), TIMED_STEPS (10), TARGETS_B (B's
# build targets, "viaduct_app"; e.g. "viaduct_app test_kernels"), PYTHON, JOBS.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source bench/lib/gpu_build.sh
source bench/lib/tokens.sh  # random_tokens
source bench/lib/gpu_log.sh
OUT=${OUT:-$PWD/outputs/ab}
WORK=${WORK:-$PWD/outputs/ab_work}
mkdir -p "$OUT" "$WORK"
PY=${PYTHON:-python3}
CELLS=${CELLS:-k3}
ROUNDS=${ROUNDS:-2}
WARM=${WARMUP_STEPS:-3}
TIMED=${TIMED_STEPS:-10}
JOBS=${JOBS:-$(nproc)}
T0=$(date +%s)
say() { printf '[%4ds] %s\n' $(($(date +%s) - T0)) "$*" | tee -a "$OUT/ab.md"; }
[ $# -eq 2 ] || { echo "usage: $0 TREE_A TREE_B"; exit 2; }

unpack() {  # tree -> its folder
  if [[ $1 == *.tar ]]; then
    local dir
    dir=$WORK/$(basename "$1" .tar)
    if [ ! -f "$dir/.unpacked" ] || [ "$1" -nt "$dir/.unpacked" ]; then
      rm -rf "$dir" && mkdir -p "$dir" && tar -xf "$1" -C "$dir" && touch "$dir/.unpacked" ||
        return 1
    fi
    echo "$dir"
  else
    realpath "$1"
  fi
}
A=$(unpack "$1") || { say "cannot unpack $1"; exit 1; }
B=$(unpack "$2") || { say "cannot unpack $2"; exit 1; }
say "build $A and $B"
JOBS=$((JOBS / 2)) gpu_build "$A" "$A/build-gpu" "$OUT/build.A.log" viaduct_app &
pid=$!
read -r -a targets_b <<<"${TARGETS_B:-viaduct_app}"
JOBS=$((JOBS - JOBS / 2)) gpu_build "$B" "$B/build-gpu" "$OUT/build.B.log" "${targets_b[@]}"
rb=$?
wait "$pid"
ra=$?
[ $ra -eq 0 ] && [ $rb -eq 0 ] || { say "build failed (A $ra, B $rb)"; exit 1; }
say "built"

STEPS=$((WARM + TIMED))
cell_args() {  # cell -> data file, then overrides, one per line
  case $1 in
    k3) random_tokens "$WORK/v320.u32" 320 $(((STEPS + 2) * 4 * 2048 + 1))
        printf '%s\n' "$WORK/v320.u32" --model.family=kimi_k3 --model.flavor=debugmodel_deep \
          --model.dim=2048 --model.n_heads=16 --model.kda_head_dim=64 \
          --model.mla_kv_lora_rank=512 --model.mla_qk_nope_head_dim=128 \
          --model.mla_qk_rope_head_dim=64 --model.mla_v_head_dim=128 \
          --model.ffn_hidden_dim=5632 --model.moe_hidden_dim=512 --model.kda_chunk_size=64 \
          --training.seq_len=2048 --training.local_batch_size=4 --optimizer.lr=3e-4 ;;
    1B) random_tokens "$WORK/v128256.u32" 128256 $(((STEPS + 2) * 4 * 4096 + 1))
        printf '%s\n' "$WORK/v128256.u32" --model.flavor=1B --training.seq_len=4096 \
          --training.local_batch_size=4 --optimizer.lr=3e-4 ;;
    gpt2) random_tokens "$WORK/v50257.u32" 50257 $(((STEPS + 2) * 8 * 1024 + 1))
        printf '%s\n' "$WORK/v50257.u32" --model.family=gpt2 --model.flavor=124M \
          --training.seq_len=1024 --training.local_batch_size=8 --optimizer.lr=6e-4 ;;
    *) return 1 ;;
  esac
}

row() {  # metrics.jsonl label -> one line; also prints the median step (s) to fd 3
  "$PY" - "$1" "$2" "$WARM" <<'PYEOF'
import json, statistics, sys
path, label, warm = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.loads(l) for l in open(path) if '"loss"' in l]
t = rows[warm:]
med = statistics.median(r["step_seconds"] for r in t)
e = [r.get("energy_joules") for r in t]
mj = (f"{1e3 * sum(e) / sum(r['tokens'] for r in t):.2f} mJ/tok"
      if e and None not in e else "no energy")
w = [r["device_wait_seconds"] for r in t if "device_wait_seconds" in r]
wait = f", device wait {1e3 * statistics.median(w):.1f} ms" if w else ""
print(f"{label}: median step {1e3 * med:.1f} ms{wait}, {t[0]['tokens'] / med:.0f} tok/s, {mj}, "
      f"peak {max(r['peak_memory_bytes'] for r in rows) / 2**30:.1f} GiB, "
      f"loss step {rows[-1]['step']} {rows[-1]['loss']}")
print(med, file=open(path + ".median", "w"))
PYEOF
}

read -r -a extra <<<"${VD_EXTRA:-}"
for cell in $CELLS; do
  mapfile -t a < <(cell_args "$cell") || { say "unknown cell $cell"; continue; }
  for r in $(seq 1 "$ROUNDS"); do
    for side in A B; do
      tree=$A
      [ $side = B ] && tree=$B
      dump=$WORK/run.$cell.$side.$r
      rm -rf "$dump"
      with_gpu_log "$OUT/gpu.md" "$cell $side round $r" timeout 300 "$tree/build-gpu/viaduct" train \
        --config "$tree/configs/llama_debug.toml" "${a[@]:1}" --data.path="${a[0]}" \
        --training.dtype=bfloat16 --training.device=cuda --training.steps="$STEPS" \
        --training.eval_interval=0 --training.num_threads="$JOBS" --checkpoint.enable=false \
        --job.dump_folder="$dump" --data.shuffle=false --metrics.log_freq=1 \
        --metrics.progress_bar=false "${extra[@]}" >"$OUT/$cell.$side.$r.log" 2>&1 ||
        { say "$cell $side round $r: FAILED"; grep -v '^frame #' "$OUT/$cell.$side.$r.log" | tail -5; continue; }
      say "$(row "$dump/metrics.jsonl" "$cell $side round $r")"
      say "  $(tail -1 "$OUT/gpu.md")"
    done
    ma=$(cat "$WORK/run.$cell.A.$r/metrics.jsonl.median" 2>/dev/null)
    mb=$(cat "$WORK/run.$cell.B.$r/metrics.jsonl.median" 2>/dev/null)
    [ -n "$ma" ] && [ -n "$mb" ] &&
      say "$cell round $r: B / A step time $("$PY" -c "print(f'{$mb / $ma:.3f}')")"
  done
done
