#!/usr/bin/env bash
# Peak memory of a training step with the plain head + cross-entropy against
# the chunked head loss (model.loss_chunk_tokens), same run otherwise.
# usage: bench/memory/head_loss_memory.sh BUILD_DIR [extra viaduct overrides...]
# Default shape: llama debugmodel with a 32768 vocab, 8 x 512 tokens (CPU).
set -euo pipefail
B=$1; shift
OUT=${OUT:-/tmp}/head_loss_memory
mkdir -p "$OUT"
echo "| model.loss_chunk_tokens | step-3 loss | peak memory |"
echo "|---|---|---|"
for c in 0 512; do
  line=$("$B/viaduct" train --config configs/llama_debug.toml --model.vocab_size=32768 \
    --training.seq_len=512 --training.local_batch_size=8 --training.steps=3 \
    --training.eval_interval=0 --checkpoint.enable=false --metrics.progress_bar=false \
    --metrics.log_freq=1 --model.loss_chunk_tokens=$c --job.dump_folder="$OUT/c$c" "$@" 2>&1 |
    grep "step     3")
  echo "| $c | $(echo "$line" | sed 's/.*loss \([0-9.]*\).*/\1/') | $(echo "$line" | sed 's/.*mem //') |"
done
