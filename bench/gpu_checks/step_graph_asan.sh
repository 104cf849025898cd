#!/usr/bin/env bash
# The StepGraph tests (training.cuda_graphs) in a GPU build of test_train
# under AddressSanitizer, in a build folder of its own (BUILD, default
# build-asan), each test in its own process; a crash's frames (the test
# binaries' fatal-signal report, core/fatal_signal.h) are symbolized with
# addr2line. Output: $OUT/step_graph_asan.txt and its key lines on stdout.
#
#   OUT=$OUT bash bench/gpu_checks/step_graph_asan.sh     # needs .deps carried
#
# FILTER (StepGraph.*) picks other tests of test_train. The first build
# takes a few minutes longer than a Release one.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$PWD/outputs/bench/step_graph_asan}
mkdir -p "$OUT"
LOG=$OUT/step_graph_asan.txt
: >"$LOG"
B=${BUILD:-build-asan}
t0=$(date +%s)
BUILD=$B GPU_BUILD_TYPE=RelWithDebInfo \
  GPU_BUILD_CXX_FLAGS="-fsanitize=address -fno-omit-frame-pointer" \
  GPU_BUILD_LINK_FLAGS="-fsanitize=address" LOG=$OUT/build.log \
  bash bench/lib/gpu_build.sh test_train 2>&1 | tee -a "$LOG" || exit 1
echo "build: $(($(date +%s) - t0)) s" | tee -a "$LOG"
T=$B/tests/train/test_train
# CUDA maps memory where ASan's shadow gap would be; leaks are not the question.
export ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=0:replace_intrin=0
for t in $("$T" --gtest_list_tests --gtest_filter="${FILTER:-StepGraph.*}" |
  awk '/^[^ ]/ {s = $1} /^  / {print s $1}'); do
  timeout 300 "$T" --gtest_filter="$t" >"$OUT/run.txt" 2>&1
  rc=$?
  echo "== $t: exit $rc" | tee -a "$LOG"
  grep -vE "^info:" "$OUT/run.txt" | grep -E "ERROR: AddressSanitizer|SUMMARY|fatal signal|^    #[0-9]|Failure|FAILED|OK \]|PASSED|SKIPPED" |
    head -60 | tee -a "$LOG"
  # The fatal-signal report's frames in the test binary, symbolized.
  grep -oE "test_train\(\+0x[0-9a-f]+\)" "$OUT/run.txt" | grep -oE "0x[0-9a-f]+" |
    while read -r off; do addr2line -C -f -i -e "$T" "$off" | paste -sd' '; done | tee -a "$LOG"
done
