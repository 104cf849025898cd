#!/usr/bin/env bash
# One GPU-machine call for the memory figures: which allocator variable
# LibTorch honours, activation checkpointing at the llama-8B layer shape
# (step time and peak, then the largest batch per mode by runs), and the
# plan's per-rank figure against the measured peak for llama-1B and the K3
# cell at pp 1 with checkpointing off and full. Builds build-gpu/viaduct
# first when there is none (bench/lib/gpu_build.sh).
#
#   bash bench/memory/memory_session.sh
#
# Environment (defaults): OUT (outputs/memory), SECTIONS ("alloc ac plan
# fit"), AC_BATCH (12), AC_MODES ("none selective:op"), FIT_MODES ("none
# selective:op selective:2 full").
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source bench/lib/gpu_build.sh
OUT=${OUT:-$PWD/outputs/memory}
mkdir -p "$OUT"
SECTIONS=${SECTIONS:-alloc ac plan fit}
T0=$(date +%s)
say() { printf '[%4ds] %s\n' $(($(date +%s) - T0)) "$*"; }
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
if [ ! -x build-gpu/viaduct ]; then
  say "build-gpu/viaduct (log: $OUT/build.log)"
  gpu_build . build-gpu "$OUT/build.log" viaduct_app || { say "build failed"; exit 1; }
fi
[ -f data/fortunes.tok ] || build-gpu/viaduct prepare-data --input .snap/fortunes --output data/fortunes.tok >/dev/null

if has alloc; then
  # Which variable turns expandable segments on in this LibTorch, and
  # whether it warns.
  for var in PYTORCH_ALLOC_CONF PYTORCH_CUDA_ALLOC_CONF; do
    env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF "$var=expandable_segments:True" python3 -c '
import torch
torch.zeros(1, device="cuda")
print(torch.cuda.memory._snapshot()["allocator_settings"].get("expandable_segments"))' >"$OUT/alloc_$var.txt" 2>&1
    say "$var=expandable_segments:True -> expandable_segments $(tail -1 "$OUT/alloc_$var.txt"); warnings: $(grep -c -i warn "$OUT/alloc_$var.txt")"
  done
fi
if has ac; then
  say "activation checkpointing, ${AC_BATCH:-12} x 8192"
  BATCH=${AC_BATCH:-12} STEPS=3 MAXBATCH=0 MODES="${AC_MODES:-none selective:op}" \
    EXTRA=--lr_scheduler.warmup_steps=1 OUT="$OUT/ac" bash bench/memory/ac_memory.sh | tee "$OUT/ac.md"
fi
if has plan; then
  python3 - <<'PY'
import array, os, random
for path, vocab, n in (("outputs/memory/v128256.u32", 128256, 10 * 4 * 4096 + 1),
                       ("outputs/memory/v320.u32", 320, 10 * 4 * 2048 + 1)):
    if os.path.exists(path): continue
    os.makedirs(os.path.dirname(path), exist_ok=True)
    r = random.Random(1234)
    open(path, "wb").write(array.array("I", (r.randrange(vocab) for _ in range(n))).tobytes())
PY
  say "plan against peak: llama-1B 4 x 4096"
  MODEL="--model.family=llama --model.flavor=1B" SEQ=4096 BATCH=4 STEPS=3 MAXBATCH=0 \
    MODES="none full" DATA=outputs/memory/v128256.u32 OUT="$OUT/plan1B" bash bench/memory/ac_memory.sh | tee "$OUT/plan1B.md"
  say "plan against peak: kimi_k3 deep d2048 4 x 2048"
  MODEL="--model.family=kimi_k3 --model.flavor=debugmodel_deep --model.dim=2048 --model.n_heads=16 --model.kda_head_dim=64 --model.mla_kv_lora_rank=512 --model.mla_qk_nope_head_dim=128 --model.mla_qk_rope_head_dim=64 --model.mla_v_head_dim=128 --model.ffn_hidden_dim=5632 --model.moe_hidden_dim=512 --model.kda_chunk_size=64" \
    SEQ=2048 BATCH=4 STEPS=3 MAXBATCH=0 MODES="none full" DATA=outputs/memory/v320.u32 \
    OUT="$OUT/planK3" bash bench/memory/ac_memory.sh | tee "$OUT/planK3.md"
fi
if has fit; then
  say "largest batch per mode, by runs"
  TABLE=0 STEPS=2 MODES="${FIT_MODES:-none selective:op selective:2 full}" OUT="$OUT/fit" \
    RUN_TIMEOUT=120 bash bench/memory/ac_memory.sh | tee "$OUT/fit.md"
fi
say "done"
