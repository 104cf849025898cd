#!/usr/bin/env bash
# Replays the failure table of "runs that survive" (docs/troubleshooting.md, When things go
# wrong) against a viaduct binary on the llama debug model, on CPU: one line
# per case, OK when the run gives the clear error or the right behaviour and
# loses nothing, FAIL otherwise. Exit status: the number of FAIL lines.
#
#   bash bench/faults/failure_replay.sh [path/to/viaduct]     (~1 minute on 2 cores)
set -u
V=$(realpath "${1:-build/viaduct}")
W=$(mktemp -d /tmp/viaduct_replay.XXXXXX)
trap 'rm -rf "$W"' EXIT
cd "$W"
fails=0
ok() { echo "OK   $1"; }
bad() { echo "FAIL $1"; echo "     $2" | head -c 600; echo; fails=$((fails + 1)); }
has() { grep -q -- "$2" "$1"; }

for i in $(seq 1 300); do echo "the quick brown fox $i jumps over the lazy dog"; done > text.txt
"$V" prepare-data --input text.txt --output corpus.tok > /dev/null 2>&1
J="--data.path=corpus.tok --training.eval_interval=0 --training.local_batch_size=2
   --training.seq_len=32 --metrics.progress_bar=false"
lines() { [ -f "$1" ] && wc -l < "$1" || echo 0; }

# 1 disk full while appending metrics.jsonl
mkdir -p r1 && ln -s /dev/full r1/metrics.jsonl
"$V" train $J --job.dump_folder=r1 --training.steps=3 > o1 2>&1; rc=$?
if [ $rc -ne 0 ] && has o1 "No space left on device"; then ok "1 metrics on a full disk: exit $rc, names the file"
else bad "1 metrics on a full disk" "exit $rc: $(tail -2 o1)"; fi

# 2 resume on a full disk keeps the history up to the checkpoint
C="--checkpoint.enable=true --checkpoint.interval=3 --training.steps=6 --job.dump_folder=r2"
(VIADUCT_FAULT_KILL=0:5 "$V" train $J $C; true) > /dev/null 2>&1
before=$(head -3 r2/metrics.jsonl | md5sum)
# (the output goes through a pipe: the size limit also stops writes to files)
(ulimit -f 0; trap '' XFSZ; "$V" train $J $C) 2>&1 | cat > o2
after=$(md5sum < r2/metrics.jsonl)
if [ "$before" = "$after" ]; then ok "2 resume on a full disk: history up to step 3 kept as it was, run stopped: $(grep -m1 -o 'error: cannot write.*' o2)"
else bad "2 resume on a full disk" "metrics.jsonl changed: $(lines r2/metrics.jsonl) lines"; fi

# 3 out-of-range optimizer and schedule values
for kv in lr_scheduler.min_lr_factor=-1 lr_scheduler.min_lr_factor=5 optimizer.weight_decay=-1 \
          optimizer.eps=-1 optimizer.beta1=-0.5 optimizer.beta2=1.5; do
  "$V" train $J --job.dump_folder=r3 --training.steps=2 --$kv > o3 2>&1; rc=$?
  if [ $rc -eq 2 ] && has o3 "out of range"; then ok "3 --$kv: $(grep -o 'is out of range.*' o3)"
  else bad "3 --$kv" "exit $rc: $(tail -1 o3)"; fi
done

# 4 two trainers on one dump folder
"$V" train $J --job.dump_folder=r4 --training.steps=1000000 > o4a 2>&1 & pid=$!
for _ in $(seq 1 200); do [ -s r4/viaduct.lock ] && break; sleep 0.1; done
"$V" train $J --job.dump_folder=r4 --training.steps=2 > o4 2>&1; rc=$?
kill -9 $pid; wait $pid 2> /dev/null
if [ $rc -ne 0 ] && has o4 "pid $pid"; then ok "4 second trainer refused: $(grep -o 'is in use.*pid [0-9]*' o4)"
else bad "4 second trainer" "exit $rc: $(tail -1 o4)"; fi

# 5 --config given a folder
mkdir -p cfgdir
"$V" train --config cfgdir > o5 2>&1; rc=$?
if [ $rc -eq 2 ] && has o5 "is a folder"; then ok "5 --config a folder: exit 2"
else bad "5 --config a folder" "exit $rc: $(tail -1 o5)"; fi

# 6 resume a 2-layer checkpoint with --model.n_layers=1
"$V" train $J --job.dump_folder=r6 --training.steps=2 --checkpoint.enable=true --model.n_layers=2 > /dev/null 2>&1
"$V" train $J --job.dump_folder=r6 --training.steps=4 --checkpoint.enable=true --model.n_layers=1 > o6 2>&1; rc=$?
if [ $rc -eq 2 ] && has o6 "n_layers = 2 in the checkpoint"; then ok "6 resume with fewer layers refused"
else bad "6 resume with fewer layers" "exit $rc: $(tail -1 o6)"; fi

# 7 a failed save on a full disk leaves no tmp folder
(ulimit -f 64; trap '' XFSZ; "$V" train $J --job.dump_folder=r7 --training.steps=2 \
   --checkpoint.enable=true --checkpoint.interval=1) 2>&1 | cat > o7
tmps=$(ls -d r7/checkpoint/*.tmp-* 2> /dev/null | wc -l)
if [ "$tmps" -eq 0 ] && has o7 "needs about"; then ok "7 failed save: tmp folder removed; $(grep -o 'needs about.*' o7)"
else bad "7 failed save" "$tmps tmp folders: $(tail -1 o7)"; fi

# 8 SIGTERM saves and exits 75
"$V" train $J --job.dump_folder=r8 --training.steps=1000000 --checkpoint.enable=true \
   --checkpoint.interval=100000 > o8 2>&1 & pid=$!
for _ in $(seq 1 300); do [ "$(lines r8/metrics.jsonl)" -ge 3 ] && break; sleep 0.1; done
kill -TERM $pid; wait $pid; rc=$?
last=$(tail -1 r8/metrics.jsonl | grep -o '"step":[0-9]*' | cut -d: -f2)
if [ $rc -eq 75 ] && [ -f "r8/checkpoint/step-$last/metadata.json" ]; then ok "8 SIGTERM: exit 75, checkpoint step-$last = last logged step"
else bad "8 SIGTERM" "exit $rc, last step $last: $(tail -1 o8)"; fi

# 9 a model too large for the machine
start=$(date +%s)
"$V" train $J --job.dump_folder=r9 --training.steps=2 --model.flavor=8B --model.n_layers=2000 \
   --training.device=cpu > o9 2>&1; rc=$?
secs=$(( $(date +%s) - start ))
if [ $rc -eq 2 ] && has o9 "cannot fit"; then ok "9 too large: exit 2 after ${secs}s: $(grep -o 'needs about [0-9.]* GiB' o9)"
else bad "9 too large" "exit $rc: $(tail -1 o9)"; fi

# 10 the same key twice on the command line
"$V" train $J --job.dump_folder=r10 --training.steps=2 --training.steps=3 > o10 2>&1; rc=$?
if [ $rc -eq 0 ] && has o10 "twice" && [ "$(lines r10/metrics.jsonl)" -eq 3 ]; then ok "10 a key twice: $(grep -o "gives '--training.steps' twice.*" o10)"
else bad "10 a key twice" "exit $rc: $(tail -1 o10)"; fi

# 11 MASTER_PORT already in use
python3 - "$V" > o11 2>&1 <<'PY'
import os, socket, subprocess, sys
s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen(1); port = s.getsockname()[1]
env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
r = subprocess.run([sys.argv[1], "train", "--data.path=corpus.tok", "--job.dump_folder=r11",
                    "--parallelism.pipeline_parallel_degree=2", "--model.n_layers=2"],
                   env=env, capture_output=True, text=True, timeout=120)
print("rc", r.returncode, "port", port); print(r.stdout + r.stderr)
PY
if has o11 "Address already in use" && ! has o11 "socket.cpp"; then ok "11 port in use: $(grep -o 'port [0-9]*.*in use' o11 | head -1)"
else bad "11 port in use" "$(tail -3 o11)"; fi

exit $fails
