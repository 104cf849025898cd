#!/usr/bin/env bash
# The rendezvous store under the GPU machine's LibTorch (2.x, whose c10d
# Store interface differs from Debian's 1.13), one device call: the CUDA
# build of viaduct and test_dist, the job store's tests (every operation
# against HashStore, stray clients refused, the loopback bind, the token
# rule), the NCCL cases of test_dist, and a one-GPU llama run through
# `viaduct launch` (one rank: its store and NCCL's environment as a launch
# sets them). Needs .deps carried (bench/fetch_deps.sh).
#
#   bash bench/store_gpu_check.sh      # results in $OUT/store_gpu.md and stdout
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/store_gpu}
mkdir -p "$OUT"
MD=$OUT/store_gpu.md
: >"$MD"
say() { echo "$*" | tee -a "$MD"; }
B=build-gpu
PY=${PYTHON:-python3}

if [ ! -f .deps/usr/include/toml++/toml.h ]; then
  for f in .deps/*.deb; do dpkg -x "$f" .deps; done
fi
prefix=$("$PY" -c 'import torch;print(torch.utils.cmake_prefix_path)')
say "torch $("$PY" -c 'import torch;print(torch.__version__)')"
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
if [ ! -f $B/CMakeCache.txt ]; then
  cmake -S . -B $B "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DVIADUCT_BUILD_TESTS=ON \
    -DVIADUCT_GTEST_SOURCE_DIR="$PWD/.deps/usr/src/googletest" -DCMAKE_PREFIX_PATH="$prefix" \
    -DCMAKE_INCLUDE_PATH="$PWD/.deps/usr/include" \
    -DCMAKE_LIBRARY_PATH="$PWD/.deps/usr/lib/x86_64-linux-gnu" \
    -DVIADUCT_EXTRA_INCLUDE="$PWD/.deps/usr/include" >"$OUT/cmake.log" 2>&1 ||
    { say "cmake failed"; tail -20 "$OUT/cmake.log"; exit 1; }
fi
t0=$(date +%s)
cmake --build $B --target viaduct_app test_dist -j "$(nproc)" >"$OUT/build.log" 2>&1 ||
  { say "build failed"; grep -m 20 -E "error" "$OUT/build.log" | tee -a "$MD"; exit 1; }
say "build: $(($(date +%s) - t0)) s"

timeout 300 $B/tests/distributed/test_dist --gtest_filter='JobStore*:*Nccl*:*NCCL*' >"$OUT/test_dist.log" 2>&1
say "test_dist (job store, NCCL): exit $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/test_dist.log" | tr '\n' ' ')"
grep -E "Failure|Which is|FAILED  \]" "$OUT/test_dist.log" | head -12 | tee -a "$MD"

data=outputs/bench/random_v257_store.u32
mkdir -p outputs/bench
[ -f $data ] || "$PY" -c "
import array, random
r = random.Random(1234)
open('$data', 'wb').write(array.array('I', (r.randrange(257) for _ in range(200000))).tobytes())"
timeout 300 $B/viaduct launch --nproc-per-node 1 -- $B/viaduct train --training.device=cuda \
  --data.path=$data --data.format=uint32 --training.steps=3 --training.eval_interval=0 \
  --metrics.progress_bar=false --job.dump_folder="$OUT/run" >"$OUT/run.log" 2>&1
say "launch, one rank on cuda: exit $? $(grep -c '"loss"' "$OUT/run/metrics.jsonl" 2>/dev/null) step lines"
tail -3 "$OUT/run.log" | tee -a "$MD"
