#!/usr/bin/env bash
# Builds the kernel bench's trees for every variant waiting here: HEAD, each
# patch applied to HEAD, and each one-constant tree (TREES below: a name, a
# file under src/kernels, and a sed expression). Writes .cache/v/NAME.tar
# (only src/ in each) and prints the ab_kernels.sh command that times them
# all in one GPU-machine call (carry .cache).
#
#   bash bench/kernels/variants/make_trees.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
TREES=(
  # The read-with-norm backward in one wave at K3's 8,192 rows: 391 blocks
  # of 21 rows on 396 slots, not 1,024 blocks of 8 (2.59 waves).
  "read_parts21 attn_res_read.cuh s/kReadRowsPerPart = 8;/kReadRowsPerPart = 21;/"
  # The router's forward scoring 8 tokens a warp per load of the weights'
  # chunk, not 4 (168 registers, 8 bytes of spills at sm_90a).
  "router_fwd_tokens8 moe_router.cu s/kTokensPerWarp = 4;/kTokensPerWarp = 8;/"
  # The loss's cluster with smaller slices: a bf16 row of 128,256 over 5
  # blocks of 51 KB or 8 of 32 KB, not 4 of 64 KB: 4 blocks an SM (the
  # thread limit at 512 a block), not 3 (shared memory).
  "loss_slice52 cross_entropy.cu s/kClusterSliceBytes = 70 \* 1024;/kClusterSliceBytes = 52 * 1024;/"
  "loss_slice33 cross_entropy.cu s/kClusterSliceBytes = 70 \* 1024;/kClusterSliceBytes = 33 * 1024;/"
)
out=.cache/v
rm -rf "$out" && mkdir -p "$out"
git archive -o "$out/head.tar" HEAD src
tars=("$out/head.tar")
# HEAD's src unpacked in $out/NAME for a variant's change, then packed.
unpack() { mkdir -p "$out/$1" && git archive HEAD src | tar -x -C "$out/$1"; }
pack() {
  tar -cf "$out/$1.tar" -C "$out/$1" src && rm -rf "${out:?}/$1"
  tars+=("$out/$1.tar")
}
for v in bench/kernels/variants/*.patch; do
  [ -e "$v" ] || continue
  name=$(basename "$v" .patch)
  unpack "$name"
  patch -s -d "$out/$name" -p1 <"$v"
  pack "$name"
done
for t in "${TREES[@]}"; do
  read -r name file expr <<<"$t"
  unpack "$name"
  before=$(md5sum <"$out/$name/src/kernels/$file")
  sed -i "$expr" "$out/$name/src/kernels/$file"
  [ "$before" != "$(md5sum <"$out/$name/src/kernels/$file")" ] ||
    { echo "$name: '$expr' changed nothing in $file" >&2; exit 1; }
  pack "$name"
done
echo "trees: ${tars[*]}"
echo "on the GPU machine (carry .cache): ROUNDS=3 bash bench/kernels/ab_kernels.sh ${tars[*]}"
