#!/usr/bin/env bash
# Downloads the Debian packages that viaduct's GPU build needs and the GPU
# machine lacks (toml++ and nlohmann-json headers; PCRE2 and zlib headers
# and libraries for the tokenizers, found through CMAKE_INCLUDE_PATH and
# CMAKE_LIBRARY_PATH under $PWD/.deps/usr, not CMAKE_PREFIX_PATH, which would
# also find toml++'s CMake config there and want its compiled library) and GoogleTest's sources (for the CUDA tests,
# -DVIADUCT_GTEST_SOURCE_DIR=$PWD/.deps/usr/src/googletest) into .deps/ at the repository root, on a machine
# with Debian's mirror, so they can be carried to the GPU machine, which has
# no network. bench/lib/gpu_build.sh, the GPU build of every bench script,
# unpacks them there with
#   for f in .deps/*.deb; do dpkg -x "$f" .deps; done
# and builds with -DVIADUCT_EXTRA_INCLUDE=$PWD/.deps/usr/include.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(libtomlplusplus-dev nlohmann-json3-dev googletest libpcre2-dev libpcre2-8-0 zlib1g-dev zlib1g)
mkdir -p .deps
cd .deps
if ! apt-get download "${packages[@]}"; then
  apt-get update >/dev/null
  apt-get download "${packages[@]}"
fi
# Unpack here too, to check the headers are where the build looks.
for f in ./*.deb; do dpkg -x "$f" .; done
# Library links that point at the system's copy (libz.so -> /lib/...) point
# at the unpacked copy instead: the GPU machine's system has another version.
find . -type l -lname '/*' | while read -r l; do
  t=$(readlink "$l")
  [ -e ".$t" ] && ln -sfn "$(realpath --relative-to="$(dirname "$l")" ".$t")" "$l"
done
for h in usr/include/toml++/toml.h usr/include/nlohmann/json.hpp; do
  [ -f "$h" ] || { echo "fetch_deps.sh: $h missing after unpacking" >&2; exit 1; }
done
ls -l ./*.deb
echo "fetch_deps.sh: .deps/ ready ($(du -sh . | cut -f1)); carry '.deps' to the GPU machine"
