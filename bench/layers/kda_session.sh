#!/usr/bin/env bash
# One GPU-machine call for the KDA and MoE kernels: builds viaduct with CUDA
# (build-gpu/, bench/lib/gpu_build.sh: TARGETS), runs the KDA kernel tests,
# then times the layers with build-gpu/bench/layer_bench and, when
# ../shared/anchors/kda is present, flash-linear-attention's chunk_kda and
# the grouped-GEMM MoE at the same shapes in the same call.
#
#   bash bench/layers/kda_session.sh                       # every section
#   SECTIONS="build test layers" bash bench/layers/kda_session.sh
#   SECTIONS="build pairs" ANCHOR=.anchors/kda bash bench/layers/kda_session.sh
#
# Sections: build, test (the KDA suites of test_kernels), layers (layer_bench), anchor
# (fla's core and layer once), pairs (the KDA core against fla's core in
# PAIRS (3) alternating processes of ITERS (50) timed iterations, after
# one untimed fla run that autotunes; with build, that run goes in the
# background of the build), docs (KDA over documents: the
# kda_documents_bench target writes a case and times causal / documents / one
# call a document, then kda_documents_vs_fla.py checks viaduct and fla's
# chunk_kda with cu_seqlens against a float64 recurrence and times fla's
# cu_seqlens against its plain batch; DOC_ARGS: the bench's flags, FLA_ARGS
# the comparison's, e.g. --one-config).
#
# Environment (defaults): OUT (outputs/kda), SECTIONS ("build test layers
# anchor"), TARGETS ("test_kernels layer_bench kda_documents_bench"), ANCHOR
# (../shared/anchors/kda, or shared/anchors/kda inside the tree), SHAPE
# (1x4096x16x128: B x T x H x d for fla), LAYER_ARGS (layer bench flags:
# "--only kda"), JOBS (nproc), PAIRS (3), ITERS (50).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source bench/lib/gpu_build.sh
OUT=${OUT:-$PWD/outputs/kda}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SECTIONS=${SECTIONS:-build test layers anchor}
JOBS=${JOBS:-$(nproc)}
T0=$(date +%s)
say() { printf '[%4ds] %s\n' $(($(date +%s) - T0)) "$*"; }
has() { [[ " $SECTIONS " == *" $1 "* ]]; }

ANCHOR=${ANCHOR:-../shared/anchors/kda}
[ -d "$ANCHOR" ] || ANCHOR=shared/anchors/kda
fla_bench() {  # variants [bench_kda.py flags]: fla's chunk_kda at SHAPE
  local variants=$1
  shift
  (cd "$ANCHOR" && PYTHONUNBUFFERED=1 timeout 420 "$PY" bench_kda.py --shapes "${SHAPE:-1x4096x16x128}" \
     --variants "$variants" --skip-check "$@") 2>&1
}
fla_core() { fla_bench core --iters "$1" | grep "^core"; }  # iters: one line
WARM_PID=
if has pairs && [ -d "$ANCHOR" ]; then
  say "fla autotune (untimed) in the background"
  fla_core 5 >"$OUT/fla_warm.log" 2>&1 &
  WARM_PID=$!
fi

if has build; then
  read -r -a targets <<<"${TARGETS:-test_kernels layer_bench kda_documents_bench}"
  gpu_build . build-gpu "$OUT/build.log" "${targets[@]}" || { say "build failed"; exit 1; }
  say "build done"
fi
if has test; then
  say "test_kernels, the KDA suites"
  timeout 300 build-gpu/tests/kernels/test_kernels --gtest_filter="*Kda*" 2>&1 | tee "$OUT/test_kda.log" | grep -vE "^\[ RUN|^\[       OK" | tail -60
fi
if has layers; then
  say "layer_bench ${LAYER_ARGS:---only kda}"
  timeout 300 build-gpu/bench/layer_bench ${LAYER_ARGS:---only kda} 2>&1 | tee "$OUT/layers.log" | tail -20
fi
if has pairs && [ -n "$WARM_PID" ]; then
  wait "$WARM_PID"
  say "fla warm: $(cat "$OUT/fla_warm.log")"
  : >"$OUT/pairs.log"
  for i in $(seq "${PAIRS:-3}"); do
    vd=$(timeout 120 build-gpu/bench/layer_bench --only "kda core (chunk 64)" --iters "${ITERS:-50}" 2>&1 | grep "^| kda core")
    fla=$(fla_core "${ITERS:-50}")
    printf 'pair %d\n  viaduct %s\n  fla     %s\n' "$i" "$vd" "$fla" | tee -a "$OUT/pairs.log"
  done
fi
if has docs; then
  say "kda_documents_bench ${DOC_ARGS:-}"
  rm -rf "$OUT/docs_case"
  timeout 300 build-gpu/bench/kda_documents_bench --out "$OUT/docs_case" ${DOC_ARGS:-} 2>&1 |
    tee "$OUT/docs_viaduct.log" | tail -8
  if [ -d "$ANCHOR" ]; then
    PYTHONUNBUFFERED=1 timeout 420 "$PY" bench/layers/kda_documents_vs_fla.py --dir "$OUT/docs_case" \
      --anchor "$ANCHOR" ${FLA_ARGS:-} 2>&1 | tee "$OUT/docs_fla.log" | tail -16
  fi
fi
if has anchor && [ -d "$ANCHOR" ]; then
  say "fla chunk_kda (${SHAPE:-1x4096x16x128})"
  fla_bench core,layer | tee "$OUT/fla.log" | tail -15
fi
say "done"
