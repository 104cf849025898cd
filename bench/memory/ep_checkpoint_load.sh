#!/usr/bin/env bash
# CPU: the host memory a rank needs to resume an expert-parallel checkpoint.
# A kimi_k3 with large experts (64 of them, 3 MoE layers) trains 2 steps
# under dp 4 x ep 4 (4 processes over Gloo) and saves; then each binary
# given resumes it for one step, in alternating rounds, with the plain
# optimizer and with ZeRO-1 (parallelism.dp_shard_optimizer). The figure is
# the resumed step's peak resident set of rank 0 (metrics.jsonl's
# peak_memory_bytes on the CPU), which includes the checkpoint load; the
# expert gradients summed locally (parallelism.expert_gradient_sum = local)
# keep the step's own peak below the load's, so the load is what shows.
#
#   bash bench/memory/ep_checkpoint_load.sh OLD_BINARY [NEW_BINARY] [ROUNDS]
#
# NEW_BINARY defaults to build/viaduct, ROUNDS to 2. OUT (outputs/bench/ep_load)
# holds the runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
source bench/lib/tokens.sh
OLD=${1:?usage: ep_checkpoint_load.sh OLD_BINARY [NEW_BINARY] [ROUNDS]}
NEW=${2:-build/viaduct}
ROUNDS=${3:-2}
OUT=${OUT:-outputs/bench/ep_load}
mkdir -p "$OUT"
random_tokens "$OUT/tokens.u32" 257 200000
ARGS=(--model.family=kimi_k3 --model.flavor=debugmodel --model.n_layers=4
  --model.attn_res_block_size=2 --model.dim=256 --model.n_heads=4 --model.vocab_size=257
  --model.n_routed_experts=64 --model.n_activated_experts=2 --model.moe_hidden_dim=512
  --training.seq_len=64 --training.local_batch_size=2 --training.num_threads=1
  --training.eval_interval=0 --metrics.progress_bar=false --metrics.log_freq=1
  --parallelism.data_parallel_degree=4 --parallelism.expert_parallel_degree=4
  --parallelism.expert_gradient_sum=local
  --checkpoint.enable=true --checkpoint.interval=2 --checkpoint.keep_latest_k=0
  --data.path="$OUT/tokens.u32")
peak() {  # metrics.jsonl -> the last step's peak_memory_bytes in MiB
  python3 -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '\"loss\"' in l]
print('%.0f' % (rows[-1]['peak_memory_bytes'] / 2**20))" "$1"
}
for opt in plain zero; do
  extra=()
  [ "$opt" = zero ] && extra=(--parallelism.dp_shard_optimizer=true)
  base=$OUT/base_$opt
  if [ ! -d "$base/checkpoint/step-2" ]; then
    rm -rf "$base"
    "$NEW" launch --nproc-per-node 4 -- "$NEW" train "${ARGS[@]}" "${extra[@]}" \
      --training.steps=2 --job.dump_folder="$base" >"$OUT/base_$opt.log" 2>&1
  fi
  echo "$opt: saved at step 2, checkpoint $(du -sm "$base/checkpoint/step-2" | cut -f1) MiB;" \
       "fresh run's peak $(peak "$base/metrics.jsonl") MiB (rank 0, RSS)"
  for r in $(seq 1 "$ROUNDS"); do
    for side in old new; do
      bin=$OLD
      [ "$side" = new ] && bin=$NEW
      run=$OUT/resume_${opt}_${side}_r$r
      rm -rf "$run" && mkdir -p "$run"
      cp -r "$base/checkpoint" "$run/checkpoint"
      "$bin" launch --nproc-per-node 4 -- "$bin" train "${ARGS[@]}" "${extra[@]}" \
        --training.steps=3 --job.dump_folder="$run" >"$run.log" 2>&1
      grep -q "resumed from" "$run.log" || { echo "$run did not resume (see $run.log)"; exit 1; }
      echo "  round $r $side: resumed step's peak $(peak "$run/metrics.jsonl") MiB"
    done
  done
done
