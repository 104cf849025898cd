#!/usr/bin/env bash
# kimi_k3 debugmodel_deep (MLA in every layer, dense FFNs, AttnRes blocks of
# 3), 3 deterministic steps: one stage against pp 1 x 4 stages
# (Interleaved1F1B, InterleavedZeroBubble), and with the whole-stack
# backward. Prints each run's
# (loss, grad_norm) per step; equal rows are equal bits of what metrics.jsonl
# holds. The bitwise contract is the whole-stack backward's (ws, wszb against
# one); i1f1b and izb use the rank cache, which groups a block's gradient
# contributions by rank and agrees with one to rounding. GPU: B=build-gpu
# bash bench/bits/k3_bitwise.sh; CPU rehearsal:
# B=build DEV=cpu DT=float32 DIM=64 SEQ=64 bash bench/bits/k3_bitwise.sh
# MIX=real: the flavor's own mix instead (KDA at chunk 64 with heads of 64,
# MLA at 3, 7, ..., MoE of 8 experts top 2 from layer 1), which runs
# viaduct's KDA and grouped-GEMM MoE kernels on the GPU. RUNS: which runs
# (default all five: one i1f1b izb ws wszb).
cd "$(dirname "$0")/../.." || exit 1
B=${B:-build-gpu}; DEV=${DEV:-cuda}; DT=${DT:-bfloat16}; DIM=${DIM:-512}; SEQ=${SEQ:-512}
case ${MIX:-gemm} in
  gemm) MIXARGS=(--model.mla_interval=1 --model.moe_ffn=false) ;;
  real) MIXARGS=(--model.n_heads=$((DIM / 64)) --model.kda_head_dim=64 --model.kda_chunk_size=64
          --model.moe_hidden_dim=$((DIM / 2))) ;;
  *) echo "k3_bitwise.sh: MIX must be gemm or real" >&2; exit 2 ;;
esac
RUNS=" ${RUNS:-one i1f1b izb ws wszb} "
# The config's fortunes data where it was prepared (README), else (a GPU
# machine without the fortunes package) uniform random tokens of the byte
# vocabulary, the same file for every run.
DATA=${DATA:-data/fortunes.tok}
if [ ! -f "$DATA" ]; then
  DATA=outputs/bench/random_v320_bitwise.u32
  mkdir -p outputs/bench
  [ -f "$DATA" ] || python3 -c "
import array, random, sys
r = random.Random(1234)
array.array('I', (r.randrange(320) for _ in range(8 * $SEQ * 8 + 1))).tofile(open(sys.argv[1], 'wb'))" "$DATA"
fi
run() { name=$1; shift
  [[ $RUNS == *" $name "* ]] || return 0
  timeout 200 $B/viaduct train --config configs/kimi_k3_debug.toml --model.flavor=debugmodel_deep \
    --model.dim=$DIM "${MIXARGS[@]}" --model.attn_res_block_size=3 \
    --training.seq_len=$SEQ --training.local_batch_size=8 --training.dtype=$DT --training.device=$DEV \
    --training.steps=3 --training.eval_interval=0 --checkpoint.enable=false --training.deterministic=true \
    --metrics.progress_bar=false --metrics.log_freq=1 --parallelism.pipeline_parallel_microbatches=4 \
    --data.path="$DATA" --job.dump_folder=/tmp/k3bw_$name "$@" > /tmp/k3bw_$name.log 2>&1 || { echo "$name failed"; tail -5 /tmp/k3bw_$name.log; }
  python3 -c "
import json,sys
rows=[json.loads(l) for l in open('/tmp/k3bw_$name/metrics.jsonl')]
print('$name', [ (r.get('loss'), r.get('grad_norm')) for r in rows if 'loss' in r])" 2>&1 | tail -1
}
run one --parallelism.pipeline_parallel_stages_per_rank=1
run i1f1b --parallelism.pipeline_parallel_stages_per_rank=4 --parallelism.pipeline_parallel_schedule=Interleaved1F1B
run izb --parallelism.pipeline_parallel_stages_per_rank=4 --parallelism.pipeline_parallel_schedule=InterleavedZeroBubble
run ws --parallelism.pipeline_parallel_stages_per_rank=4 --parallelism.pipeline_parallel_schedule=Interleaved1F1B --parallelism.attn_res_cache_backward=whole_stack
run wszb --parallelism.pipeline_parallel_stages_per_rank=4 --parallelism.pipeline_parallel_schedule=InterleavedZeroBubble --parallelism.attn_res_cache_backward=whole_stack
