#!/usr/bin/env bash
# The GPU-scale referee (README "vLLM's own scheduler in simulated time"): the testbed's `vllm` policy in
# lockstep with vLLM's own scheduler in the simulator (policy=vllm_native), on whole traces, on the H100
# preset's cache (26,197 blocks of 16 tokens for Llama-3.1-8B) unless kv.num_blocks says otherwise.
# Run from the repository root with the Python that has vLLM (README "Real vLLM"); each run writes
# referee.md / referee.json / divergent_steps.csv under $OUT/<name>/ (and both runs' usual files).
#   bash experiments/vllm_referee/gpu_scale.sh [name ...]     (no name: every run)
set -euo pipefail
PY=${PY:-python}
OUT=${OUT:-outputs/gpu_scale_referee}
declare -A RUNS=(
  [azure_conv_1x_async]="trace=azure_conv"
  [azure_conv_1x_sync]="trace=azure_conv backend.async_scheduling=false"
  [azure_conv_4x_async]="trace=azure_conv trace.rate_scale=4"
  [azure_conv_4x_sync]="trace=azure_conv trace.rate_scale=4 backend.async_scheduling=false"
  [azure_conv_4x_async_kv4000]="trace=azure_conv trace.rate_scale=4 kv.num_blocks=4000"
  [azure_conv_4x_async_unchunked]="trace=azure_conv trace.rate_scale=4 policy.chunked_prefill=false policy.long_prefill_token_threshold=2048 scheduler.max_model_len=8192"
  [mooncake_async]="trace=mooncake"
  [mooncake_kv8000_async]="trace=mooncake kv.num_blocks=8000"
  [mooncake_kv8000_sync]="trace=mooncake kv.num_blocks=8000 backend.async_scheduling=false"
)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(azure_conv_1x_async azure_conv_1x_sync azure_conv_4x_async azure_conv_4x_sync
                                  azure_conv_4x_async_kv4000 azure_conv_4x_async_unchunked mooncake_async
                                  mooncake_kv8000_async mooncake_kv8000_sync)
for name in "${names[@]}"; do
  args=${RUNS[$name]:?"no run named $name"}
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 $PY -m testbed.app.analysis.referee referee.reference=vllm_native $args output.dir="$OUT/$name" \
    > "$OUT.$name.log" 2>&1 || { echo "$name failed: $OUT.$name.log"; exit 1; }
  sed -n '1,8p' "$OUT/$name/referee.md"
done
