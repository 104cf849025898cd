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
  # The router's weight gradient with 32 rows' x words in flight a thread,
  # not 16 (148 registers, no spills at sm_90a).
  "router_dw_rows32 moe_router.cu s/kDwRowsInFlight = 16;/kDwRowsInFlight = 32;/"
  # The same with 2 columns a thread, not 4: twice the warps (K3's 16,384
  # tokens give 1,024 warps at 4 columns, under 8 an SM), 4-byte loads.
  "router_dw_cols2 moe_router.cu s/kDwCols = 4;/kDwCols = 2;/"
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
