"""The workload `vllm bench serve` sends, rebuilt from its arguments: lengths and arrival times.

Why: to check the simulator against a lab's own `vllm bench serve` run, the simulator must replay the
very requests that run sent. Token ids do not matter to it; the lengths and the send times do, and vLLM
draws both from seeded generators, so the same arguments give the same workload. The rules are ported
from vLLM 0.32 (`vllm/benchmarks/...` below), draw for draw, so that the same seed gives the same numbers
(tests/test_vllm_bench.py checks them against vLLM's own draws, tests/data/*_draws.json).
"""
from __future__ import annotations

import math

import numpy as np

from testbed.core.request import Request


def random_lengths(num_prompts: int, input_len: int, output_len: int, range_ratio: float | tuple[float, float],
                   seed: int, prefix_len: int = 0, num_special_tokens: int = 1) -> tuple[list[int], list[int]]:
    """The random dataset's (prompt lengths as the server counts them, output lengths).

    vLLM draws them in `get_sampling_params` (vllm/benchmarks/datasets/utils.py L62-97) from the
    RandomDataset's own `np.random.default_rng(seed)` (vllm/benchmarks/datasets/datasets.py L579): integers
    uniform on [floor(real*(1-r)), ceil(real*(1+r))] with real = input_len - the tokenizer's special tokens,
    outputs on [max(1, floor(out*(1-r))), max(1, ceil(out*(1+r)))], inputs first. The prompt then holds
    prefix_len + that many tokens (datasets.py L753), and the server adds the special tokens back
    (Llama-3's BOS: `num_special_tokens=1`), which is what the saved `input_lens` count (usage.prompt_tokens,
    vllm/benchmarks/lib/endpoint_request_func.py). With `--ignore-eos`, which the random dataset sets for
    OpenAI-compatible backends (vllm/benchmarks/serve.py L2135-2139), every output is as long as drawn.
    """
    in_ratio, out_ratio = range_ratio if isinstance(range_ratio, tuple) else (range_ratio, range_ratio)
    for what, r in (("input", in_ratio), ("output", out_ratio)):
        if not 0.0 <= r < 1.0:
            raise ValueError(f"random_range_ratio ({what}) = {r}: vLLM requires 0 <= ratio < 1")
    real = max(0, int(input_len) - num_special_tokens)
    in_low, in_high = math.floor(real * (1 - in_ratio)), math.ceil(real * (1 + in_ratio))
    out_low = max(math.floor(output_len * (1 - out_ratio)), 1)
    out_high = max(math.ceil(output_len * (1 + out_ratio)), 1)
    if prefix_len + in_low < 1:
        raise ValueError(f"random_input_len={input_len}: no prompt token is left after {num_special_tokens} special "
                         f"tokens and range ratio {in_ratio} (vLLM refuses it too)")
    rng = np.random.default_rng(seed)
    inputs = rng.integers(in_low, in_high + 1, size=num_prompts)
    outputs = rng.integers(out_low, out_high + 1, size=num_prompts)
    return [prefix_len + int(x) + num_special_tokens for x in inputs], [int(x) for x in outputs]


def send_times(num_prompts: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """When each request is sent, in seconds after the benchmark starts.

    vLLM's `get_request` (vllm/benchmarks/serve.py L402-515), after `np.random.seed(seed)` (serve.py L2013;
    neither the random dataset, which has its own generator, nor ShareGPT's, which shuffles with Python's
    `random`, draws from numpy's global one before it): each gap is Gamma(shape=burstiness,
    scale=1/(rate*burstiness)) (L475-479; burstiness 1 is Poisson), a rate of inf sends all at once, a
    burstiness of inf evenly; the gaps are summed and then scaled so that the last send is at exactly
    num_prompts / rate (L485-497). The first request also waits its gap.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts}: vLLM needs at least one request")
    if not burstiness > 0:
        raise ValueError(f"burstiness={burstiness}: vLLM requires a positive burstiness")
    if not request_rate > 0:
        raise ValueError(f"request_rate={request_rate}: vLLM requires a positive request rate")
    if math.isinf(request_rate):
        return [0.0] * num_prompts
    if math.isinf(burstiness):
        delays = [1.0 / request_rate] * num_prompts
    else:
        state = np.random.RandomState(seed)  # numpy's global generator as np.random.seed(seed) leaves it
        theta = 1.0 / (request_rate * burstiness)
        delays = [state.gamma(shape=burstiness, scale=theta) for _ in range(num_prompts)]
    for i in range(1, len(delays)):
        delays[i] += delays[i - 1]
    if delays[-1] != 0:
        factor = (num_prompts / request_rate) / delays[-1]
        delays = [d * factor for d in delays]
    return [float(d) for d in delays]


def bench_requests(prompt_lens: list[int], output_lens: list[int], arrivals: list[float],
                   source: str = "vllm-bench") -> list[Request]:
    """One Request per prompt, in the order vLLM sends them (its index is the id)."""
    if not len(prompt_lens) == len(output_lens) == len(arrivals):
        raise ValueError(f"{len(prompt_lens)} prompt lengths, {len(output_lens)} output lengths and {len(arrivals)} "
                         "send times: one of each per request is needed")
    return [Request(id=i, arrival=t, prompt_len=int(p), output_len=int(o), source=f"{source}:{i}")
            for i, (p, o, t) in enumerate(zip(prompt_lens, output_lens, arrivals))]
