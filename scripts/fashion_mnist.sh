#!/usr/bin/env bash
# The second demo: the Kimi-K3 debug model's vision tower on real images.
# Makes image-text files of Debian's Fashion-MNIST (dataset-fashion-mnist:
# 60,000 training and 10,000 test photos, 28 x 28), each image captioned
# with its class name; trains configs/kimi_k3_fashion.toml on the training
# set; and scores the test set with `viaduct eval-captions` (zero-shot
# classification by caption likelihood, and the class name's loss with the
# real images against blank ones) into OUT/eval_captions.json.
# Extra arguments go to `viaduct train` (e.g. --training.steps=100).
# Exits 77 without the data set.
set -euo pipefail
cd "$(dirname "$0")/.."
VIADUCT=${VIADUCT:-${VIADUCT_BUILD_DIR:-build}/viaduct}
SRC=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
DATA=${DATA:-data/fashion_mnist}
OUT=${OUT:-outputs/kimi_k3_fashion}
LABELS="T-shirt/top,Trouser,Pullover,Dress,Coat,Sandal,Shirt,Sneaker,Bag,Ankle boot"
CAPTION="{label}"
[ -f "$SRC/train-images-idx3-ubyte.gz" ] || {
  echo "no Fashion-MNIST in $SRC (apt-get install dataset-fashion-mnist)"; exit 77; }
mkdir -p "$DATA"
if [ ! -f "$DATA/train.img" ]; then
  "$VIADUCT" prepare-images --image-size 28 --labels "$LABELS" --caption "$CAPTION" \
    --idx-images "$SRC/train-images-idx3-ubyte.gz" --idx-labels "$SRC/train-labels-idx1-ubyte.gz" \
    --output "$DATA/train.img"
fi
# The test set sits beside the training set as its held-out file, which the
# trainer's eval reads (data.eval_batches of it).
if [ ! -f "$DATA/train.val.img" ]; then
  "$VIADUCT" prepare-images --image-size 28 --labels "$LABELS" --caption "$CAPTION" \
    --idx-images "$SRC/t10k-images-idx3-ubyte.gz" --idx-labels "$SRC/t10k-labels-idx1-ubyte.gz" \
    --output "$DATA/train.val.img"
fi
start=$(date +%s)
"$VIADUCT" train --config configs/kimi_k3_fashion.toml --data.path="$DATA/train.img" \
  --job.dump_folder="$OUT" "$@"
trained=$(date +%s)
"$VIADUCT" eval-captions --checkpoint "$OUT/checkpoint" --data "$DATA/train.val.img" \
  --labels "$LABELS" --caption "$CAPTION" --output "$OUT/eval_captions.json"
done_at=$(date +%s)
echo "fashion_mnist: training $((trained - start)) s, eval-captions $((done_at - trained)) s," \
     "total $((done_at - start)) s; results in $OUT/eval_captions.json"
