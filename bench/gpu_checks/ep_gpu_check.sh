#!/usr/bin/env bash
# Expert parallelism on one GPU, one device call: the CUDA build with the
# expert-parallel code (build-gpu, bench/lib/gpu_build.sh), the MoE layer
# sharded over ranks as threads on the GPU against the unsharded layer
# (test_model's ExpertLayer tests), the MoE kernel tests (test_kernels), the
# NCCL cases of test_distributed, and short kimi_k3 runs at ep 1 on the GPU (bf16, the
# grouped experts) whose metrics must carry the MoE load per layer, one of
# them with a capacity factor (its dropped copies counted). ep > 1 over NCCL
# needs several GPUs (bench/multi_gpu/run_multi_gpu.sh's ep section). Needs
# .deps carried, with GoogleTest's sources (bench/fetch_deps.sh).
#
#   bash bench/gpu_checks/ep_gpu_check.sh      # results in $OUT/ep_gpu.md and stdout
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source bench/lib/gpu_build.sh
OUT=${OUT:-/tmp/ep_gpu}
mkdir -p "$OUT"
MD=$OUT/ep_gpu.md
: >"$MD"
say() { echo "$*" | tee -a "$MD"; }
B=build-gpu
PY=${PYTHON:-python3}

t0=$(date +%s)
gpu_build . $B "$OUT/build.log" viaduct_app test_model test_kernels \
  test_distributed 2>&1 | tee -a "$MD" || { say "build failed"; exit 1; }
say "build: $(($(date +%s) - t0)) s"

for t in "model/test_model:ExpertLayer*:ExpertCapacity*" \
         "kernels/test_kernels:MoeRouting*:*MoeGrouped*" \
         "distributed/test_distributed:*Nccl*:*NCCL*"; do
  filter=${t#*:} t=${t%%:*}
  [ -x "$B/tests/$t" ] || { say "no $B/tests/$t"; continue; }
  timeout 300 "$B/tests/$t" --gtest_filter="$filter" >"$OUT/$(basename $t).log" 2>&1
  say "$t: exit $? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$(basename $t).log" | tr '\n' ' ')"
  grep -E "expert layer on|Failure|Which is" "$OUT/$(basename $t).log" | head -12 | tee -a "$MD"
done

data=outputs/bench/random_v257_ep.u32
mkdir -p outputs/bench
[ -f $data ] || "$PY" -c "
import array, random
r = random.Random(1234)
open('$data', 'wb').write(array.array('I', (r.randrange(257) for _ in range(200000))).tobytes())"
for run in "k3_ep1:" "k3_capacity:--model.moe_capacity_factor=1.0"; do
  name=${run%%:*} extra=${run#*:}
  # shellcheck disable=SC2086
  timeout 300 $B/viaduct train --config configs/kimi_k3_debug.toml --training.device=cuda \
    --training.steps=20 --training.eval_interval=0 --checkpoint.enable=false \
    --metrics.progress_bar=false --metrics.log_freq=10 --data.path=$data --data.format=uint32 \
    $extra --job.dump_folder="$OUT/$name" >"$OUT/$name.log" 2>&1
  say "$name: kimi_k3 debugmodel on cuda, 20 steps $extra: exit $?"
  grep -E "^step|error" "$OUT/$name.log" | tail -2 | tee -a "$MD"
  "$PY" - "$OUT/$name/metrics.jsonl" <<'EOF' | tee -a "$MD"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
loads = [max(r["moe_load_max_over_mean"]) for r in rows if r.get("moe_load_max_over_mean")]
print(f"moe_load_max_over_mean in {len(loads)} of {len(rows)} steps; worst layer first/last: "
      f"{loads[0]:.2f} / {loads[-1]:.2f}" if loads else "no moe_load_max_over_mean")
drops = [r["moe_dropped_tokens"] for r in rows if "moe_dropped_tokens" in r]
if drops:
    print(f"moe_dropped_tokens in {len(drops)} steps: first {drops[0]:.0f}, last {drops[-1]:.0f}")
EOF
done
