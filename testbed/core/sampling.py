"""The sampling parameters a server applies to each request, and which sampler path they take.

Why the simulator needs them: vLLM's sampler runs on the GPU after the LM head on every step, over
fp32 logits of shape [sequences, vocabulary], and its cost depends on the parameters. A request that
sets none (every load generator's default: inference-perf sends only model, prompt, max_tokens,
ignore_eos and stream) gets the model's own defaults from its Hugging Face `generation_config.json`
(vLLM's `--generation-config auto`, its default; vllm/config/model.py `get_diff_sampling_param`,
L1327-1368 in 0.15.1: repetition_penalty, temperature, top_k, top_p, min_p), and, where those are
silent too, the API's neutral defaults (vllm/entrypoints/openai/completion/protocol.py L182-188:
temperature 1.0, top_p 1.0, top_k 0, min_p 0.0, repetition_penalty 1.0). So Llama-3.x's
`top_p: 0.9` makes every step sort the whole 128k vocabulary, while a model with no generation
defaults samples at temperature 1 without sorting.

The path (vLLM 0.15.1, vllm/v1/worker/gpu_input_batch.py L344-372 and vllm/v1/sample/sampler.py):
greedy when temperature < 1e-5 (argmax only); otherwise random sampling (temperature, softmax,
exponential noise, argmax), with a full-vocabulary sort when top_p < 1
(ops/topk_topp_sampler.py `apply_top_k_top_p`, L243-283; top_k is then a mask inside the sorted
path), `torch.topk` when only 0 < top_k < vocab (`apply_top_k_only`), a min-p mask when min_p > 0,
and the penalties pass (prompt and output token counts over the vocabulary) when any penalty is set.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Mapping, Optional

SAMPLING_EPS = 1e-5  # vllm/sampling_params.py _SAMPLING_EPS: below it a temperature means greedy

# the keys of a generation_config.json that vLLM turns into request defaults (get_diff_sampling_param)
GENERATION_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters as vLLM's sampler sees them (neutral values: off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, or >= vocab): no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        checks = (("temperature", self.temperature >= 0), ("top_p", 0 < self.top_p <= 1),
                  ("top_k", self.top_k >= -1), ("min_p", 0 <= self.min_p <= 1),
                  ("repetition_penalty", self.repetition_penalty > 0),
                  ("frequency_penalty", -2 <= self.frequency_penalty <= 2),
                  ("presence_penalty", -2 <= self.presence_penalty <= 2))
        for key, ok in checks:
            if not ok:
                raise ValueError(f"sampling.{key}={getattr(self, key)}: out of vLLM's range (vllm/sampling_params.py "
                                 f"_verify_args: temperature >= 0, 0 < top_p <= 1, top_k >= -1, 0 <= min_p <= 1, "
                                 f"repetition_penalty > 0, penalties in [-2, 2])")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def sorts_vocabulary(self) -> bool:
        """The whole-vocabulary sort of `apply_top_k_top_p` runs (random sampling with top_p < 1)."""
        return not self.greedy and self.top_p < 1

    def top_k_only(self, vocab_size: int) -> bool:
        """`apply_top_k_only` (torch.topk, no sort) runs: a top-k without a top-p."""
        return not self.greedy and self.top_p >= 1 and 0 < self.top_k < vocab_size

    @property
    def penalties(self) -> bool:
        """vLLM's penalties pass runs (InputBatch.no_penalties is false)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def path(self, vocab_size: int) -> str:
        """A short name of the sampler's path, for summaries: greedy, random, top_k, sort, each with
        +min_p and +penalties where those passes run."""
        base = ("greedy" if self.greedy else "sort" if self.sorts_vocabulary()
                else "top_k" if self.top_k_only(vocab_size) else "random")
        extras = [name for name, on in (("min_p", not self.greedy and self.min_p > 0), ("penalties", self.penalties))
                  if on]
        return "+".join([base, *extras])

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def generation_defaults(config: Mapping) -> dict:
    """The sampling defaults vLLM takes from a generation_config.json's contents: the keys it reads
    (GENERATION_KEYS) that the file sets to something other than transformers' own defaults (vLLM reads
    `GenerationConfig.to_diff_dict()`, so e.g. a `top_k: 50` or `temperature: 1.0` there changes nothing)."""
    transformers_defaults = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0, "min_p": None}
    return {k: config[k] for k in GENERATION_KEYS
            if k in config and config[k] is not None and config[k] != transformers_defaults[k]}


def resolve(request: Mapping[str, Optional[float]], model_defaults: Optional[Mapping[str, float]],
            generation_config: str = "auto") -> SamplingParams:
    """The parameters vLLM's API server gives a request: what the request sets, else (with
    generation_config="auto", vLLM's default) the model's generation defaults, else the neutral ones
    (generation_config="vllm" skips the model's, as vLLM's `--generation-config vllm`)."""
    if generation_config not in ("auto", "vllm"):
        raise ValueError(f"sampling.generation_config={generation_config!r}: expected 'auto' (the model's "
                         f"generation_config.json defaults, vLLM's default) or 'vllm' (vLLM's neutral defaults)")
    values: dict = {}
    if generation_config == "auto":
        values.update({k: v for k, v in (model_defaults or {}).items() if k in GENERATION_KEYS})
    values.update({k: v for k, v in request.items() if v is not None})
    unknown = sorted(set(values) - {f.name for f in fields(SamplingParams)})
    if unknown:
        raise ValueError(f"sampling: unknown key(s) {unknown}")
    if "top_k" in values:
        values["top_k"] = int(values["top_k"])
    return SamplingParams(**values)
