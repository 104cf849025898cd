# shellcheck shell=bash
# GPU 0's SM clock, power and temperature beside a benchmark's figures, for
# bench scripts on the GPU machine. Sourced (from the repository root):
#
#   source bench/lib/gpu_log.sh
#   gpu_state "idle before the runs" >>"$OUT/gpu.md"   # one reading now
#   with_gpu_log "$OUT/gpu.md" "viaduct round 1" cmd args...
#
# with_gpu_log samples every 200 ms while the command runs and appends one
# line for it: the busy samples' (over 150 W) SM clock mean, min and max,
# mean and max power, and the highest temperature. The command's exit
# status is returned. Without nvidia-smi it only runs the command.
# Environment: PYTHON (python3).

gpu_state() {  # what
  command -v nvidia-smi >/dev/null || { echo "- $1: no nvidia-smi"; return 0; }
  local q
  q=$(nvidia-smi -i 0 --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv,noheader,nounits 2>/dev/null)
  IFS=', ' read -r sm mem pw temp <<<"$q"
  echo "- $1: SM clock $sm MHz, memory clock $mem MHz, power $pw W, $temp C"
}

with_gpu_log() {  # log what cmd...
  local log=$1 what=$2
  shift 2
  local csv pid=""
  csv=$(mktemp)
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi -i 0 --query-gpu=clocks.sm,power.draw,temperature.gpu \
      --format=csv,noheader,nounits -lms 200 >"$csv" 2>/dev/null &
    pid=$!
  fi
  "$@"
  local rc=$?
  if [ -n "$pid" ]; then
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    "${PYTHON:-python3}" - "$csv" "$what" >>"$log" <<'PYEOF'
import statistics, sys
rows = []
for line in open(sys.argv[1]):
    try:
        rows.append([float(x) for x in line.split(",")])
    except ValueError:
        pass
busy = [r for r in rows if r[1] > 150]  # samples while the GPU worked (W)
if busy:
    clk = [r[0] for r in busy]
    pw = [r[1] for r in busy]
    print(f"- {sys.argv[2]}: {len(busy)} busy samples, SM clock mean {statistics.fmean(clk):.0f} "
          f"MHz (min {min(clk):.0f}, max {max(clk):.0f}), power mean {statistics.fmean(pw):.0f} W "
          f"(max {max(pw):.0f}), temperature max {max(r[2] for r in busy):.0f} C")
else:
    print(f"- {sys.argv[2]}: no busy samples")
PYEOF
  fi
  rm -f "$csv"
  return $rc
}
