#!/usr/bin/env bash
# The GPU measurements issues 4 and 5 name, in stages that each fit one 10-minute device call.
#   bash experiments/gpu/run.sh setup       # once per machine: the carried wheels, then this repo (no deps)
#   bash experiments/gpu/run.sh tests       # the CUDA tests (graph capture included) + the engine suite
#   bash experiments/gpu/run.sh bench       # testbed/app/bench.py on the Llama-3-8B shape -> testbed/engine/bench_<gpu>.md
#   bash experiments/gpu/run.sh profile MODEL   # testbed-profile, full grid -> testbed/profiles/<gpu>_<MODEL>.csv
#   bash experiments/gpu/run.sh fidelity MODEL POLICY PROFILE   # 1,000 Azure conv requests, engine vs simulator
# Every stage copies what it wrote into $OUT (when set), so the device tool brings it back.
# Written without a GPU at hand: the first session with one should run `setup` and `tests` first.
set -euo pipefail
cd "$(dirname "$0")/../.."
stage=${1:?stage: setup | tests | bench | profile MODEL | fidelity MODEL POLICY PROFILE}
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower() if torch.cuda.is_available() else 'cpu')")
keep() { if [ -n "${OUT:-}" ]; then cp -r "$@" "$OUT"/; fi; }
case "$stage" in
  setup)
    # .wheels/: made where the registry is reachable, e.g.
    #   pip download --no-deps -d .wheels simpy==4.1.2 hydra-core==1.3.8 omegaconf==2.3.1 \
    #       hydra-joblib-launcher==1.2.0 antlr4-python3-runtime==4.9.3      (antlr4 comes as an sdist)
    # and carried (`carry: [".wheels"]`); torch, transformers, pandas, pyarrow, matplotlib, tqdm, joblib are there.
    python3 -m pip install -q --no-index --no-deps --no-build-isolation .wheels/*
    python3 -m pip install -q --no-deps --no-build-isolation -e .
    python3 -c "import torch, transformers, simpy, hydra; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))"
    ;;
  tests)
    python3 -m pytest -q -p no:cacheprovider tests/test_engine_runner.py tests/test_engine_backend.py 2>&1 | tee engine_tests_$gpu.log
    keep engine_tests_$gpu.log
    ;;
  bench)
    python3 -m testbed.app.bench --out testbed/engine/bench_$gpu.md
    python3 -m testbed.app.bench --no-graphs --out testbed/engine/bench_${gpu}_eager.md
    keep testbed/engine/bench_$gpu.md testbed/engine/bench_${gpu}_eager.md
    ;;
  profile)
    model=${2:?profile MODEL (llama3_2_1b, llama3_8b)}
    testbed-profile model=$model profile.grid=full profile.out=testbed/profiles/${gpu}_$model.csv
    keep testbed/profiles/${gpu}_$model.csv
    ;;
  fidelity)
    model=${2:?MODEL}; policy=${3:?POLICY}; profile=${4:?PROFILE}
    dir=experiments/fidelity_$gpu/${model}_$policy
    testbed-fidelity model=$model policy=$policy cost_model=profile cost_model.profile=$profile \
        trace=azure_conv trace.max_requests=1000 output.dir=$dir
    keep "$dir"
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
