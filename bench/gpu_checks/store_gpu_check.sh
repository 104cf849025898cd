#!/usr/bin/env bash
# The rendezvous store under the GPU machine's LibTorch (2.x, whose c10d
# Store interface differs from Debian's 1.13), one device call: the CUDA
# build of viaduct and test_distributed (bench/lib/gpu_build.sh), the job
# store's tests (every operation against HashStore, stray clients refused,
# the loopback bind, the token rule), the NCCL cases of test_distributed,
# and a one-GPU llama run through `viaduct launch` (one rank: its store and
# NCCL's environment as a launch sets them). Needs .deps carried, with
# GoogleTest's sources (bench/fetch_deps.sh).
#
#   bash bench/gpu_checks/store_gpu_check.sh      # results in $OUT/store_gpu.md and stdout
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source bench/lib/gpu_build.sh
OUT=${OUT:-/tmp/store_gpu}
mkdir -p "$OUT"
MD=$OUT/store_gpu.md
: >"$MD"
say() { echo "$*" | tee -a "$MD"; }
B=build-gpu
PY=${PYTHON:-python3}

say "torch $("$PY" -c 'import torch;print(torch.__version__)')"
t0=$(date +%s)
gpu_build . $B "$OUT/build.log" viaduct_app test_distributed 2>&1 | tee -a "$MD" ||
  { say "build failed"; exit 1; }
say "build: $(($(date +%s) - t0)) s"

timeout 300 $B/tests/distributed/test_distributed --gtest_filter='JobStore*:*Nccl*:*NCCL*' \
  >"$OUT/test_distributed.log" 2>&1
say "test_distributed (job store, NCCL): exit $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/test_distributed.log" | tr '\n' ' ')"
grep -E "Failure|Which is|FAILED  \]" "$OUT/test_distributed.log" | head -12 | tee -a "$MD"

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
