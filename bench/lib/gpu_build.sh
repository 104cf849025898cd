#!/usr/bin/env bash
# The CUDA build of a viaduct tree on the GPU machine, one recipe for every
# bench script. The machine has PyTorch with CUDA as python3 and CMake but no
# network and none of viaduct's other dependencies: those travel in .deps/
# (bench/fetch_deps.sh). The recipe:
#   - unpacks .deps/*.deb into .deps/ once (dpkg -x);
#   - configures with LibTorch from torch.utils.cmake_prefix_path, toml++ and
#     nlohmann-json as headers (VIADUCT_EXTRA_INCLUDE), PCRE2 and zlib through
#     CMAKE_INCLUDE_PATH / CMAKE_LIBRARY_PATH (not CMAKE_PREFIX_PATH, which
#     would find toml++'s CMake config there and want its compiled library),
#     and the tests on when GoogleTest's sources are in .deps
#     (VIADUCT_GTEST_SOURCE_DIR); a tree already configured is not
#     configured again, unless it needs the tests and was configured without;
#   - builds the targets asked for, with Ninja when there is one.
#
# Sourced by a script (from the repository root):
#
#   source bench/lib/gpu_build.sh
#   gpu_build . build-gpu "$OUT/build.log" viaduct_app layer_bench || exit 1
#   gpu_build_has_gtest && targets+=(test_kernels)
#
# or run alone, building build-gpu/ (BUILD) of this tree, log in LOG
# (BUILD/gpu_build.log):
#
#   bash bench/lib/gpu_build.sh viaduct_app test_kernels
#
# gpu_build SOURCE_TREE BUILD_DIR LOG TARGET...: the log gets cmake's and the
# build's output; on a failure the last lines or first errors go to stderr and
# the status is non-zero. Nothing is written to stdout, so a caller may
# capture its own output around it. Environment: DEPS (the repository's .deps,
# also for another SOURCE_TREE), PYTHON (python3), JOBS (nproc); for a
# build of another kind (a sanitizer's, in a BUILD_DIR of its own; read when
# the tree is configured): GPU_BUILD_TYPE (Release), GPU_BUILD_CXX_FLAGS,
# GPU_BUILD_LINK_FLAGS.

GPU_BUILD_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

gpu_build_deps() { echo "${DEPS:-$GPU_BUILD_ROOT/.deps}"; }

# True when GoogleTest's sources travel in .deps (the CUDA kernel tests build).
gpu_build_has_gtest() { [ -f "$(gpu_build_deps)/usr/src/googletest/CMakeLists.txt" ]; }

gpu_build() {  # source_tree build_dir log target...
  if [ $# -lt 4 ]; then
    echo "gpu_build: usage: gpu_build SOURCE_TREE BUILD_DIR LOG TARGET..." >&2
    return 2
  fi
  local src=$1 build=$2 log=$3
  shift 3
  local deps py=${PYTHON:-python3} jobs=${JOBS:-$(nproc)}
  deps=$(gpu_build_deps)
  mkdir -p "$(dirname "$log")"
  : >"$log"
  command -v cmake >/dev/null || { echo "gpu_build: no cmake on PATH" >&2; return 1; }
  if [ ! -f "$deps/usr/include/toml++/toml.h" ] && ls "$deps"/*.deb >/dev/null 2>&1; then
    local f
    for f in "$deps"/*.deb; do dpkg -x "$f" "$deps"; done
  fi
  local wants_tests=0 t
  for t in "$@"; do [[ $t == test_* ]] && wants_tests=1; done
  if [ $wants_tests = 1 ] && ! gpu_build_has_gtest; then
    echo "gpu_build: $* includes tests, but $deps/usr/src/googletest is missing" \
      "(bench/fetch_deps.sh)" >&2
    return 1
  fi
  local configure=0
  if [ ! -f "$build/CMakeCache.txt" ]; then
    configure=1
  elif [ $wants_tests = 1 ] && grep -q '^VIADUCT_BUILD_TESTS:BOOL=OFF' "$build/CMakeCache.txt"; then
    configure=1
  fi
  if [ $configure = 1 ]; then
    local prefix gen=() tests=(-DVIADUCT_BUILD_TESTS=OFF)
    prefix=$("$py" -c 'import torch;print(torch.utils.cmake_prefix_path)') ||
      { echo "gpu_build: $py has no torch" >&2; return 1; }
    [ -f "$build/CMakeCache.txt" ] || { command -v ninja >/dev/null && gen=(-G Ninja); }
    gpu_build_has_gtest &&
      tests=(-DVIADUCT_BUILD_TESTS=ON -DVIADUCT_GTEST_SOURCE_DIR="$deps/usr/src/googletest")
    cmake -S "$src" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE="${GPU_BUILD_TYPE:-Release}" \
      "${tests[@]}" -DCMAKE_CXX_FLAGS="${GPU_BUILD_CXX_FLAGS:-}" \
      -DCMAKE_EXE_LINKER_FLAGS="${GPU_BUILD_LINK_FLAGS:-}" \
      -DCMAKE_PREFIX_PATH="$prefix" -DVIADUCT_EXTRA_INCLUDE="$deps/usr/include" \
      -DCMAKE_INCLUDE_PATH="$deps/usr/include" \
      -DCMAKE_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu" >>"$log" 2>&1 ||
      { echo "gpu_build: cmake failed (log: $log)" >&2; tail -20 "$log" >&2; return 1; }
    grep -q "viaduct: CUDA build" "$log" ||
      echo "gpu_build: WARNING: cmake did not find torch_cuda (a CPU build)" >&2
  fi
  # Ninja goes on past a failing target, so one log names every error.
  local keep_going=()
  grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja' "$build/CMakeCache.txt" && keep_going=(-- -k 0)
  cmake --build "$build" --target "$@" -j "$jobs" "${keep_going[@]}" >>"$log" 2>&1 ||
    {
      echo "gpu_build: build of $* failed (log: $log)" >&2
      grep -m 20 -E "error|Error" "$log" >&2
      return 1
    }
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -uo pipefail
  cd "$GPU_BUILD_ROOT" || exit 1
  [ $# -ge 1 ] ||
    { echo "usage: bash bench/lib/gpu_build.sh TARGET... (BUILD: build-gpu, LOG)"; exit 2; }
  B=${BUILD:-build-gpu}
  t0=$(date +%s)
  gpu_build . "$B" "${LOG:-$B/gpu_build.log}" "$@" || exit 1
  echo "gpu_build: $* built in $B ($(($(date +%s) - t0)) s)"
fi
