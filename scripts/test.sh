#!/usr/bin/env bash
# README command 2: install, build and run every test (ctest, all labels).
set -euo pipefail
cd "$(dirname "$0")/.."
VIADUCT_TEST_PACKAGES=1 bash scripts/setup.sh
BUILD_DIR=${VIADUCT_BUILD_DIR:-build}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j2 --timeout 900 "$@"
