#!/usr/bin/env bash
# Same bits before and after a change, on the GPU machine: builds each given
# source tree with CUDA (its own build-gpu/, by bench/lib/gpu_build.sh with
# this tree's .deps), trains the same short runs with each (deterministic,
# the default), and compares every step's loss and gradient norm as the
# 9-significant-digit strings metrics.jsonl holds (a float32 round-trips
# through them). Also runs each tree's CUDA kernel suite when GoogleTest's
# sources travel in .deps.
#
#   bash bench/bits/bits_before_after.sh .cache/base.tar .      # trees: before, after
#   CELLS="1B k3" STEPS=5 bash bench/bits/bits_before_after.sh A B
#   VD_EXTRA="--training.deterministic=false" CELLS=1B bash bench/bits/bits_before_after.sh .
#     (more viaduct overrides for every run; one tree: its runs alone)
#   A tree may be a folder or a .tar of one (git archive HEAD), unpacked
#   under $OUT; each is named by its folder's (or the tar's) base name.
#
# Windows are read in file order (--data.shuffle=false) in every tree, so
# trees whose configs differ in data.shuffle compare the same tokens.
# Cells: 1B (llama 1B, 4 x 4096), k3 (kimi_k3 debugmodel_deep at d2048 with
# KDA, MLA and MoE, 4 x 2048), k3gemm (the same with MLA everywhere and dense
# FFNs), gpt2 (124M, 8 x 1024), and on the CPU in fp32: cpu_llama (llama
# debugmodel, 8 x 128), cpu_k3 (kimi_k3 debugmodel, 4 x 64). Output: $OUT/bits.md (key lines also on
# stdout), each run's log and its steps ($OUT/<cell>.<tree>.steps).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source bench/lib/gpu_build.sh
source bench/lib/tokens.sh  # random_tokens
ROOT=$PWD
OUT=${OUT:-$ROOT/outputs/bits}      # logs and the summary
WORK=${WORK:-$ROOT/outputs/bits_work}  # unpacked trees, data, run folders
mkdir -p "$OUT" "$WORK"
PY=${PYTHON:-python3}
CELLS=${CELLS:-1B k3 k3gemm gpt2}
STEPS=${STEPS:-5}
JOBS=${JOBS:-$(nproc)}
T0=$(date +%s)
say() { printf '[%4ds] %s\n' $(($(date +%s) - T0)) "$*" | tee -a "$OUT/bits.md"; }
[ $# -ge 1 ] || { echo "usage: $0 TREE_BEFORE [TREE_AFTER ...]"; exit 2; }

kernel_suite() {  # tree folder -> the name of its CUDA kernel test binary, or nothing
  local name
  for name in test_kernels test_fused_kernels; do
    if grep -qs "viaduct_test($name\b\|add_executable($name\b" "$1/tests/kernels/CMakeLists.txt"; then
      echo "$name"
      return
    fi
  done
}

build_tree() {  # tree -> prints the tree's folder
  local t=$1 dir
  dir=$(realpath "$1")
  if [[ $t == *.tar ]]; then
    dir=$WORK/$(basename "$t" .tar)
    # Unpacked once per tar: a second call reuses the tree and its build.
    if [ ! -f "$dir/.unpacked" ] || [ "$t" -nt "$dir/.unpacked" ]; then
      rm -rf "$dir" && mkdir -p "$dir" && tar -xf "$t" -C "$dir" && touch "$dir/.unpacked" ||
        return 1
    fi
  fi
  local targets=(viaduct_app) suite
  # The CUDA kernel suite under the tree's name for it: test_kernels (one
  # binary for tests/kernels) or, in older trees, test_fused_kernels.
  suite=$(kernel_suite "$dir")
  if gpu_build_has_gtest && [ -n "$suite" ]; then
    targets+=("$suite")
  fi
  gpu_build "$dir" "$dir/build-gpu" "$OUT/build.$(basename "$dir").log" "${targets[@]}" || return 1
  echo "$dir"
}


K3=(--model.family=kimi_k3 --model.flavor=debugmodel_deep --model.dim=2048 --model.n_heads=16
  --model.kda_head_dim=64 --model.mla_kv_lora_rank=512 --model.mla_qk_nope_head_dim=128
  --model.mla_qk_rope_head_dim=64 --model.mla_v_head_dim=128 --model.ffn_hidden_dim=5632
  --model.moe_hidden_dim=512 --training.seq_len=2048 --training.local_batch_size=4
  --optimizer.lr=3e-4)
cell_args() {  # cell -> data file, then overrides, one per line
  case $1 in
    1B) random_tokens "$WORK/v128256.u32" 128256 $(((STEPS + 2) * 4 * 4096 + 1))
        printf '%s\n' "$WORK/v128256.u32" --model.flavor=1B --training.seq_len=4096 \
          --training.local_batch_size=4 --optimizer.lr=3e-4 ;;
    k3) random_tokens "$WORK/v320.u32" 320 $(((STEPS + 2) * 4 * 2048 + 1))
        printf '%s\n' "$WORK/v320.u32" "${K3[@]}" ;;
    k3gemm) random_tokens "$WORK/v320.u32" 320 $(((STEPS + 2) * 4 * 2048 + 1))
        printf '%s\n' "$WORK/v320.u32" "${K3[@]}" --model.mla_interval=1 --model.moe_ffn=false ;;
    cpu_llama) random_tokens "$WORK/v256.u32" 256 $(((STEPS + 2) * 8 * 128 + 1))
        printf '%s\n' "$WORK/v256.u32" --model.flavor=debugmodel --training.seq_len=128 \
          --training.local_batch_size=8 ;;
    cpu_k3) random_tokens "$WORK/v256.u32" 256 $(((STEPS + 2) * 8 * 128 + 1))
        printf '%s\n' "$WORK/v256.u32" --model.family=kimi_k3 --model.flavor=debugmodel \
          --training.seq_len=64 --training.local_batch_size=4 ;;
    gpt2) random_tokens "$WORK/v50257.u32" 50257 $(((STEPS + 2) * 8 * 1024 + 1))
        printf '%s\n' "$WORK/v50257.u32" --model.family=gpt2 --model.flavor=124M \
          --training.seq_len=1024 --training.local_batch_size=8 --optimizer.lr=6e-4 ;;
    *) return 1 ;;
  esac
}

trees=()
for t in "$@"; do
  say "build $t"
  d=$(build_tree "$t") || { say "build of $t FAILED"; exit 1; }
  trees+=("$d")
done
for d in "${trees[@]}"; do
  suite=$(kernel_suite "$d")
  if [ -n "$suite" ] && [ -x "$d/build-gpu/tests/kernels/$suite" ]; then
    # Each tree's whole suite: the suites differ between trees (test_kernels
    # also holds the KDA and MoE kernel tests and the weight cache's), so each
    # is read as passing or not, not compared.
    timeout 300 "$d/build-gpu/tests/kernels/$suite" >"$OUT/kernels.$(basename "$d").log" 2>&1
    say "kernel suite of $(basename "$d"): $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/kernels.$(basename "$d").log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]' "$OUT/kernels.$(basename "$d").log" | head -20 | tee -a "$OUT/bits.md"
  fi
done

# One line per step: "step loss grad_norm"; the tokens/s as well, apart.
summarise() {  # metrics.jsonl
  "$PY" - "$1" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    raw = line
    j = json.loads(line)
    if "loss" not in j:
        continue
    # The strings as written (9 significant digits), not re-printed floats.
    def field(k):
        i = raw.find('"' + k + '":')
        return raw[i + len(k) + 3:].split(",")[0].split("}")[0] if i >= 0 else "-"
    print(j["step"], field("loss"), field("grad_norm"), "tok/s", field("tokens_per_sec"))
EOF
}

read -r -a extra <<<"${VD_EXTRA:-}"  # more viaduct overrides for every run
for cell in $CELLS; do
  mapfile -t a < <(cell_args "$cell") || { say "unknown cell $cell"; continue; }
  data=${a[0]}
  for d in "${trees[@]}"; do
    name=$(basename "$d")
    dump=$WORK/run.$cell.$name
    rm -rf "$dump"
    device=(--training.dtype=bfloat16 --training.device=cuda)
    [[ $cell == cpu_* ]] && device=(--training.dtype=float32 --training.device=cpu)
    timeout 400 "$d/build-gpu/viaduct" train --config "$d/configs/llama_debug.toml" "${a[@]:1}" \
      "${device[@]}" --training.steps="$STEPS" \
      --training.eval_interval=0 --training.num_threads="$JOBS" --checkpoint.enable=false \
      --job.dump_folder="$dump" --data.path="$data" --data.shuffle=false --metrics.log_freq=1 \
      --metrics.progress_bar=false "${extra[@]}" >"$OUT/$cell.$name.log" 2>&1 ||
      { say "$cell $name: FAILED"; grep -v '^frame #' "$OUT/$cell.$name.log" | tail -6; }
    summarise "$dump/metrics.jsonl" >"$OUT/$cell.$name.steps" 2>/dev/null
  done
  first=$(basename "${trees[0]}")
  for d in "${trees[@]:1}"; do
    name=$(basename "$d")
    if [ -s "$OUT/$cell.$first.steps" ] &&
       diff <(cut -d' ' -f1-3 "$OUT/$cell.$first.steps") <(cut -d' ' -f1-3 "$OUT/$cell.$name.steps") >/dev/null; then
      say "$cell: $name has $first's losses and grad norms, bit for bit ($STEPS steps)"
    else
      say "$cell: $name DIFFERS from $first"
    fi
  done
  for d in "${trees[@]}"; do
    say "$cell $(basename "$d"): $(tr '\n' ';' <"$OUT/$cell.$(basename "$d").steps")"
  done
done
