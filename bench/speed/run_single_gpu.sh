#!/usr/bin/env bash
# Issue 7's side-by-side benchmark in one GPU-machine call: builds viaduct
# with CUDA, then for each cell trains viaduct from its initial weights
# (saved as step-0 by checkpoint.save_initial) and the PyTorch reference
# (reference/torch_llama.py, models in reference/torch_models.py) from that same
# step-0 on the same data, eager and under torch.compile, and writes one
# markdown table to $OUT/results.md, with the AttnRes overhead (median step
# time of k3 / k3plain - 1, viaduct's own metrics) when both K3 cells ran.
#
#   bash bench/speed/run_single_gpu.sh                 # build + every cell
#   STAGES=build bash bench/speed/run_single_gpu.sh    # build only (a first call)
#   CELLS="debug 1B" MODES=eager ...             # choose cells / peer modes
#
# Environment (defaults): OUT (outputs/bench/out), CELLS ("1B gpt2 k3
# k3plain"; also: debug, and k3gemm / k3gemmplain: the K3 pair with MLA
# everywhere and dense FFNs, for a GEMM-bound AttnRes A/B; k3gemmab: that
# pair K3_ROUNDS (3) times in alternating processes, viaduct only, the
# overhead pooled over the rounds; 1Bab: the 1B cell ROUNDS_1B (2) times,
# viaduct then torch.compile, their step-time ratio pooled and per round;
# 1Bdocs / k3docs: block_causal's cost, the 1B or K3 cell DOC_ROUNDS (2)
# times, causal then block_causal, viaduct only, on random tokens packed as
# documents of lengths drawn from an exponential law of mean DOC_MEAN
# (1024) behind a start marker (token 0)), K3_BATCH x K3_SEQ (4 x 2048: the K3 cells' shape),
# MODES ("eager compile"; empty: viaduct only, no step-0 checkpoint), COMPILE_MODE (default; or
# max-autotune-no-cudagraphs), WARMUP_STEPS (3) untimed + TIMED_STEPS (10)
# timed steps, STAGES ("build run"), PYTHON (python3), JOBS (nproc),
# CELL_TIMEOUT (300 s per process), VD_EXTRA (more viaduct overrides, last
# wins), PEER_ANCHOR (a copy of ../shared/anchors/kda: the K3 reference then
# runs KDA through fla's chunk_kda and the MoE experts through
# torch._grouped_mm, the strongest PyTorch peer; see reference/torch_models.py). Logs of every process are in $OUT.
set -uo pipefail  # no -e: a failed cell must not cost the other rows
cd "$(dirname "$0")/../.." || exit 1
source bench/lib/gpu_build.sh
source bench/lib/tokens.sh  # random_tokens, document_tokens
source bench/lib/gpu_log.sh  # with_gpu_log: clocks and power beside each run, in $OUT/gpu.md

OUT=${OUT:-$PWD/outputs/bench/out}
mkdir -p "$OUT"
WORK=outputs/bench
PY=${PYTHON:-python3}
WARM=${WARMUP_STEPS:-3}
TIMED=${TIMED_STEPS:-10}
STEPS=$((WARM + TIMED))
CELLS=${CELLS:-1B gpt2 k3 k3plain}
K3_BATCH=${K3_BATCH:-4}
K3_SEQ=${K3_SEQ:-2048}
K3_ROUNDS=${K3_ROUNDS:-3}
MODES=${MODES-eager compile}  # set and empty: viaduct only
COMPILE_MODE=${COMPILE_MODE:-default}
STAGES=${STAGES:-build run}
JOBS=${JOBS:-$(nproc)}
CELL_TIMEOUT=${CELL_TIMEOUT:-300}
RESULTS=$OUT/results.md
if [ -n "${PEER_ANCHOR:-}" ]; then
  export VIADUCT_PEER_ANCHOR
  VIADUCT_PEER_ANCHOR=$(realpath "$PEER_ANCHOR")
fi
T0=$(date +%s)
say() { printf '[%4ds] %s\n' $(($(date +%s) - T0)) "$*"; }

# build-gpu/ with CUDA (bench/lib/gpu_build.sh): viaduct, layer_bench, and the
# CUDA kernel tests and test_core (the energy meter) when GoogleTest's sources travel in .deps.
build_viaduct() {
  local targets=(viaduct_app layer_bench)
  gpu_build_has_gtest && targets+=(test_kernels test_core)
  gpu_build . build-gpu "$OUT/build.log" "${targets[@]}" || { say "build: failed"; return 1; }
  say "build: build-gpu/viaduct ready"
}



# One cell: viaduct, then the reference in each mode, then its table rows.
run_cell() {  # name label data viaduct-overrides...
  local name=$1 label=$2 data=$3
  shift 3
  local dir=$WORK/$name
  local ck=$dir/viaduct/checkpoint
  rm -rf "$dir"
  mkdir -p "$dir"
  say "$name: viaduct, $STEPS steps"
  # The step-0 checkpoint is the peers' starting point; without peers
  # (MODES empty) none is written: a K3 d2048 one costs a minute a process.
  local ck_args=(--checkpoint.enable=true --checkpoint.save_initial=true
    --checkpoint.interval=1000000 --checkpoint.keep_latest_k=0)
  [ -n "${MODES// /}" ] || ck_args=(--checkpoint.enable=false)
  local vd_cmd=(build-gpu/viaduct train --config configs/llama_debug.toml "$@"
    --training.dtype=bfloat16 --training.device=cuda --training.steps="$STEPS"
    --training.eval_interval=0 --training.num_threads="$JOBS"
    --training.deterministic=false "${ck_args[@]}"
    --job.dump_folder="$dir/viaduct" --data.path="$data" --metrics.log_freq=1
    --metrics.progress_bar=false)
  local extra=()
  read -r -a extra <<<"${VD_EXTRA:-}"
  vd_cmd+=("${extra[@]}")
  echo "${vd_cmd[*]}" >"$OUT/$name.viaduct.cmd"
  with_gpu_log "$OUT/gpu.md" "$name viaduct" timeout "$CELL_TIMEOUT" "${vd_cmd[@]}" >"$OUT/$name.viaduct.log" 2>&1 ||
    { say "$name: viaduct failed"; grep -v '^frame #' "$OUT/$name.viaduct.log" | tail -8; }
  cp "$dir/viaduct/metrics.jsonl" "$OUT/$name.viaduct.metrics.jsonl" 2>/dev/null
  rm -rf "$ck/step-$STEPS"  # the final save: only step-0 is needed (disk)
  local peers=()
  if [ -f "$ck/step-0/metadata.json" ]; then
    for mode in $MODES; do
      say "$name: torch $mode"
      local json=$OUT/$name.torch-$mode.json
      rm -f "$json"
      with_gpu_log "$OUT/gpu.md" "$name torch-$mode" timeout "$CELL_TIMEOUT" "$PY" reference/torch_llama.py \
        --checkpoint "$ck/step-0" \
        --mode "$mode" --compile-mode "$COMPILE_MODE" --timing-warmup "$WARM" \
        --label "$label" --json "$json" >"$OUT/$name.torch-$mode.log" 2>&1 ||
        { say "$name: torch $mode failed"; tail -4 "$OUT/$name.torch-$mode.log"; }
      peers+=(--peer "$json")
    done
  elif [ -n "${MODES// /}" ]; then
    say "$name: no $ck/step-0 (checkpoint.save_initial?): no reference runs"
  fi
  if [ ${#peers[@]} -eq 0 ] && [ ! -f "$ck/step-0/metadata.json" ]; then
    # Viaduct alone: its row from its own metrics (no reference to compare).
    "$PY" - "$OUT/$name.viaduct.metrics.jsonl" "$label" "$WARM" >>"$OUT/table.md" <<'PYEOF' ||
import json, statistics, sys
path, label, warm = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.loads(l) for l in open(path)]
rows = [r for r in rows if "loss" in r and "tokens_per_sec" in r]
timed = rows[warm:]
secs = statistics.median(r["step_seconds"] for r in timed)
tps = statistics.median(r["tokens_per_sec"] for r in timed)
mfu = statistics.median(r.get("mfu") or 0.0 for r in timed)
peak = max(r.get("peak_memory_bytes") or 0 for r in rows) / 2**30
losses = " ".join(f"{r['loss']:.4f}" for r in rows[:5])
# Energy per token over the timed steps (their energies telescope).
joules = [r.get("energy_joules") for r in timed]
mj = (f"{1e3 * sum(joules) / sum(r['tokens'] for r in timed):.2f}"
      if joules and None not in joules else "n/a")
print(f"| {label} | viaduct (median step {secs * 1e3:.1f} ms) | {tps:.0f} | {100 * mfu:.1f}% "
      f"| {peak:.1f} | {mj} | {losses} | | |")
PYEOF
      echo "| $label | viaduct (no metrics, see $name.viaduct.log) | | | | | | | |" >>"$OUT/table.md"
    return 0
  fi
  "$PY" reference/torch_llama.py report --cell "$label" --timing-warmup "$WARM" \
    --viaduct-metrics "$dir/viaduct/metrics.jsonl" "${peers[@]}" \
    --checkpoint "$ck/step-0" --steps-out "$OUT/steps.md" >>"$OUT/table.md" 2>>"$OUT/report.log" ||
    echo "| $label | (report failed, see report.log) | | | | | | | |" >>"$OUT/table.md"
  rm -rf "$ck"  # step-0 of a 1B model is 18 GB
}

if [[ " $STAGES " == *" build "* ]]; then
  say "build (log: $OUT/build.log)"
  build_viaduct || exit 1
fi
[[ " $STAGES " == *" run "* ]] || exit 0
[ -x build-gpu/viaduct ] || { say "no build-gpu/viaduct: run with STAGES=build first"; exit 1; }

rm -f "$OUT/table.md" "$OUT/steps.md" "$OUT/gpu.md"
# The K3 cells' model: kimi_k3 debugmodel_deep (33 layers, AttnRes blocks
# 12 + 12 + 9, MLA at 3, 7, ..., 31, 32, MoE from layer 1) widened to dim
# 2048 with inner widths to match: 16 heads, KDA head 64, MLA 512 / 128 +
# 64 / 128, dense FFN 5632, 8 experts (top 2 + 1 shared) of 512.
# Vocabulary 320 (the flavor's).
k3=(--model.family=kimi_k3 --model.flavor=debugmodel_deep --model.dim=2048
  --model.n_heads=16 --model.kda_head_dim=64 --model.mla_kv_lora_rank=512
  --model.mla_qk_nope_head_dim=128 --model.mla_qk_rope_head_dim=64
  --model.mla_v_head_dim=128 --model.ffn_hidden_dim=5632
  --model.moe_hidden_dim=512 --model.kda_chunk_size=64 --training.seq_len="$K3_SEQ"
  --model.max_seq_len="$((K3_SEQ > 2048 ? K3_SEQ : 2048))"
  --training.local_batch_size="$K3_BATCH" --optimizer.lr=3e-4)
for cell in $CELLS; do
  case $cell in
    1B)
      data=$WORK/random_v128256.u32
      random_tokens "$data" 128256 $(((STEPS + 4) * 4 * 4096 + 1))
      run_cell 1B "llama 1B, 4x4096" "$data" --model.flavor=1B \
        --training.seq_len=4096 --training.local_batch_size=4 --optimizer.lr=3e-4
      ;;
    # The 1B cell ROUNDS_1B (2) times, viaduct then torch.compile in each
    # round (no eager), each pair's ratio and the pooled one below.
    1Bab)
      data=$WORK/random_v128256.u32
      random_tokens "$data" 128256 $(((STEPS + 4) * 4 * 4096 + 1))
      saved_modes=$MODES
      MODES=compile
      for r in $(seq 1 "${ROUNDS_1B:-2}"); do
        run_cell "1B_r$r" "llama 1B, 4x4096, round $r" "$data" --model.flavor=1B \
          --training.seq_len=4096 --training.local_batch_size=4 --optimizer.lr=3e-4
      done
      MODES=$saved_modes
      ;;
    # block_causal's cost: causal then block_causal on the same documents,
    # DOC_ROUNDS times, viaduct only.
    1Bdocs | k3docs)
      saved_modes=$MODES
      MODES=""
      if [ "$cell" = 1Bdocs ]; then
        data=$WORK/docs_v128256_m${DOC_MEAN:-1024}.tok
        document_tokens "$data" 128256 $(((STEPS + 4) * 4 * 4096 + 1)) "${DOC_MEAN:-1024}"
        args=(--model.flavor=1B --training.seq_len=4096 --training.local_batch_size=4
          --optimizer.lr=3e-4)
        label="llama 1B, 4x4096"
      else
        data=$WORK/docs_v320_m${DOC_MEAN:-1024}.tok
        document_tokens "$data" 320 $(((STEPS + 4) * K3_BATCH * K3_SEQ + 1)) "${DOC_MEAN:-1024}"
        args=("${k3[@]}")
        label="kimi_k3 deep d2048, ${K3_BATCH}x${K3_SEQ}"
      fi
      for r in $(seq 1 "${DOC_ROUNDS:-2}"); do
        for mask in causal block_causal; do
          run_cell "${cell}_${mask}_r$r" "$label, documents of mean ${DOC_MEAN:-1024}, $mask, round $r" \
            "$data" "${args[@]}" --model.attn_mask_type=$mask
        done
      done
      MODES=$saved_modes
      ;;
    gpt2)
      data=$WORK/random_v50257.u32
      random_tokens "$data" 50257 $(((STEPS + 4) * 8 * 1024 + 1))
      run_cell gpt2 "gpt2 124M, 8x1024" "$data" --model.family=gpt2 \
        --model.flavor=124M --training.seq_len=1024 --training.local_batch_size=8 \
        --optimizer.lr=6e-4
      ;;
    k3 | k3plain | k3gemm | k3gemmplain | k3gemmab)
      # The K3 cells (the model: k3 above); k3plain: model.attn_res = false.
      data=$WORK/random_v320.u32
      random_tokens "$data" 320 $(((STEPS + 4) * K3_BATCH * K3_SEQ + 1))
      case $cell in
        k3) run_cell k3 "kimi_k3 deep d2048, ${K3_BATCH}x${K3_SEQ}" "$data" "${k3[@]}" ;;
        k3plain)
          run_cell k3plain "kimi_k3 deep d2048 no AttnRes, ${K3_BATCH}x${K3_SEQ}" "$data" \
            "${k3[@]}" --model.attn_res=false ;;
        # The same without KDA and MoE (MLA everywhere, dense FFNs): a
        # GEMM-bound step whose time does not hang on routing or on KDA's
        # chunk loop, so the pair's difference is the reads'.
        k3gemm)
          run_cell k3gemm "kimi_k3 deep d2048 MLA+dense, ${K3_BATCH}x${K3_SEQ}" "$data" \
            "${k3[@]}" --model.mla_interval=1 --model.moe_ffn=false ;;
        k3gemmplain)
          run_cell k3gemmplain "kimi_k3 deep d2048 MLA+dense no AttnRes, ${K3_BATCH}x${K3_SEQ}" \
            "$data" "${k3[@]}" --model.mla_interval=1 --model.moe_ffn=false \
            --model.attn_res=false ;;
        # The pair K3_ROUNDS times, alternating processes (viaduct only):
        # the overhead from all their timed steps pooled, and per pair.
        k3gemmab)
          saved_modes=$MODES
          MODES=""
          for r in $(seq 1 "$K3_ROUNDS"); do
            run_cell "k3gemm_r$r" "kimi_k3 deep d2048 MLA+dense, ${K3_BATCH}x${K3_SEQ}, round $r" \
              "$data" "${k3[@]}" --model.mla_interval=1 --model.moe_ffn=false
            run_cell "k3gemmplain_r$r" \
              "kimi_k3 deep d2048 MLA+dense no AttnRes, ${K3_BATCH}x${K3_SEQ}, round $r" \
              "$data" "${k3[@]}" --model.mla_interval=1 --model.moe_ffn=false \
              --model.attn_res=false
          done
          MODES=$saved_modes ;;
      esac
      ;;
    debug)
      if [ -f data/fortunes.tok ]; then
        run_cell debug "llama debugmodel, 8x512, fortunes" data/fortunes.tok \
          --model.flavor=debugmodel --training.seq_len=512 \
          --training.local_batch_size=8
      else
        say "debug: data/fortunes.tok not carried: skipped"
      fi
      ;;
    *) say "unknown cell '$cell' (1B, 1Bab, 1Bdocs, gpt2, k3, k3plain, k3gemm, k3gemmplain, k3gemmab, k3docs, debug)" ;;
  esac
done

# One cell against another over alternating rounds: the step time of the
# first / the second - 1, pooled over the rounds and per round. The files
# are under $OUT, @ standing for the round's number.
pooled_overhead() {  # name rounds with-file without-file
  local name=$1 rounds=$2 with=$3 without=$4 r ab=()
  for r in $(seq 1 "$rounds"); do
    ab+=(--with "$OUT/${with//@/$r}" --without "$OUT/${without//@/$r}")
  done
  echo
  "$PY" reference/torch_llama.py overhead --timing-warmup "$WARM" --name "$name" "${ab[@]}"
}

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
torch_v=$("$PY" -c 'import torch;print(torch.__version__)' 2>/dev/null)
{
  echo "$(date -u +%Y-%m-%d) · ${gpu:-unknown GPU} · torch ${torch_v:-?} · $WARM untimed + $TIMED timed steps, median step time · MFU = FLOPs/token (viaduct describe's formula per family; llama/gpt2: 6 x matmul params incl. head + 12 L D T) x tok/s / 989.4e12 · compile mode $COMPILE_MODE"
  echo
  echo "| cell | impl | tok/s | MFU | peak GiB | mJ/tok | loss steps 1-5 | rel Δloss vs viaduct: step 1 / max 1-5 | viaduct ÷ this: tok/s, mem, energy |"
  echo "|---|---|---|---|---|---|---|---|---|"
  cat "$OUT/table.md" 2>/dev/null
  if [ -s "$OUT/steps.md" ]; then
    echo
    echo "Timed steps, each process (median alone hides a bimodal run):"
    echo
    cat "$OUT/steps.md"
  fi
  if [ -s "$OUT/gpu.md" ]; then
    echo
    echo "GPU 0 while each process ran (nvidia-smi every 200 ms; a clock or power cap that differs between the processes is a confound):"
    echo
    cat "$OUT/gpu.md"
  fi
  if [ -f "$OUT/k3.viaduct.metrics.jsonl" ] && [ -f "$OUT/k3plain.viaduct.metrics.jsonl" ]; then
    echo
    "$PY" reference/torch_llama.py overhead --timing-warmup "$WARM" \
      --name "AttnRes overhead (viaduct, kimi_k3 deep d2048 ${K3_BATCH}x${K3_SEQ}: step time k3 / k3plain - 1)" \
      --with "$OUT/k3.viaduct.metrics.jsonl" --without "$OUT/k3plain.viaduct.metrics.jsonl"
  fi
  if [ -f "$OUT/1B_r1.viaduct.metrics.jsonl" ]; then
    pooled_overhead "viaduct against torch.compile (llama 1B 4x4096, ${ROUNDS_1B:-2} rounds, viaduct then compile: step time viaduct / compile - 1, below 0 is faster)" \
      "${ROUNDS_1B:-2}" "1B_r@.viaduct.metrics.jsonl" "1B_r@.torch-compile.json"
  fi
  if [ -f "$OUT/k3gemm_r1.viaduct.metrics.jsonl" ]; then
    pooled_overhead "AttnRes overhead (viaduct, kimi_k3 deep d2048 MLA+dense ${K3_BATCH}x${K3_SEQ}, $K3_ROUNDS alternating rounds: step time k3gemm / k3gemmplain - 1)" \
      "$K3_ROUNDS" "k3gemm_r@.viaduct.metrics.jsonl" "k3gemmplain_r@.viaduct.metrics.jsonl"
  fi
  if [ -f "$OUT/k3gemm.viaduct.metrics.jsonl" ] && [ -f "$OUT/k3gemmplain.viaduct.metrics.jsonl" ]; then
    echo
    "$PY" reference/torch_llama.py overhead --timing-warmup "$WARM" \
      --name "AttnRes overhead (viaduct, kimi_k3 deep d2048 MLA+dense ${K3_BATCH}x${K3_SEQ}: step time k3gemm / k3gemmplain - 1)" \
      --with "$OUT/k3gemm.viaduct.metrics.jsonl" --without "$OUT/k3gemmplain.viaduct.metrics.jsonl"
  fi
  for cell in 1Bdocs k3docs; do
    # This run's cells only: an earlier run's files may share $OUT.
    [[ " $CELLS " == *" $cell "* ]] || continue
    [ -f "$OUT/${cell}_causal_r1.viaduct.metrics.jsonl" ] || continue
    pooled_overhead "block_causal's cost ($cell, documents of mean ${DOC_MEAN:-1024}, ${DOC_ROUNDS:-2} rounds: step time block_causal / causal - 1)" \
      "${DOC_ROUNDS:-2}" "${cell}_block_causal_r@.viaduct.metrics.jsonl" "${cell}_causal_r@.viaduct.metrics.jsonl"
  done
} >"$RESULTS"
say "done; per-process logs and JSON in $OUT"
cat "$RESULTS"
