#!/usr/bin/env bash
# prepare-images throughput, images per second, on every core and on one:
#  - idx:  Fashion-MNIST's 60,000 training images (IDX, no decode: the
#          reader, the resize and the write) at 28 x 28;
#  - jpeg: a WebDataset shard of N JPEGs of 320 x 240 (Pillow makes it, or
#          ImageMagick where Pillow is missing) fitted to 224 x 224: decode
#          and resize dominate;
#  - png:  the same images as PNGs.
# Prints one line per case and writes $OUT/prepare_images.md.
# usage: bash bench/data_prepare_images.sh [BUILD_DIR]   (N=2000 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-${VIADUCT_BUILD_DIR:-build}}
VIADUCT=$BUILD/viaduct
OUT=${OUT:-outputs/bench_prepare_images}
N=${N:-2000}
SRC=${FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
mkdir -p "$OUT"
"$VIADUCT" prepare-images --help >/dev/null || { echo "this viaduct has no prepare-images"; exit 1; }
CORES=$(nproc)
echo "| case | images | threads | seconds | images/s |" > "$OUT/prepare_images.md"
echo "|---|---|---|---|---|" >> "$OUT/prepare_images.md"

run_case() {  # name threads args...
  local name=$1 threads=$2; shift 2
  local log="$OUT/$name.t$threads.log"
  "$VIADUCT" prepare-images --threads "$threads" --output "$OUT/$name.img" "$@" > "$log" 2>&1
  # The summary line: "N images, K skipped, ... in S s (R images/s)".
  local line; line=$(grep "images/s" "$log" | tail -1)
  local images secs rate
  images=$(echo "$line" | sed -E 's/.*prepare-images: ([0-9]+) images.*/\1/')
  secs=$(echo "$line" | sed -E 's/.* written in ([0-9.e+-]+) s.*/\1/')
  rate=$(echo "$line" | sed -E 's/.*\(([0-9]+) images\/s\).*/\1/')
  echo "$name threads=$threads: $images images in $secs s, $rate images/s"
  echo "| $name | $images | $threads | $secs | $rate |" >> "$OUT/prepare_images.md"
}

if [ -f "$SRC/train-images-idx3-ubyte.gz" ]; then
  for t in "$CORES" 1; do
    run_case idx "$t" --image-size 28 --labels "0,1,2,3,4,5,6,7,8,9" \
      --idx-images "$SRC/train-images-idx3-ubyte.gz" --idx-labels "$SRC/train-labels-idx1-ubyte.gz"
  done
else
  echo "no Fashion-MNIST in $SRC: idx case skipped"
fi

# The shards: random smooth images, so that JPEG and PNG sizes are typical.
if [ ! -f "$OUT/jpeg.tar" ]; then
  if /usr/bin/python3 -c "import PIL" 2>/dev/null || python3 -c "import PIL" 2>/dev/null; then
    PY=$(/usr/bin/python3 -c "import PIL" 2>/dev/null && echo /usr/bin/python3 || echo python3)
    "$PY" - "$OUT" "$N" <<'PYEOF'
import io, random, sys, tarfile
from PIL import Image, ImageFilter
out, n = sys.argv[1], int(sys.argv[2])
rng = random.Random(7)
base = Image.frombytes("RGB", (80, 60), bytes(rng.randrange(256) for _ in range(80 * 60 * 3)))
for fmt, ext in (("JPEG", "jpg"), ("PNG", "png")):
    with tarfile.open(f"{out}/{fmt.lower()}.tar", "w") as tar:
        for i in range(n):
            img = base.rotate(i % 360).resize((320, 240)).filter(ImageFilter.GaussianBlur(1))
            buf = io.BytesIO(); img.save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
            for name, data in ((f"{i:06d}.{ext}", buf.getvalue()), (f"{i:06d}.txt", b"a picture")):
                info = tarfile.TarInfo(name); info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
PYEOF
  else
    echo "no Pillow: jpeg and png cases skipped"
  fi
fi
for fmt in jpeg png; do
  [ -f "$OUT/$fmt.tar" ] || continue
  for t in "$CORES" 1; do
    run_case "$fmt" "$t" --image-size 224 --input "$OUT/$fmt.tar"
  done
done
echo "table: $OUT/prepare_images.md"
