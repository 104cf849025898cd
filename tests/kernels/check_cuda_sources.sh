#!/usr/bin/env bash
# The CUDA sources compile on a machine without a GPU or a CUDA LibTorch:
# every src/kernels/*.cu with nvcc for the product's architecture, the
# kernel bench (bench/kernels/kernel_bytes.cu) built against them, and each
# kernel variant's patch (bench/kernels/variants) applied and compiled.
# The CPU build compiles none of these, so without this a change to a
# kernel's signature could leave the GPU build, the bench or a variant
# broken until the next GPU session. Exits 77 (ctest: skipped) where no
# nvcc is installed.
#
# Environment: NVCC (nvcc, else /usr/local/cuda/bin/nvcc), ARCH (sm_90a),
# OUT (a scratch folder; default a temporary one, removed at exit).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || NVCC=/usr/local/cuda/bin/nvcc
if ! command -v "$NVCC" >/dev/null; then
  echo "no nvcc (NVCC, PATH or /usr/local/cuda/bin): the CUDA sources are not compiled"
  exit 77
fi
ARCH=${ARCH:-sm_90a}
if [ -z "${OUT:-}" ]; then
  OUT=$(mktemp -d)
  trap 'rm -rf "$OUT"' EXIT
fi
mkdir -p "$OUT"
JOBS=${JOBS:-$(nproc)}
echo "$("$NVCC" --version | tail -1); $ARCH; $JOBS jobs"

# A kernel file alone, as CMake's CUDA build compiles it (C++20), against
# the tree ROOT: compile ROOT FILE OBJECT LOG.
failed=()
compile() {
  "$NVCC" -std=c++20 -O3 -arch="$ARCH" -I "$1/src" -c "$2" -o "$3" >>"$4" 2>&1
}
export -f compile
export NVCC ARCH OUT
ls src/kernels/*.cu | xargs -P "$JOBS" -I{} bash -c \
  'o=$OUT/$(basename {}); compile . {} "$o.o" "$o.log" || touch "$o.failed"'
for f in src/kernels/*.cu; do
  if [ -e "$OUT/$(basename "$f").failed" ]; then
    failed+=("$f")
    echo "FAILED: $f"
    tail -30 "$OUT/$(basename "$f").log"
  fi
done
echo "compiled $(ls src/kernels/*.cu | wc -l) kernel files, ${#failed[@]} failed"

if ! NVCC=$NVCC ARCH=$ARCH bash bench/kernels/build_kernel_bytes.sh . "$OUT/kernel_bytes" \
  >"$OUT/kernel_bytes.log" 2>&1; then
  failed+=(bench/kernels/kernel_bytes.cu)
  echo "FAILED: bench/kernels/kernel_bytes.cu against src/kernels"
  tail -30 "$OUT/kernel_bytes.log"
else
  echo "built the kernel bench against src/kernels"
fi
# Each kernel variant waiting for the bench (bench/kernels/variants) still
# applies to src/kernels and compiles: a patch that no longer does is
# regenerated or deleted, not left to fail in a GPU session.
for v in bench/kernels/variants/*.patch; do
  [ -e "$v" ] || continue
  tree=$OUT/variant.$(basename "$v" .patch)
  rm -rf "$tree" && mkdir -p "$tree/src" && cp -r src/kernels "$tree/src/"
  if ! patch -s -d "$tree" -p1 <"$v" >"$tree.log" 2>&1; then
    failed+=("$v")
    echo "FAILED: $v does not apply to src/kernels"
    cat "$tree.log"
    continue
  fi
  ok=1
  for f in $(sed -n 's|^+++ b/\(src/kernels/[^[:space:]]*\.cu\).*|\1|p' "$v"); do
    if ! compile "$tree" "$tree/$f" "$tree.o" "$tree.log"; then
      failed+=("$v")
      ok=0
      echo "FAILED: $f with $v applied"
      tail -30 "$tree.log"
    fi
  done
  [ "$ok" = 1 ] && echo "variant $(basename "$v") applies and compiles"
done
[ ${#failed[@]} -eq 0 ]
