#!/usr/bin/env bash
# The memory-bound kernels of kernel_bytes.cu from several source trees in
# one GPU-machine call: each tree's src/kernels built with nvcc alone (about
# a minute; no LibTorch build), then the binaries run in alternating
# processes, ROUNDS rounds (A, B, C, A, B, C, ...). Prints per case and tree
# the median microseconds a call over the rounds, the bytes' pace, the
# ratio to the first tree, and whether the output's bits match the first
# tree's (the hash of kernel_bytes.cu's fixed inputs), with GPU 0's SM
# clock and power while each process ran.
#
#   bash bench/kernels/ab_kernels.sh .cache/base.tar .          # A: base, B: this tree
#   ROUNDS=5 ITERS=100 bash bench/kernels/ab_kernels.sh A.tar B.tar C.tar
#
# A tree is a folder or a .tar of one (git archive; only its src/kernels is
# used). The bench itself is this tree's kernel_bytes.cu. Environment: OUT
# (outputs/kernels), ROUNDS (4), ITERS (50), NVCC (nvcc), ARCH (sm_90a).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$PWD/outputs/kernels}
ROUNDS=${ROUNDS:-4}
ITERS=${ITERS:-50}
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || NVCC=/usr/local/cuda/bin/nvcc
ARCH=${ARCH:-sm_90a}
[ $# -ge 1 ] || { echo "usage: $0 TREE_A [TREE_B ...]"; exit 2; }
mkdir -p "$OUT"
rm -f "$OUT"/*.run.* "$OUT"/*.bin

names=()
i=0
for tree in "$@"; do
  i=$((i + 1))
  name=$(printf '%s' "$(basename "$tree" .tar)" | tr -c 'A-Za-z0-9_.-' '_')
  [ "$name" = "." ] || [ "$name" = "_" ] && name=this
  name="$i.$name"
  dir=$tree
  if [[ $tree == *.tar ]]; then
    dir=$OUT/tree.$i
    rm -rf "$dir" && mkdir -p "$dir" && tar -xf "$tree" -C "$dir" src/kernels ||
      { echo "cannot unpack $tree"; exit 1; }
  fi
  NVCC=$NVCC ARCH=$ARCH bash bench/kernels/build_kernel_bytes.sh "$dir" "$OUT/$name.bin" \
    >"$OUT/$name.build.log" 2>&1 &
  names+=("$name")
done
wait
for n in "${names[@]}"; do
  [ -x "$OUT/$n.bin" ] || { echo "build failed: $n"; tail -20 "$OUT/$n.build.log"; exit 1; }
done
echo "built ${#names[@]} trees: ${names[*]}"

source bench/lib/gpu_log.sh
rm -f "$OUT/gpu.md"
for r in $(seq 1 "$ROUNDS"); do
  for n in "${names[@]}"; do
    with_gpu_log "$OUT/gpu.md" "$n round $r" "$OUT/$n.bin" "$ITERS" 3 >"$OUT/$n.run.$r" 2>&1 ||
      { echo "$n round $r failed:"; cat "$OUT/$n.run.$r"; exit 1; }
  done
done
cat "$OUT/gpu.md"

python3 - "$OUT" "$ROUNDS" "${names[@]}" <<'PYEOF'
import statistics, sys
out, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = {}  # case -> name -> (hash, [us], MB, GB/s)
order = []
for n in names:
    for r in range(1, rounds + 1):
        for line in open(f"{out}/{n}.run.{r}"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) != 5:
                continue
            case, h, us, mb, _ = cells
            if case not in rows:
                rows[case] = {}
                order.append(case)
            e = rows[case].setdefault(n, [h, [], mb])
            if us != "-":
                e[1].append(float(us))
print("| case | " + " | ".join(names) + " |")
print("|---|" + "---|" * len(names))
for case in order:
    base = rows[case].get(names[0])
    cells = []
    for n in names:
        e = rows[case].get(n)
        if e is None:
            cells.append("missing")
            continue
        h, us, mb = e
        same = ("" if n == names[0] or base is None or h == "-" else
                (" same bits" if h == base[0] else " OTHER BITS"))
        if not us:
            cells.append(same.strip() or "-")
            continue
        med = statistics.median(us)
        txt = f"{med:.1f} µs"
        if mb not in ("-", "0.0 MB"):
            txt += f" ({float(mb.split()[0]) / med:.2f} TB/s)"
        if n != names[0] and base and base[1]:
            txt += f", {med / statistics.median(base[1]):.3f}×"
        cells.append(txt + same)
    print(f"| {case} | " + " | ".join(cells) + " |")
PYEOF
