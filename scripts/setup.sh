#!/usr/bin/env bash
# Installs the Debian packages viaduct needs (when missing) and builds it.
# Used by scripts/demo.sh and scripts/test.sh; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(g++ cmake ninja-build libtorch-dev libgloo-dev libtomlplusplus-dev
          nlohmann-json3-dev libgtest-dev googletest fortunes fortunes-min python3
          pkg-config libpcre2-dev zlib1g-dev libsentencepiece-dev
          libpng-dev libjpeg62-turbo-dev libwebp-dev)
# The tests also need PyTorch for the independent cross-check of the models
# (Reference.TorchCrossCheck) and node + npm for the tokenizer tests'
# reference encoder (scripts/fetch_tokenizers.sh), chromium to render the
# run report headless (Report.ChromiumLoadsThePageAndDrawsTheCurves), and
# sentencepiece's spm_train / spm_encode for the SentencePiece tests, and
# Pillow and ImageMagick, the independent encoders of prepare-images' tests
# (tests/data/make_image_fixtures.py, run with /usr/bin/python3), and
# patch, which applies the kernel variants for their compile check
# (CudaSources.CompileWithNvcc); scripts/test.sh asks for them. A node
# already on the PATH (with its npm) is used as it is.
if [ "${VIADUCT_TEST_PACKAGES:-0}" = 1 ]; then
  PACKAGES+=(python3-torch chromium sentencepiece python3-pil imagemagick patch)
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    PACKAGES+=(nodejs npm)
  fi
fi
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if [ "${VIADUCT_TEST_PACKAGES:-0}" = 1 ]; then
  bash scripts/fetch_tokenizers.sh
fi

BUILD_DIR=${VIADUCT_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD_DIR"
