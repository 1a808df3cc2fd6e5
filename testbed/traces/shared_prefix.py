"""inference-perf's `shared_prefix` workload, rebuilt request for request.

Why: a real run can only be replayed if its workload is rebuilt with what decides its
timings: the prompt lengths, which prompts share which prefix (the prefix cache turns a
repeated prompt into a few tokens of prefill), the order they are sent in, the rates and the
output lengths. The rules, from kubernetes-sigs/inference-perf
(`inference_perf/datagen/shared_prefix_datagen.py`, `_generate_prompts` and `load_lazy_data`;
`inference_perf/loadgen/load_generator.py` for the stages):

- `num_groups` system prompts of `system_prompt_len` random tokens; each group has
  `num_prompts_per_group` prompts: its system prompt, a space, and a question of
  `question_len` random tokens. The prompt list is shuffled once; request i sends prompt
  i mod (groups x prompts), so from the second cycle on a prompt's whole text is usually
  still cached. (The shuffle's seed is the load generator's and unknown: ours is `seed`.
  Only the first cycle's hits depend on it.)
- Decoding random ids to text and tokenising it again makes prompts longer than nominal
  (about 5% on the H100 runs): `prompt_scale` stretches both parts to the lengths the client
  counted.
- Each stage sends rate x duration requests with exponential gaps rescaled to span the
  stage; the next stage starts once the previous one's requests have finished (plus about
  1 s): here after `stage_gap_s`, long enough for the simulated server to drain.
- Every request asks for exactly `output_len` tokens (the runs set ignore_eos).
"""
from __future__ import annotations

import numpy as np

from testbed.core.request import Request


def shared_prefix_requests(*, num_groups: int, prompts_per_group: int, system_prompt_len: int, question_len: int,
                           output_len: int, stages: list[tuple[float, float]], prompt_scale: float = 1.0,
                           stage_gap_s: float = 60.0, seed: int = 0) -> tuple[list[Request], list[int]]:
    """The requests of every stage in arrival order, and the index of each stage's first request.

    A prompt's KV identity is carried as trace prefix ids (`Request.prefix_hashes`) in blocks of
    the system prompt's length: the group's id, then ids of its own question, so two requests
    share KV exactly where their text is equal."""
    for name, v in (("num_groups", num_groups), ("prompts_per_group", prompts_per_group),
                    ("system_prompt_len", system_prompt_len), ("question_len", question_len),
                    ("output_len", output_len)):
        if v < 1:
            raise ValueError(f"shared_prefix: {name}={v} must be >= 1")
    if not stages:
        raise ValueError("shared_prefix: no load stages")
    if prompt_scale <= 0:
        raise ValueError(f"shared_prefix: prompt_scale={prompt_scale} must be > 0")
    system = max(1, round(system_prompt_len * prompt_scale))
    question = max(1, round(question_len * prompt_scale))
    prompt_len = system + question
    pieces = -(-question // system)  # question ids, each covering `system` tokens (the last one partly)
    prompts = [(g, p) for g in range(num_groups) for p in range(prompts_per_group)]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(prompts))
    hashes = []
    for g, p in (prompts[i] for i in order):
        qid = (g * prompts_per_group + p + 1) * (pieces + 1)
        hashes.append((-(g + 1),) + tuple(qid + j for j in range(pieces)))
    out: list[Request] = []
    starts: list[int] = []
    t0 = 0.0
    for k, (rate, duration) in enumerate(stages):
        if rate <= 0 or duration <= 0:
            raise ValueError(f"shared_prefix: stage {k}: rate={rate}, duration={duration} must be > 0")
        n = max(1, round(rate * duration))
        gaps = rng.exponential(1.0 / rate, n)
        times = np.cumsum(gaps) - gaps[0]
        if times[-1] > 0:
            times *= duration * (n - 1) / n / times[-1]  # n arrivals spanning the stage at its rate
        starts.append(len(out))
        for t in times.tolist():
            i = len(out)
            out.append(Request(i, t0 + t, prompt_len, output_len, prefix_hashes=hashes[i % len(hashes)],
                               prefix_block_tokens=system, source=f"shared_prefix:stage{k}:{i}"))
        t0 += duration + stage_gap_s
    return out, starts
