#!/usr/bin/env bash
# A GPU-machine call's worth of work, the parts in the order PARTS names them, within a time
# budget: each part is skipped (and says so) when the time it needs is not
# left. Everything lands in one file, $OUT/summary.md (the device tool brings
# back few files), and its key lines go to stdout.
#
#   PARTS="build tests profile k3profile offload" bash bench/speed/gpu_session.sh
#   PARTS="sbs" CELLS="1B gpt2" bash bench/speed/gpu_session.sh     # a second call
#
# Parts (estimated seconds on an H200): build (90: bench/lib/gpu_build.sh),
# tests (15: the CUDA kernel suite), probe (60: short llama-1B and K3 runs
# that report a failing step), profile (70: llama-1B step,
# bench/speed/profile_step.sh), k3profile (110: the kimi_k3 d2048 step of
# bench/speed/run_single_gpu.sh), offload (150:
# bench/gpu_checks/gpu_checks.sh section 3), sbs (240 per llama cell: the
# side-by-side of bench/speed/run_single_gpu.sh for CELLS), readnorm (200:
# the read with its norm: layer_bench's read+norm rows (two ops and fused),
# the K3 A/B as built (K3_ROUNDS pairs, default 2)), k3gemmprofile (60: the
# k3gemm cell's step, MLA everywhere and dense FFNs, where the AttnRes reads
# are the difference from plain residuals), sbs1Bab (330: viaduct then
# torch.compile twice on the 1B; VD_EXTRA applies), doctests (20:
# block_causal's CUDA paths against each document alone, from
# test_kernels), kdadocs (120: KDA over packed documents against fla's
# chunk_kda with cu_seqlens, bench/layers/kda_session.sh's docs section,
# ANCHOR a copy of ../shared/anchors/kda; then layer_bench --doc-mean 1024
# for the attention and KDA layers), doccost (120 a cell and round of DOC_ROUNDS: block_causal's cost,
# run_single_gpu.sh's DOC_CELLS, default "1Bdocs k3docs"), fashion (420:
# scripts/fashion_mnist.sh on the GPU, FASHION_STEPS (3000) steps of 64,
# with FASHION_MNIST the folder of the four .gz files carried, then
# bench/data_prepare_images.sh), graphs (420: training.cuda_graphs: the
# StepGraph tests of test_train (a graph step's bits against eager steps),
# then GRAPH_CELLS (default "1B k3") with the key off and on, alternating,
# GRAPH_ROUNDS rounds (default 2), losses and tokens/s side by side),
# gpt2profile (60: the gpt2 cell's step with host ops, then device kernels
# only), k3docsprofile (180: the K3 step on documents of mean 1,024,
# causal then block_causal, device kernels only), k3peer (330: the K3 cell
# against the compiled PyTorch + fla peer, ANCHOR the fla copy), gpt2pairs
# (45 a pair: gpt2 against torch.compile GPT2_PAIRS (3) times).
# BUDGET_S (560): the call's limit less a
# margin. Needs .deps and data carried (bench/README.md).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source bench/lib/gpu_build.sh
source bench/lib/tokens.sh  # document_tokens
OUT=${OUT:-$PWD/outputs/bench/session}
mkdir -p "$OUT"
SUM=$OUT/summary.md
PARTS=${PARTS:-build tests profile k3profile offload}
B=${BUILD:-build-gpu}  # the CUDA build (the build part makes it)
BUDGET_S=${BUDGET_S:-560}
T0=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - T0))); }
note() { echo "$*" | tee -a "$SUM"; }
want() {  # part estimate
  if [ "$(left)" -lt "$2" ]; then
    note "## $1: skipped ($(left) s left, needs ~$2 s)"
    return 1
  fi
  note "## $1 (at $(($(date +%s) - T0)) s)"
}
: >"$SUM"
FAILURES=""  # the parts that failed, for the exit status

part_build() {
  # run_single_gpu.sh's targets (bench/lib/gpu_build.sh); a failed build is
  # reported and the parts that find their binaries still run.
  targets=(viaduct_app layer_bench kda_documents_bench)
  gpu_build_has_gtest && targets+=(test_kernels)
  if gpu_build . "$B" /tmp/vs_build.log "${targets[@]}" 2>&1 | tee -a "$SUM"; then
    note "build: $B ready"
  else
    note "build failed (log: /tmp/vs_build.log)"
    FAILURES="$FAILURES build"
  fi
}
part_tests() {
  # The whole suite in one process; a test that kills the process (an
  # illegal address poisons the CUDA context) is named and the run repeats
  # without it, up to 6 times, so one crash hides no other failure.
  if [ ! -x "$B/tests/kernels/test_kernels" ]; then
    note "no $B/tests/kernels/test_kernels (GoogleTest not carried in .deps?)"
    return
  fi
  local skip="" crashed="" round
  : >/tmp/vs_tests_all.txt
  for round in 1 2 3 4 5 6; do
    timeout 120 "$B/tests/kernels/test_kernels" ${skip:+--gtest_filter="-${skip#:}"} \
      >/tmp/vs_tests.txt 2>&1
    cat /tmp/vs_tests.txt >>/tmp/vs_tests_all.txt
    grep -qE "^\[==========\] [0-9]+ tests? from .* ran" /tmp/vs_tests.txt && break
    # The process ended inside a test: the last one started is the culprit.
    local last
    last=$(grep -E "^\[ RUN      \] " /tmp/vs_tests.txt | tail -1 | awk '{print $4}')
    [ -n "$last" ] || { note "test_kernels ended before any test:"; tail -5 /tmp/vs_tests.txt | tee -a "$SUM"; break; }
    note "test_kernels died in $last:"
    grep -v '^frame #' /tmp/vs_tests.txt | tail -4 | tee -a "$SUM"
    crashed="$crashed $last"
    skip="$skip:$last"
  done
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED|^\[  SKIPPED|Failure|Expected|Which is|seed" \
    /tmp/vs_tests_all.txt | head -40 | tee -a "$SUM"
  # A failing kernel test is reported; every kernel path has one form,
  # so the call goes on with what is built.
  local failed
  failed=$(grep -E "^\[  FAILED  \] [A-Za-z]" /tmp/vs_tests_all.txt | awk '{print $4}' | sort -u | tr '\n' ' ')
  if [ -n "$failed$crashed" ]; then
    note "kernel tests failed: $failed${crashed:+ crashed:$crashed}"
    FAILURES="$FAILURES tests"
  fi
}
# probe: short runs of the llama-1B and the K3 (section 3's) shapes; a run
# that fails prints its error.
probe_run() {  # name args...
  local name=$1; shift
  local log=/tmp/vs_probe_$name.log
  local extra=()
  read -r -a extra <<<"${VD_EXTRA:-}"
  timeout 150 "$B/viaduct" train "$@" "${extra[@]}" >"$log" 2>&1 && {
    note "$name: ok ($(grep -E '^step +[0-9]+ \|' "$log" | tail -1 | cut -c1-110))"; return 0; }
  note "$name failed:"
  grep -v '^frame #' "$log" | grep -v '^$' | tail -8 | tee -a "$SUM"
  return 1
}
part_probe() {
  df -h . /tmp | tail -2 | tee -a "$SUM"
  mkdir -p outputs/bench
  python3 -c "
import array,random
r=random.Random(1);a=array.array('I',(r.randrange(128256) for _ in range(8*4*4096+1)))
open('outputs/bench/probe_v128256.u32','wb').write(a.tobytes())"
  probe_run llama1B --config configs/llama_debug.toml --model.flavor=1B --training.seq_len=4096 \
    --training.local_batch_size=4 --training.dtype=bfloat16 --training.device=cuda \
    --training.steps=3 --training.eval_interval=0 --checkpoint.enable=false \
    --training.deterministic=false --metrics.progress_bar=false --metrics.log_freq=1 \
    --data.path=outputs/bench/probe_v128256.u32 --job.dump_folder=/tmp/vs_probe_1B
  probe_run k3 --config configs/kimi_k3_debug.toml --model.flavor=debugmodel_deep \
    --model.dim=2048 --model.attn_res_block_size=3 --model.mla_interval=1 \
    --training.seq_len=2048 --training.local_batch_size=8 --training.dtype=bfloat16 \
    --training.device=cuda --training.steps=2 --training.eval_interval=0 \
    --checkpoint.enable=false --training.deterministic=false --metrics.progress_bar=false \
    --metrics.log_freq=1 --parallelism.pipeline_parallel_stages_per_rank=4 \
    --parallelism.pipeline_parallel_schedule=Interleaved1F1B \
    --parallelism.pipeline_parallel_microbatches=8 --job.dump_folder=/tmp/vs_probe_k3
}
part_sbs() {
  OUT=/tmp/vs_sbs CELLS=${CELLS:-1B} bash bench/speed/run_single_gpu.sh >/tmp/vs_sbs.txt 2>&1
  cat /tmp/vs_sbs.txt >>"$SUM"
  grep -E "^\|" /tmp/vs_sbs.txt
}
# The K3 cell against the compiled PyTorch + fla peer (fla's chunk_kda,
# torch._grouped_mm) in one call: compile only, since the eager peer's 85.6
# GiB does not fit an H100; fla's Triton compile and torch.compile take
# ~215-335 s of the part.
part_k3peer() {
  OUT=/tmp/vs_k3peer STAGES=run CELLS=k3 MODES=compile PEER_ANCHOR=$ANCHOR CELL_TIMEOUT=500 \
    bash bench/speed/run_single_gpu.sh >/tmp/vs_k3peer.txt 2>&1
  cat /tmp/vs_k3peer.txt >>"$SUM"
  grep -E "^\||^- kimi" /tmp/vs_k3peer.txt
}
# gpt2 against torch.compile GPT2_PAIRS (3) times, one process each, viaduct
# first in each pair (a pair is ~40 s on a warm build).
part_gpt2pairs() {
  for r in $(seq 1 "${GPT2_PAIRS:-3}"); do
    OUT=/tmp/vs_g2p$r STAGES=run CELLS=gpt2 MODES=compile bash bench/speed/run_single_gpu.sh \
      >/tmp/vs_g2p$r.txt 2>&1
    cat /tmp/vs_g2p$r.txt >>"$SUM"
    grep -E "^\| gpt2|^- gpt2 124M" /tmp/vs_g2p$r.txt
  done
}
part_readnorm() {
  for k in 1 2 3; do
    timeout 60 "$B/bench/layer_bench" --only "read+norm" --tokens 8192 --dim 2048 --blocks "$k" \
      --iters 20 2>&1 | grep -E "^\| attn|rror" | tee -a "$SUM"
  done
  OUT=/tmp/vs_rn STAGES=run CELLS=k3gemmab K3_ROUNDS=${K3_ROUNDS:-2} MODES=" " CELL_TIMEOUT=120 \
    bash bench/speed/run_single_gpu.sh >/tmp/vs_rn.txt 2>&1
  grep -E "overhead" /tmp/vs_rn.txt | tee -a "$SUM"
  python3 - /tmp/vs_rn/k3gemm_r1.viaduct.metrics.jsonl /tmp/vs_rn/k3gemm_r2.viaduct.metrics.jsonl \
    <<'PYEOF' | tee -a "$SUM"
import json, statistics, sys
for f in sys.argv[1:]:
    try:
        rows = [json.loads(l) for l in open(f) if '"loss"' in l]
    except OSError:
        print(f, "missing")
        continue
    t = [r["step_seconds"] * 1e3 for r in rows[3:]]
    print(f, "median %.1f ms, peak %.2f GiB, losses" % (statistics.median(t),
          max(r["peak_memory_bytes"] for r in rows) / 2**30),
          " ".join("%.5f" % r["loss"] for r in rows[:5]))
PYEOF
}
part_sbs1Bab() {
  OUT=/tmp/vs_1Bab CELLS=1Bab STAGES=run bash bench/speed/run_single_gpu.sh >/tmp/vs_1Bab.txt 2>&1
  cat /tmp/vs_1Bab.txt >>"$SUM"
  grep -E "^\||against torch.compile" /tmp/vs_1Bab.txt
}
part_profile() {
  OUT=/tmp/vs_prof TOP=${TOP:-25} bash bench/speed/profile_step.sh "$B" "" >/tmp/vs_prof.txt 2>&1
  cat /tmp/vs_prof.txt >>"$SUM"
  grep -E "^step |^step wall|^device idle" /tmp/vs_prof.txt
}
part_k3profile() {
  OUT=/tmp/vs_k3 MODEL=k3 TOP=${TOP:-25} bash bench/speed/profile_step.sh "$B" "" \
    >/tmp/vs_k3.txt 2>&1
  cat /tmp/vs_k3.txt >>"$SUM"
  grep -E "^step |^step wall|^device idle|attn_res|AttnRes" /tmp/vs_k3.txt
}
# The K3 step's profile under block_causal beside causal (documents of
# mean 1,024 behind a start marker, as the k3docs cell), device kernels only.
part_k3docsprofile() {
  document_tokens /tmp/vs_k3docs.tok 320 $(((4 + 4) * 4 * 2048 + 1)) 1024
  OUT=/tmp/vs_k3d MODEL=k3 TOP=${TOP:-25} DATA=/tmp/vs_k3docs.tok bash bench/speed/profile_step.sh \
    "$B" "--metrics.profile_host_ops=false" \
    "--metrics.profile_host_ops=false --model.attn_mask_type=block_causal" >/tmp/vs_k3d.txt 2>&1
  cat /tmp/vs_k3d.txt >>"$SUM"
  grep -E "^== |^step |^step wall|^device idle" /tmp/vs_k3d.txt
}
part_gpt2profile() {
  OUT=/tmp/vs_g2 MODEL=gpt2 TOP=${TOP:-25} bash bench/speed/profile_step.sh "$B" "" \
    "--metrics.profile_host_ops=false" >/tmp/vs_g2.txt 2>&1
  cat /tmp/vs_g2.txt >>"$SUM"
  grep -E "^== |^step |^step wall|^device idle" /tmp/vs_g2.txt
}
part_k3gemmprofile() {
  OUT=/tmp/vs_k3g MODEL=k3 TOP=${TOP:-25} bash bench/speed/profile_step.sh "$B" \
    "--model.mla_interval=1 --model.moe_ffn=false" >/tmp/vs_k3g.txt 2>&1
  cat /tmp/vs_k3g.txt >>"$SUM"
  grep -E "^step |^step wall|^device idle|attn_res|AttnRes|sum_parts" /tmp/vs_k3g.txt
}
part_offload() {
  SECTIONS=3 OUT=/tmp/vs_off K3_RUN_TIMEOUT=$(($(left) / 3 - 5)) bash bench/gpu_checks/gpu_checks.sh "$B" \
    2>&1 | tee -a "$SUM"
}
part_graphs() {
  if gpu_build . "$B" /tmp/vs_graphs_build.log test_train >/dev/null 2>&1; then
    timeout 300 "$B/tests/train/test_train" --gtest_filter='StepGraph.*' >/tmp/vs_graphs_tests.txt 2>&1
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED|^\[       OK|Failure|Expected|Which is|captured|rror" \
      /tmp/vs_graphs_tests.txt | head -40 | tee -a "$SUM"
  else
    note "test_train did not build (/tmp/vs_graphs_build.log):"
    grep -E "error|Error" /tmp/vs_graphs_build.log | head -10 | tee -a "$SUM"
  fi
  local r g
  for r in $(seq 1 "${GRAPH_ROUNDS:-2}"); do
    for g in false true; do
      OUT=/tmp/vs_g_${g}_r$r CELLS=${GRAPH_CELLS:-1B k3} MODES= STAGES=run CELL_TIMEOUT=150 \
        VD_EXTRA="${VD_EXTRA:-} --training.cuda_graphs=$g" bash bench/speed/run_single_gpu.sh \
        >/tmp/vs_g_${g}_r$r.txt 2>&1
      note "round $r, training.cuda_graphs = $g:"
      grep -E "^\| .*viaduct|failed" /tmp/vs_g_${g}_r$r.txt | tee -a "$SUM"
      grep -h -E "captured|rror" /tmp/vs_g_${g}_r$r/*.viaduct.log 2>/dev/null | head -4 | tee -a "$SUM"
    done
  done
}
# graphbits: bench/gpu_checks/graph_bits.sh on this call's build (the
# StepGraph tests one process each, graph against eager to every digit).
part_graphbits() {
  OUT=/tmp/vs_graph_bits BUILD=$B bash bench/gpu_checks/graph_bits.sh >/tmp/vs_graph_bits.txt 2>&1
  grep -vE "^build:" /tmp/vs_graph_bits.txt | tee -a "$SUM"
}
part_doctests() {
  timeout 120 "$B/tests/kernels/test_kernels" \
    --gtest_filter='*Varlen*:*BlockCausal*:*Packed*:*OverDocuments*:KdaKernelsState.*' >/tmp/vs_doctests.txt 2>&1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED|^\[       OK|Failure|Expected|Which is|rel err|seed" \
    /tmp/vs_doctests.txt | head -60 | tee -a "$SUM"
}
part_kdadocs() {
  if [ -n "$FLA_WARM_PID" ]; then
    wait "$FLA_WARM_PID"
    local rc=$?
    note "fla warm-up: exit $rc (124: its time ran out) at $(($(date +%s) - T0)) s; its last lines:"
    tail -15 /tmp/vs_flawarm.txt | tee -a "$SUM"
    [ "$rc" = 0 ] || return
  fi
  OUT=/tmp/vs_kdadocs SECTIONS=docs ANCHOR=$ANCHOR FLA_ARGS=${FLA_ARGS---one-config} \
    bash bench/layers/kda_session.sh >/tmp/vs_kdadocs.txt 2>&1
  cat /tmp/vs_kdadocs.txt >>"$SUM"
  grep -E "^\||documents" /tmp/vs_kdadocs.txt
  for only in "attention" "mla" "kda"; do
    timeout 90 "$B/bench/layer_bench" --only "$only" --batch 4 --tokens 2048 --dim 2048 \
      --doc-mean 1024 --iters 20 2>&1 | grep -E "^\| |^documents|rror" | tee -a "$SUM"
  done
}
# block_causal's cost with eager steps on both sides (DOC_GRAPHS=false), the
# masks' own cost: with training.cuda_graphs unset, causal runs would take
# the step graph, which block_causal cannot.
part_doccost() {
  OUT=/tmp/vs_doc STAGES=run CELLS="${DOC_CELLS:-1Bdocs k3docs}" CELL_TIMEOUT=150 \
    VD_EXTRA="${VD_EXTRA:-} --training.cuda_graphs=${DOC_GRAPHS:-false}" \
    bash bench/speed/run_single_gpu.sh >/tmp/vs_doc.txt 2>&1
  cat /tmp/vs_doc.txt >>"$SUM"
  grep -E "^\||block_causal's cost" /tmp/vs_doc.txt
}
part_fashion() {
  VIADUCT=$B/viaduct OUT=/tmp/vs_fashion bash scripts/fashion_mnist.sh \
    --training.steps="${FASHION_STEPS:-3000}" --training.local_batch_size=64 \
    --checkpoint.interval=1000 --training.device=cuda >/tmp/vs_fashion.txt 2>&1
  tail -25 /tmp/vs_fashion.txt | tee -a "$SUM"
  N=${N:-2000} OUT=/tmp/vs_prep bash bench/data_prepare_images.sh "$B" 2>&1 | tail -8 | tee -a "$SUM"
}
# kdadocs: fla's Triton compile (kda_documents_vs_fla.py --warm; FLA_ARGS,
# default --one-config: each kernel in its first autotune configuration, as
# the full autotune outlasted a call) runs in the background from the
# call's start, beside the build; kdadocs waits for it.
# It shares the GPU while it runs: put kdadocs before any timed part.
ANCHOR=${ANCHOR:-../shared/anchors/kda}
[ -d "$ANCHOR" ] || ANCHOR=.deps/anchors/kda
# Triton's compiled kernels outlive the call: the cache starts from
# .deps/triton-cache.tar when one was carried, and a copy of it is written
# to $OUT/triton-cache.tar every 30 s (one file, so a call killed at its
# limit still returns what it compiled). Copy that file into .deps/ for the
# next call, and a compile that outlasts one call goes on in the next.
FLA_WARM_PID=
TRITON_SAVER_PID=
if [[ " $PARTS " == *" kdadocs "* ]] && [ -d "$ANCHOR" ]; then
  export TRITON_CACHE_DIR=/tmp/vs_triton_cache
  mkdir -p "$TRITON_CACHE_DIR"
  [ -f .deps/triton-cache.tar ] && tar -xf .deps/triton-cache.tar -C "$TRITON_CACHE_DIR" &&
    note "Triton cache: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files from .deps/triton-cache.tar"
  (while sleep 30; do
    tar -cf "$OUT/triton-cache.tar.part" -C "$TRITON_CACHE_DIR" . 2>/dev/null &&
      mv "$OUT/triton-cache.tar.part" "$OUT/triton-cache.tar"
  done) &
  TRITON_SAVER_PID=$!
  # Bounded so that the call keeps time to report it (FLA_WARM_S).
  (PYTHONUNBUFFERED=1 timeout "${FLA_WARM_S:-$((BUDGET_S - 150))}" \
    python3 bench/layers/kda_documents_vs_fla.py --warm 4x2048x16x64 \
    --anchor "$ANCHOR" ${FLA_ARGS---one-config} >/tmp/vs_flawarm.txt 2>&1) &
  FLA_WARM_PID=$!
fi
# The parts run in the order PARTS names them.
# doccost: ~120 s a cell per round of its two modes (DOC_ROUNDS, default 2).
doc_cells=(${DOC_CELLS:-1Bdocs k3docs})
declare -A ESTIMATE=([build]=90 [tests]=15 [probe]=60 [sbs]=240 [readnorm]=200 [sbs1Bab]=330 [profile]=70 [k3profile]=110 [k3gemmprofile]=60 [offload]=150 [doctests]=20 [kdadocs]=120 [k3docsprofile]=180 [gpt2profile]=60 [doccost]=$((${#doc_cells[@]} * 120 * ${DOC_ROUNDS:-2})) [fashion]=420 [graphs]=420 [graphbits]=150 [k3peer]=330 [gpt2pairs]=$((45 * ${GPT2_PAIRS:-3})))
for part in $PARTS; do
  if [ -z "${ESTIMATE[$part]:-}" ]; then
    note "## $part: no such part (parts: ${!ESTIMATE[*]})"
    continue
  fi
  want "$part" "${ESTIMATE[$part]}" && "part_$part"
done
if [ -n "$TRITON_SAVER_PID" ]; then
  kill "$TRITON_SAVER_PID" 2>/dev/null
  tar -cf "$OUT/triton-cache.tar" -C "$TRITON_CACHE_DIR" . 2>/dev/null
fi
note "done at $(($(date +%s) - T0)) s"
# The parts after a failed one still ran; the call's status says it failed.
if [ -n "$FAILURES" ]; then
  note "failed:$FAILURES"
  exit 1
fi
