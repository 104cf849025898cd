# Token files for the bench scripts, deterministic and written atomically
# (a temporary file, then rename); an existing file is kept. Sourced:
#
#   source bench/lib/tokens.sh
#   random_tokens PATH VOCAB COUNT          # raw .u32: uniform in [0, VOCAB)
#   document_tokens PATH VOCAB COUNT MEAN   # viaduct file, version 2
#
# document_tokens writes random documents behind a start marker (token 0;
# the header records it, so model.attn_mask_type = block_causal can find
# them): each the marker, then tokens in [1, VOCAB), lengths from an
# exponential law of mean MEAN (at least 2). Both use python3 (PY).

random_tokens() {  # path vocab count
  [ -f "$1" ] && return 0
  mkdir -p "$(dirname "$1")"
  "${PY:-python3}" - "$1" "$2" "$3" <<'PYEOF'
import array, os, random, sys
path, vocab, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
r = random.Random(1234)
a = array.array("I", (r.randrange(vocab) for _ in range(n)))
assert a.itemsize == 4
with open(path + ".tmp", "wb") as f:
    f.write(a.tobytes())
os.replace(path + ".tmp", path)
PYEOF
}

document_tokens() {  # path vocab count mean
  [ -f "$1" ] && return 0
  mkdir -p "$(dirname "$1")"
  "${PY:-python3}" - "$1" "$2" "$3" "$4" <<'PYEOF'
import array, os, random, struct, sys
path, vocab, n, mean = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
r = random.Random(1234)
a = array.array("I")
while len(a) < n:
    length = max(2, int(r.expovariate(1.0 / mean)))
    a.append(0)
    a.extend(r.randrange(1, vocab) for _ in range(length - 1))
del a[n:]
header = b"VIADTOK\0" + struct.pack("<IIQQ", 2, 4, n, vocab)
header += b"random documents".ljust(64, b"\0") + struct.pack("<QB", 0, 1)
header = header.ljust(128, b"\0")
with open(path + ".tmp", "wb") as f:
    f.write(header + a.tobytes())
os.replace(path + ".tmp", path)
PYEOF
}
