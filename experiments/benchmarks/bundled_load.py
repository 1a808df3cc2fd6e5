"""How long each bundled trace takes to load: the best of `--tries` loads in this process.

    python experiments/benchmarks/bundled_load.py [--tries 3]

The Azure conv trace (19,366 rows) once had a unit test asserting a load under 1 s; a wall-clock
bound measures the machine as much as the loader (tests never depend on how busy the machine is:
tests/test_traces.py checks what the load returns), so the target is printed here beside the figure.
"""
from __future__ import annotations

import argparse
import math
import time

from testbed import traces

TARGETS_S = {"azure_llm_2023/AzureLLMInferenceTrace_conv.csv": 1.0}
BUNDLED = [("azure_llm_2023/AzureLLMInferenceTrace_conv.csv", "azure"),
           ("azure_llm_2023/AzureLLMInferenceTrace_code.csv", "azure"),
           ("mooncake_synthetic/synthetic_trace.jsonl", "mooncake")]


def best_load_s(path: str, fmt: str, tries: int) -> tuple[float, int]:
    best, rows = math.inf, 0
    for _ in range(tries):
        t = time.perf_counter()
        rows = traces.load_trace(path, fmt).rows
        best = min(best, time.perf_counter() - t)
    return best, rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"{'trace':52} {'rows':>7} {'best s':>8}  target")
    for path, fmt in BUNDLED:
        s, rows = best_load_s(path, fmt, args.tries)
        target = TARGETS_S.get(path)
        verdict = "" if target is None else f"< {target:g} s: {'met' if s < target else 'MISSED'}"
        print(f"{path:52} {rows:7d} {s:8.3f}  {verdict}")


if __name__ == "__main__":
    main()
