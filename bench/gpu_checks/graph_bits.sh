#!/usr/bin/env bash
# training.cuda_graphs against eager steps, bit for bit, one device call:
# the StepGraph tests of test_train (losses, gradient norms, weights and
# moments of a llama and a kimi_k3 debug model), then the viaduct binary on
# the llama and gpt2 debug models, four processes each: eager twice and
# graphs twice under training.deterministic = true, eager twice under
# false, and eager against graphs in float32 and with the key unset. Each run's per-step loss and grad_norm come from metrics.jsonl with
# every digit; a pair that should repeat and does not is named.
#
#   OUT=$OUT bash bench/gpu_checks/graph_bits.sh      # needs .deps carried
#
# Output: $OUT/graph_bits.md and stdout. MODELS (llama gpt2), STEPS (8).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
source bench/lib/gpu_build.sh
source bench/lib/tokens.sh  # random_tokens
OUT=${OUT:-/tmp/graph_bits}
mkdir -p "$OUT"
MD=$OUT/graph_bits.md
: >"$MD"
say() { echo "$*" | tee -a "$MD"; }
B=${BUILD:-build-gpu}
PY=${PYTHON:-python3}
STEPS=${STEPS:-8}

t0=$(date +%s)
targets=(viaduct_app)
gpu_build_has_gtest && targets+=(test_train)
gpu_build . "$B" "$OUT/build.log" "${targets[@]}" 2>&1 | tee -a "$MD" || { say "build failed"; exit 1; }
say "build: $(($(date +%s) - t0)) s"

if [ -x "$B/tests/train/test_train" ]; then
  # One process per test, so a crash names its test and hides no other.
  for t in $("$B/tests/train/test_train" --gtest_list_tests --gtest_filter='StepGraph.*' |
    awk '/^[^ ]/ {s = $1} /^  / {print s $1}'); do
    timeout 300 "$B/tests/train/test_train" --gtest_filter="$t" >"$OUT/test.txt" 2>&1
    say "$t: exit $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/test.txt" | tr '\n' ' ')"
    grep -E "Failure|Which is|Expected|fatal signal|step [0-9]|state tensor" "$OUT/test.txt" | head -12 | tee -a "$MD"
  done
fi

data=outputs/bench/random_v256.u32
random_tokens "$data" 256 400000

# One run: prints its steps' 'loss grad_norm' pairs, every digit.
run() {  # model name overrides...
  local model=$1 name=$2
  shift 2
  local dir=$OUT/$model.$name
  rm -rf "$dir"
  timeout 300 "$B/viaduct" train --config "configs/${model}_debug.toml" --training.device=cuda \
    --training.dtype=bfloat16 --training.steps="$STEPS" --training.eval_interval=0 \
    --checkpoint.enable=false --metrics.log_freq=1 --metrics.progress_bar=false \
    --data.path="$data" --data.format=uint32 --job.dump_folder="$dir" "$@" >"$dir.log" 2>&1 ||
    { say "$model $name: exit $?"; grep -v '^frame #' "$dir.log" | tail -5 | tee -a "$MD"; }
  "$PY" -c "
import json, sys
for l in open('$dir/metrics.jsonl'):
    j = json.loads(l)
    if 'grad_norm' in j: print(repr(j['loss']), repr(j['grad_norm']))" 2>/dev/null >"$dir.steps"
}
same() {  # model a b what
  if [ -s "$OUT/$1.$2.steps" ] && cmp -s "$OUT/$1.$2.steps" "$OUT/$1.$3.steps"; then
    say "$1: $4: same bits, $(wc -l <"$OUT/$1.$2.steps") steps"
  else
    say "$1: $4: DIFFER ($2 | $3, loss grad_norm per step):"
    paste -d'|' "$OUT/$1.$2.steps" "$OUT/$1.$3.steps" | head -"$STEPS" | tee -a "$MD"
  fi
}

for m in ${MODELS:-llama gpt2}; do
  run "$m" eager1 --training.cuda_graphs=false
  run "$m" graph1 --training.cuda_graphs=true
  run "$m" eager2 --training.cuda_graphs=false
  run "$m" graph2 --training.cuda_graphs=true
  run "$m" nodet1 --training.cuda_graphs=false --training.deterministic=false
  run "$m" nodet2 --training.cuda_graphs=false --training.deterministic=false
  say "$m: $(grep -h -E 'captured|replay' "$OUT/$m.graph1.log" | head -2 | tr '\n' ' ')"
  same "$m" eager1 eager2 "eager run to run (deterministic)"
  same "$m" graph1 graph2 "graph run to run (deterministic)"
  same "$m" eager1 graph1 "graph against eager (deterministic)"
  same "$m" nodet1 nodet2 "eager run to run (deterministic = false)"
  # fp32 training (no weight cache) and the key unset (the default).
  run "$m" fp32eager --training.cuda_graphs=false --training.dtype=float32
  run "$m" fp32graph --training.cuda_graphs=true --training.dtype=float32
  run "$m" unset
  same "$m" fp32eager fp32graph "graph against eager, float32 (deterministic)"
  same "$m" eager1 unset "key unset against eager (deterministic)"
done
say "done at $(($(date +%s) - t0)) s"
