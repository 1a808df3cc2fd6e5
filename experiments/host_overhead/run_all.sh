#!/usr/bin/env bash
# Every measurement of this folder, into results/ (a log per script in results/logs/), then the fits.
# Each script takes /tmp/quiet.lock exclusively around its timed windows only (bounded waits: common.py).
#   bash experiments/host_overhead/run_all.sh [VENV ...]   (default: /work/venvs/vllm015 /work/venvs/vllm)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$here/results/logs"
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
venvs=("$@")
[ ${#venvs[@]} -gt 0 ] || venvs=(/work/venvs/vllm015 /work/venvs/vllm)
for v in "${venvs[@]}"; do
  tag="$(basename "$v")"
  for s in scheduler output_processor runner async_gap; do
    echo "== $tag $s  (load $(cut -d' ' -f1-3 /proc/loadavg))"
    "$v/bin/python" "$here/$s.py" > "$here/results/logs/${s}_${tag}.log" 2>&1
    grep -E "load average" "$here/results/logs/${s}_${tag}.log" | tail -n 1
  done
  "$v/bin/python" "$here/scheduler.py" --warm > "$here/results/logs/scheduler-warm_${tag}.log" 2>&1
done
if [ -x /work/venvs/pyperf/bin/python ]; then
  /work/venvs/pyperf/bin/python "$here/cpu_speed.py" > "$here/results/logs/cpu_speed.log" 2>&1
fi
python "$here/summarize.py" > /dev/null
