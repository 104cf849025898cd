#!/usr/bin/env bash
# README command 1: install, build, prepare the fortunes corpus and train the
# default job (configs/llama_debug.toml) on CPU. Extra arguments go to
# `viaduct train`, e.g. --training.steps=50.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${VIADUCT_BUILD_DIR:-build}
if [ ! -f data/fortunes.tok ]; then
  "$BUILD_DIR"/viaduct prepare-data --input /usr/share/games/fortunes \
    --output data/fortunes.tok --val-fraction 0.05
fi
exec "$BUILD_DIR"/viaduct train --config configs/llama_debug.toml "$@"
