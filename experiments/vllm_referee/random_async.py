"""Random small scenarios under async scheduling with prefix caching: real vLLM 0.32's AsyncScheduler
against the testbed's `vllm` policy, every step, preemption and admission's prefix hit compared.

Each scenario (seeded) has 2-5 requests, some sharing a 16- or 32-token prefix, prompts of 5-70 tokens,
2-40 output tokens, arriving over the first 6 steps, on a cache of 6-14 blocks of 16 tokens and 2, 3 or 16
sequence slots: small enough to preempt often. Real vLLM runs as `ported_scenarios_real.py` drives it (the
engine's batch queue of 2); ours as `tests/test_vllm_ported.py` does. A scenario one of whose requests
can never fit the cache is left out (the testbed rejects it at arrival; vLLM would wait on it forever), and
so is one with an arrival due in a step that only preempts (tests/test_vllm_ported.py's harness, indexed by
step, merges such a step with the next).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 ~/venv-vllm/bin/python experiments/vllm_referee/random_async.py 150 1

prints the scenarios compared, those identical, and the first differing one in full.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).parent)]


def random_scenario(rng: random.Random, scenario):
    reqs = []
    for i in range(rng.randint(2, 5)):
        shared = rng.choice([0, 0, 16, 32])
        runs = ([(7, shared)] if shared else []) + [(100 + i, rng.randint(5, 70))]
        reqs.append((str(i), runs, rng.randint(2, 40), rng.randint(0, 6)))
    reqs.sort(key=lambda r: r[3])
    return scenario(dict(num_blocks=rng.randint(6, 14), max_num_batched_tokens=256, max_model_len=256,
                         async_scheduling=True, max_num_seqs=rng.choice([2, 3, 16])), reqs)


def main() -> None:
    import ported_scenarios_real as real
    import test_vllm_ported as ours
    import vllm_ported_scenarios as scenarios

    n, seed = int(sys.argv[1]), int(sys.argv[2])
    rng = random.Random(seed)
    model_dir = real.tiny_model_dir()
    compared = same = left_out = 0
    first = None
    for k in range(n):
        name = f"random_{seed}_{k}"
        sc = scenarios.SCENARIOS[name] = random_scenario(rng, scenarios._scenario)
        bs, blocks = sc["config"]["block_size"], sc["config"]["num_blocks"]
        if any(-(-(len(scenarios.prompt_tokens(runs)) + out) // bs) > blocks for _, runs, out, _ in sc["requests"]):
            continue
        try:
            mine, _ = ours.run_ours(name)
        except AssertionError as e:  # the step-indexed harness cannot place an arrival in a merged step
            if "merged" not in str(e):
                raise
            left_out += 1
            continue
        r = real.run_scenario(sc, model_dir, scenarios.prompt_tokens)
        theirs = (r["steps"], r["preempted"], r["admitted"])
        compared += 1
        same += mine == theirs
        if mine != theirs and first is None:
            first = (name, sc, theirs, mine)
    print(f"random async scenarios (seed {seed}): {compared} compared, {same} identical "
          f"({left_out} left out: an arrival due in a preempt-only step, which the harness merges)")
    if first is not None:
        name, sc, theirs, mine = first
        print(f"first difference: {name}\n config: {sc['config']}\n requests: {sc['requests']}\n"
              f" vLLM: {theirs}\n ours: {mine}")


if __name__ == "__main__":
    main()
