"""How tests/data/vllm_bench_serve_random.json was made: a FIXTURE, not a measurement.

Run with a Python that has vLLM 0.32 installed (not the testbed's environment):
    python tests/data/make_vllm_bench_serve_fixture.py tests/data/vllm_bench_serve_random.json

The workload is vLLM's own: `vllm bench serve --dataset-name random --num-prompts 50 --random-input-len 256
--random-output-len 64 --random-range-ratio 0.25 --request-rate 4 --burstiness 0.5 --seed 42` draws its
lengths with `vllm.benchmarks.datasets.utils.get_sampling_params` (seeded as RandomDataset seeds it,
datasets.py L579) and its arrival delays with `vllm.benchmarks.serve.get_request` (after serve.py L2013's
`np.random.seed(seed)`), both called here, so the file's input_lens, output_lens and start_times are what
that command would send (vLLM's exact draws are written beside it, `*_draws.json`). The latencies are SYNTHETIC (plausible Llama-3.1-8B-on-H100 numbers from a small
formula with seeded noise), the summary figures are computed from them by vLLM's own `calculate_metrics`
(serve.py) and assembled as serve.py L1280-1301, L1385-1391 and L2254-2290 assemble `--save-result
--save-detailed --percentile-metrics ttft,tpot,itl,e2el` output.
"""
import asyncio
import json
import sys

import numpy as np
import vllm.benchmarks.serve as serve
from vllm.benchmarks.datasets.utils import get_sampling_params
from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

N, INPUT_LEN, OUTPUT_LEN, RANGE, RATE, BURST, SEED = 50, 256, 64, 0.25, 4.0, 0.5, 42
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


class Tok:  # what get_sampling_params asks of Llama-3.1's tokenizer
    vocab_size = 128256

    def num_special_tokens_to_add(self):
        return 1  # <|begin_of_text|>


def delays() -> list[float]:
    """get_request's cumulative delays: its sleeps, with the clock held at 0 so each sleep is the delay."""
    np.random.seed(SEED)
    slept = []

    async def sleep(s):
        slept.append(s)

    serve.time.time = lambda: 0.0
    serve.asyncio.sleep = sleep

    async def run():
        return [r async for r, _ in serve.get_request(list(range(N)), RATE, BURST)]

    asyncio.run(run())
    return slept


def main(path: str) -> None:
    in_lens, out_lens, _ = get_sampling_params(np.random.default_rng(SEED), N, RANGE, INPUT_LEN, OUTPUT_LEN, Tok())
    prompt_lens = [int(x) + Tok().num_special_tokens_to_add() for x in in_lens]  # the server counts the BOS
    arrive = delays()
    assert len(arrive) == N
    noise = np.random.default_rng(7)
    base = 81234.5  # a perf_counter() reading
    outputs = []
    for i in range(N):
        o = RequestFuncOutput(success=True, prompt_len=prompt_lens[i], output_tokens=int(out_lens[i]))
        o.start_time = base + arrive[i] + float(noise.uniform(0, 4e-4))
        o.ttft = 0.024 + 4.5e-5 * prompt_lens[i] + float(noise.exponential(0.006))
        o.itl = [0.0071 + float(noise.exponential(0.0006)) + (0.012 if noise.random() < 0.03 else 0.0)
                 for _ in range(int(out_lens[i]) - 1)]
        o.latency = o.ttft + sum(o.itl)
        o.generated_text = ""
        outputs.append(o)
    end = max(o.start_time + o.latency for o in outputs)
    duration = end - base + 0.002
    metrics, actual = serve.calculate_metrics(input_requests=None, outputs=outputs, dur_s=duration, tokenizer=None,
                                              selected_percentiles=[99.0], goodput_config_dict={})
    result = {"date": "20261127-120000", "endpoint_type": "openai", "backend": "openai",
              "label": "FIXTURE (synthetic latencies; workload from vLLM 0.32's own generators)",
              "model_id": MODEL, "tokenizer_id": MODEL, "num_prompts": N,
              "fixture_note": "tests/data/make_vllm_bench_serve_fixture.py: not a measurement",
              "request_rate": RATE, "burstiness": BURST, "max_concurrency": None,
              "duration": duration, "completed": metrics.completed, "failed": metrics.failed,
              "total_input_tokens": metrics.total_input, "total_output_tokens": metrics.total_output,
              "request_throughput": metrics.request_throughput, "request_goodput": None,
              "output_throughput": metrics.output_throughput, "total_token_throughput": metrics.total_token_throughput,
              "input_lens": [o.prompt_len for o in outputs], "output_lens": actual,
              "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
              "latencies": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
              "queue_times": [o.client_queue_time for o in outputs],
              "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs],
              "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
              "max_concurrent_requests": metrics.max_concurrent_requests, "rtfx": metrics.rtfx}
    for name in ("ttft", "tpot", "itl", "e2el"):
        result[f"mean_{name}_ms"] = float(getattr(metrics, f"mean_{name}_ms"))
        result[f"median_{name}_ms"] = float(getattr(metrics, f"median_{name}_ms"))
        result[f"std_{name}_ms"] = float(getattr(metrics, f"std_{name}_ms"))
        for p, v in getattr(metrics, f"percentiles_{name}_ms"):
            result[f"p{str(int(p)) if int(p) == p else str(p)}_{name}_ms"] = float(v)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    # vLLM's own draws, exactly, beside the fixture: what the testbed's port must reproduce to the bit
    with open(path.replace(".json", "_draws.json"), "w", encoding="utf-8") as f:
        json.dump({"input_lens": [int(x) for x in in_lens], "output_lens": [int(x) for x in out_lens],
                   "delay_ts": arrive}, f)


if __name__ == "__main__":
    main(sys.argv[1])
