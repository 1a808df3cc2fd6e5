#!/usr/bin/env bash
# The GPU measurements, in one device call (README.md beside this file).
#
#   bash experiments/gpu/run.sh prepare          # here, with PyPI: the wheels the device lacks -> .wheels/
#   bash experiments/gpu/run.sh all              # on the device: setup, tests, bench, physics, profile, fidelity
#   bash experiments/gpu/run.sh all --dry-run    # the same path on a CPU, tiny shapes, in a copy of the
#                                                # device's Python environment (CI runs it; DRY_RUN=1 too)
#
# `all` installs the carried wheels with pip --no-index (the device reaches no registry), then runs the
# stages in priority order, each under a time limit: its own cap, and never past the run's budget
# (GPU_RUN_BUDGET_S, 450 s from the start), so the call ends inside 8 minutes with whatever finished.
# A stage that fails or runs out of time is recorded and the next one runs. On exit (also when killed)
# the results and logs go to $OUT when set, as at most 8 files: summary.md, results.tar.gz (the whole
# results folder) and the main files beside it. Exit status: 0 when every stage passed.
#
# One stage alone (after `setup`, which sets up $GPU_SITE): run.sh setup | tests | bench | physics | profile |
# fidelity.
# Settings (environment): GPU_MODEL (llama3_1_8b) for profile and fidelity, GPU_BENCH_MODEL (llama3_8b),
# GPU_RUN_BUDGET_S (450), GPU_RESULTS (experiments/gpu/results_<gpu>), GPU_SITE (/tmp/testbed_site),
# PY (python3: the device's Python, the one holding torch).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
HERE=experiments/gpu
cmd=${1:-}
[ $# -gt 0 ] && shift
DRY=${DRY_RUN:-0}
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    *) echo "run.sh: unknown option $a" >&2; exit 2 ;;
  esac
done
export DRY_RUN=$DRY PIP_ROOT_USER_ACTION=ignore PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg
PY=${PY:-python3}
SITE=${GPU_SITE:-/tmp/testbed_site}
MODEL=${GPU_MODEL:-llama3_1_8b}
BENCH_MODEL=${GPU_BENCH_MODEL:-llama3_8b}
MAX_LEN=8192  # scheduler.max_model_len of profile and fidelity: the trace's longest request fits, fewer CUDA graphs
if [ "$DRY" = 1 ]; then MODEL=tiny_llama; BENCH_MODEL=tiny_llama; MAX_LEN=2048; export OMP_NUM_THREADS=1; fi
BASE_PY=$(command -v python || command -v python3)  # here: the Python that makes the wheels and the dry run's copy
export PYTHONPATH="$ROOT:$SITE" GPU_SITE=$SITE

gpu_name() {  # h100, h200, ... or cpu
  "$PY" -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower() if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo unknown
}

# ---------------------------------------------------------------------------------------------------
prepare() {
  # Where PyPI is reachable: every wheel in wheels.txt for the device's CPython 3.12 (manylinux x86_64);
  # one published only as a source archive (antlr4-python3-runtime) is built into a wheel here.
  rm -rf .wheels && mkdir -p .wheels
  local plats="" n
  for n in 2_28 2_27 2_17; do plats="$plats --platform manylinux_${n}_x86_64"; done
  plats="$plats --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
  local req
  while read -r req; do
    req=${req%%#*}; req=${req// /}
    [ -z "$req" ] && continue
    # shellcheck disable=SC2086
    if ! "$BASE_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        $plats -d .wheels "$req" 2>/dev/null; then
      "$BASE_PY" -m pip wheel -q --no-deps -w .wheels "$req" || { echo "prepare: no wheel for $req" >&2; return 1; }
    fi
  done < "$HERE/wheels.txt"
  "$BASE_PY" "$HERE/check_wheels.py" .wheels
}

# ---------------------------------------------------------------------------------------------------
# The stages. Each writes into $RES and its log is kept by `all`.
stage_setup() {
  "$PY" "$HERE/check_wheels.py" .wheels || return 1
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$SITE" .wheels/*.whl || return 1
  "$PY" - <<'EOF' || return 1
import platform, sys
import torch, transformers, simpy, hydra, omegaconf, annotated_types, hydra_plugins.hydra_joblib_launcher
import testbed.app.profiling.bench, testbed.app.profiling.profile, testbed.app.analysis.fidelity  # everything the stages import
import os
from pathlib import Path
site = Path(os.environ["GPU_SITE"])
for m in (simpy, hydra, omegaconf, annotated_types):  # the carried ones, not some other copy
    assert Path(m.__file__).resolve().is_relative_to(site.resolve()), f"{m.__name__} from {m.__file__}, not {site}"
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"python {platform.python_version()} ({sys.executable}), torch {torch.__version__}, "
      f"transformers {transformers.__version__}, simpy {simpy.__version__}, hydra {hydra.__version__}; {gpu}")
EOF
}

stage_tests() {
  # the CUDA tests (pytest -m gpu, over the files that mark some: collecting all of tests/ costs a minute
  # here), then the engine's own suite
  local log=$RES/tests.log rc files
  files=$(grep -l "mark.gpu" tests/test_*.py | tr '\n' ' ')
  {
    echo "== pytest -m gpu $files"
    # shellcheck disable=SC2086
    "$PY" -m pytest -p no:cacheprovider -q -rs -m gpu $files
  } > "$log" 2>&1
  rc=$?
  if [ "$DRY" != 1 ] && grep -q "^SKIPPED" "$log"; then
    echo "tests: a CUDA test skipped on a GPU machine" >> "$log"; rc=1
  fi
  local suite="tests/test_engine_runner.py tests/test_engine_backend.py tests/test_engine_replay.py tests/test_plain_llama.py"
  [ "$DRY" = 1 ] && suite="tests/test_engine_runner.py tests/test_plain_llama.py"  # CI's pytest step ran them all
  {
    echo "== pytest (the engine suite) $suite"
    # shellcheck disable=SC2086
    "$PY" -m pytest -p no:cacheprovider -q -rs -m "not gpu and not slow" $suite
  } >> "$log" 2>&1 || rc=1
  grep -E "^(== |[0-9]+ (passed|failed|skipped)|FAILED|ERROR|SKIPPED)" "$log"
  return $rc
}

stage_bench() {
  local args=(--model "$BENCH_MODEL" --out "$RES/bench.md")
  [ "$DRY" = 1 ] && args+=(--device cpu --dtype float32 --small --repeats 3)
  "$PY" -m testbed.app.profiling.bench "${args[@]}"
}

stage_physics() {
  # issue 23's open step-time candidates, timed with plain torch (experiments/kernel_physics/README.md): the
  # GEMM shapes between the kernel tables' grid points beside the tables' price (candidate 8), then vLLM
  # 0.15.1's sampler sequence over large vocabularies (candidate 1)
  local g=() s=(--batches 1 16 64 128 --vocabs 32000 128256 152064 --iters 20)
  [ "$DRY" = 1 ] && g=(--device cpu --small) && s=(--device cpu --batches 2 --vocabs 1000 --iters 2)
  "$PY" experiments/kernel_physics/gemm_gpu_bench.py --out "$RES/gemm_gap.csv" "${g[@]}" || return 1
  "$PY" experiments/kernel_physics/sampler_gpu_bench.py --out "$RES/sampler.csv" "${s[@]}"
}

stage_profile() {
  # A reduced grid: about 85 points of the full grid's kinds (decode batches to 256, chunks to 8192);
  # its time on a GPU is unmeasured (the stage's cap bounds it)
  local grid=(profile.grid=full profile.repeats=5 profile.warmup=2
    "profile.prefill_chunks=[16,64,256,512,1024,2048,4096,8192]" "profile.prefill_offsets=[0,1024,4096]"
    "profile.prefill_seqs=[2,8,32]" "profile.prefill_seq_chunks=[64,256]"
    "profile.decode_batches=[1,8,16,32,64,128,192,256]" "profile.decode_contexts=[128,512,1024,2048,4096]"
    "profile.mixed_chunks=[64,512,2048]" "profile.mixed_batches=[16,64,128]" "profile.mixed_contexts=[512,2048]"
    "profile.host_batches=[1,8,64,256]")
  [ "$DRY" = 1 ] && grid=(backend.device=cpu profile.threads=1 profile.retries=0
    "profile.prefill_chunks=[16,64,256,512]" "profile.prefill_offsets=[0,256]"
    "profile.prefill_seqs=[2,8]" "profile.prefill_seq_chunks=[32]"
    "profile.decode_batches=[1,4,16,32]" "profile.decode_contexts=[64,256,512]"
    "profile.mixed_chunks=[64,256]" "profile.mixed_batches=[4,16]" "profile.mixed_contexts=[128]"
    "profile.host_batches=[1,16]")
  "$PY" -m testbed.app.profiling.profile model="$MODEL" scheduler.max_model_len=$MAX_LEN "${grid[@]}" \
      profile.out="$RES/profile_$MODEL.csv" hydra.run.dir="$RES/logs/hydra_profile"
}

stage_fidelity() {
  # 300 Azure conv requests (the first 84 s of the trace, replayed at twice its rate) on the engine and in
  # the simulator calibrated on the profile just measured
  local profile=$RES/profile_$MODEL.csv dir=$RES/fidelity_$MODEL
  [ -f "$profile" ] || { echo "fidelity: no profile ($profile): the profile stage did not finish"; return 1; }
  local args=(trace.max_requests=300 trace.rate_scale=2)
  [ "$DRY" = 1 ] && args=(backend.device=cpu +profile.threads=1 trace.max_requests=20 trace.rate_scale=20
    trace.max_prompt_len=256 trace.max_output_len=32)
  "$PY" -m testbed.app.analysis.fidelity model="$MODEL" policy=vllm trace=azure_conv scheduler.max_model_len=$MAX_LEN \
      cost_model=profile cost_model.profile="$profile" "${args[@]}" output.dir="$dir" hydra.run.dir="$dir"
}

# ---------------------------------------------------------------------------------------------------
# `all`: the stages under one budget, a summary, and the files for $OUT.
STAGES=(setup tests bench physics profile fidelity)
CURRENT="" STAGE_PID=""
declare -A CAP=([setup]=60 [tests]=120 [bench]=120 [physics]=60 [profile]=150 [fidelity]=600)
declare -A STATUS SECS
FINISHED=0

run_stage() {
  local name=$1 left limit t0 rc
  left=$(( DEADLINE - $(date +%s) - 10 ))  # 10 s kept for the summary and the copy to $OUT
  limit=$(( CAP[$name] < left ? CAP[$name] : left ))
  if [ "$limit" -lt 15 ]; then
    STATUS[$name]="not run: out of time"; SECS[$name]=0
    echo "== $name: not run (out of time)"; return 1
  fi
  echo "== $name (at most ${limit} s) $(date -u +%H:%M:%S)"
  t0=$(date +%s)
  CURRENT=$name
  # in the background, so that a signal to this script is handled at once (bash defers traps while a
  # foreground child runs)
  timeout -k 5 "$limit" bash "$HERE/run.sh" "$name" > "$RES/logs/$name.log" 2>&1 &
  STAGE_PID=$!
  wait "$STAGE_PID"
  rc=$?
  STAGE_PID=""
  SECS[$name]=$(( $(date +%s) - t0 ))
  case $rc in
    0) STATUS[$name]=passed ;;
    124) STATUS[$name]="timed out after ${limit} s" ;;
    137) if [ "${SECS[$name]}" -ge "$limit" ]; then STATUS[$name]="timed out after ${limit} s"
         else STATUS[$name]="killed (exit 137: out of memory?)"; fi ;;
    *) STATUS[$name]="failed (exit $rc)" ;;
  esac
  tail -n 15 "$RES/logs/$name.log" | sed 's/^/   | /'
  echo "== $name: ${STATUS[$name]} in ${SECS[$name]} s"
  [ $rc -eq 0 ]
}

commit_of() {  # GPU_COMMIT as the caller gave it (the device's copy of the tree has no .git), else git's
  if [ -n "${GPU_COMMIT:-}" ]; then echo "$GPU_COMMIT"
  elif git rev-parse --short HEAD >/dev/null 2>&1; then
    echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD 2>/dev/null || echo ' + local changes')"
  else echo "unknown (no .git here; GPU_COMMIT=... names it)"; fi
}

write_summary() {
  local s=$RES/summary.md name
  {
    echo "# GPU run: $(date -u +%Y-%m-%dT%H:%M:%SZ)$([ "$DRY" = 1 ] && echo ' (CPU dry run, tiny shapes)')"
    echo
    echo "commit $(commit_of); $(grep -m1 -E '^python ' "$RES/logs/setup.log" 2>/dev/null || echo 'setup did not report versions')"
    echo "models: bench $BENCH_MODEL, profile and fidelity $MODEL; budget ${BUDGET} s, ran $(( $(date +%s) - START )) s"
    echo
    echo "| stage | result | seconds | what it wrote |"
    echo "|---|---|---|---|"
    for name in "${STAGES[@]}"; do
      local wrote="logs/$name.log"
      case $name in
        tests) wrote="tests.log" ;;
        bench) wrote="bench.md" ;;
        physics) wrote="gemm_gap.csv" ;;
        profile) wrote="profile_$MODEL.csv" ;;
        fidelity) wrote="fidelity_$MODEL/" ;;
      esac
      [ -e "$RES/$wrote" ] || wrote="-"
      echo "| $name | ${STATUS[$name]:-not run} | ${SECS[$name]:-} | $wrote |"
    done
    if [ -f "$RES/tests.log" ]; then
      echo; echo "## tests"; echo; echo '```'
      grep -E "^(== |[0-9]+ (passed|failed|skipped)|FAILED|ERROR|SKIPPED)" "$RES/tests.log"; echo '```'
    fi
    [ -f "$RES/bench.md" ] && { echo; echo "## bench"; echo; cat "$RES/bench.md"; }
    local f
    for f in gemm_gap.csv sampler.csv; do
      [ -f "$RES/$f" ] && { echo; echo "## physics: $f"; echo; echo '```'; cat "$RES/$f"; echo '```'; }
    done
    if [ -f "$RES/logs/profile.log" ]; then
      echo; echo "## profile"; echo; echo '```'; grep -E "^(profile:|fitted|no cost model)" "$RES/logs/profile.log"; echo '```'
    fi
    [ -f "$RES/fidelity_$MODEL/fidelity.md" ] && { echo; echo "## fidelity"; echo; cat "$RES/fidelity_$MODEL/fidelity.md"; }
  } > "$s"
}

finish() {
  [ "$FINISHED" = 1 ] && return
  FINISHED=1
  trap - EXIT INT TERM
  write_summary
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    tar -czf "$OUT/results.tar.gz" -C "$(dirname "$RES")" "$(basename "$RES")"
    local f
    for f in summary.md tests.log bench.md "profile_$MODEL.csv"; do
      [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/"
    done
    [ -f "$RES/fidelity_$MODEL/fidelity.md" ] && cp "$RES/fidelity_$MODEL/fidelity.md" "$OUT/fidelity_$MODEL.md"
  fi
  echo
  awk '/^## /{exit} {print}' "$RES/summary.md"
  echo "results: $RES$([ -n "${OUT:-}" ] && echo "; copied to $OUT: $(cd "$OUT" && ls | tr '\n' ' ')")"
}

on_signal() {
  if [ -n "$STAGE_PID" ]; then
    kill -TERM "$STAGE_PID" 2>/dev/null
    STATUS[$CURRENT]="interrupted"; SECS[$CURRENT]=""
  fi
  echo "run.sh: interrupted"
  exit 130
}

check_out() {  # what comes back from a device call: at most 8 files, 16 MiB each, 2 folders down, plain names
  local n bad
  n=$(find "$OUT" -type f | wc -l)
  bad=$(find "$OUT" -mindepth 1 | sed "s|^$OUT/||" | grep -vE '^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+){0,2}$' || true)
  bad+=$(find "$OUT" -type f -size +16M)
  if [ "$n" -gt 8 ] || [ -n "$bad" ] || [ ! -s "$OUT/summary.md" ] || [ ! -s "$OUT/results.tar.gz" ]; then
    echo "dry run: \$OUT would not come back whole: $n files; $bad" >&2; return 1
  fi
  echo "dry run: \$OUT holds $n files that a device call brings back: $(cd "$OUT" && ls | tr '\n' ' ')"
}

all() {
  START=$(date +%s)
  BUDGET=${GPU_RUN_BUDGET_S:-450}
  DEADLINE=$(( START + BUDGET ))
  local tmp=""
  if [ "$DRY" = 1 ]; then
    # A copy of the device's Python: a fresh venv that sees only the image's packages (image_packages.txt)
    # from this Python's own installation, then the carried wheels, installed with --no-index.
    tmp=$(mktemp -d)
    "$BASE_PY" "$HERE/image_env.py" "$tmp/venv" || return 1
    PY=$tmp/venv/bin/python; SITE=$tmp/site
    export PY GPU_SITE="$SITE" PYTHONPATH="$ROOT:$SITE"
    OUT=${OUT:-$tmp/out}; export OUT
    RES=${GPU_RESULTS:-$tmp/results_cpu_dry_run}
  else
    local gpu
    gpu=$(gpu_name)
    if [ "$gpu" = cpu ] || [ "$gpu" = unknown ]; then
      echo "run.sh all: $PY sees no CUDA device (torch: $gpu); on a CPU, run.sh all --dry-run" >&2; return 2
    fi
    RES=${GPU_RESULTS:-$HERE/results_$gpu}
    [ -z "${GPU_RESULTS:-}" ] && rm -rf "$RES"  # nothing left from an earlier call on a warm machine
  fi
  mkdir -p "$RES/logs" || return 1
  export RES
  trap finish EXIT
  trap on_signal INT TERM
  echo "run.sh all$([ "$DRY" = 1 ] && echo ' --dry-run'): budget $BUDGET s, results in $RES, python $PY"
  local failed=0 name
  for name in "${STAGES[@]}"; do
    if [ "$name" != setup ] && [ "${STATUS[setup]}" != passed ]; then
      STATUS[$name]="not run: setup failed"; failed=1; continue
    fi
    run_stage "$name" || failed=1
  done
  finish
  if [ "$DRY" = 1 ]; then check_out || failed=1; fi
  [ -n "$tmp" ] && [ -z "${KEEP_DRY_RUN:-}" ] && rm -rf "$tmp"
  return $failed
}

case "$cmd" in
  prepare) prepare ;;
  all) all ;;
  setup|tests|bench|physics|profile|fidelity)
    RES=${RES:-${GPU_RESULTS:-$HERE/results_$(gpu_name)}}; mkdir -p "$RES/logs"
    "stage_$cmd" ;;
  *) echo "usage: run.sh prepare | all [--dry-run] | setup | tests | bench | physics | profile | fidelity" >&2; exit 2 ;;
esac
