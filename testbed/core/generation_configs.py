"""The sampling defaults of well-known checkpoints' `generation_config.json`, for runs that carry only
a config.json.

Why: vLLM applies a model's generation defaults to every request that sets none (testbed.core.sampling),
and which sampler path runs is part of a step's time. A checkpoint folder holds its generation_config.json
(read by `testbed.core.specs.ModelSpec.from_hf_config`), but real-run records (inference-perf's, under
../shared/calibration) name the model and keep only its config.json. This table holds the sampling keys
vLLM reads (repetition_penalty, temperature, top_k, top_p, min_p; those equal to transformers' defaults
dropped, as vLLM's `to_diff_dict` does) of the latest Hugging Face revision each file had in early 2026.
Sources: public copies of each file, collected with their provenance and confidence in
experiments/kernel_physics/generation_configs.md. A model absent here is looked up nowhere else: it
gets vLLM's neutral defaults (temperature 1.0, no top-p/top-k), and the run's summary says so.
"""
from __future__ import annotations

from typing import Optional

_LLAMA = {"temperature": 0.6, "top_p": 0.9}  # every Meta Llama 2/3/3.1/3.2/4 checkpoint listed below
_QWEN3 = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
NONE: dict = {}  # the file sets no sampling key (bos/eos ids only, or do_sample alone)

KNOWN: dict[str, dict] = {
    "meta-llama/Llama-2-7b-hf": _LLAMA,
    "meta-llama/Llama-2-13b-hf": _LLAMA,
    "meta-llama/Llama-2-70b-hf": _LLAMA,
    "meta-llama/Meta-Llama-3-8B": _LLAMA,
    "meta-llama/Meta-Llama-3-8B-Instruct": _LLAMA,
    "meta-llama/Llama-3.1-8B": _LLAMA,
    "meta-llama/Meta-Llama-3.1-8B": _LLAMA,
    "meta-llama/Llama-3.1-8B-Instruct": _LLAMA,
    "meta-llama/Meta-Llama-3.1-8B-Instruct": _LLAMA,
    "meta-llama/Llama-3.1-70B": _LLAMA,
    "meta-llama/Llama-3.1-70B-Instruct": _LLAMA,
    "meta-llama/Meta-Llama-3.1-70B-Instruct": _LLAMA,
    "meta-llama/Llama-3.2-1B": _LLAMA,
    "meta-llama/Llama-3.2-1B-Instruct": _LLAMA,
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": _LLAMA,
    "Qwen/Qwen2.5-7B-Instruct": {"repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20},
    "Qwen/Qwen3-8B": _QWEN3,
    "Qwen/Qwen3-14B": _QWEN3,
    "Qwen/Qwen3-32B": _QWEN3,
    "Qwen/Qwen3-30B-A3B": _QWEN3,
    "openai/gpt-oss-20b": NONE,
    "openai/gpt-oss-120b": NONE,
    # expected to set no sampling key (Mistral AI's and these base checkpoints' files carry token ids only);
    # no public copy was found to confirm it (generation_configs.md: confidence low to medium)
    "codellama/CodeLlama-34b-Instruct-hf": NONE,
    "mistralai/Mixtral-8x7B-v0.1": NONE,
    "mistralai/Mixtral-8x7B-Instruct-v0.1": NONE,
    "mistralai/Mistral-Nemo-Instruct-2407": NONE,
    "01-ai/Yi-34B": NONE,
}


def known_generation_defaults(model_id: Optional[str]) -> Optional[dict]:
    """The sampling defaults of `model_id` (a Hugging Face id, matched without regard to case; a bare
    name such as `Qwen2.5-7B-Instruct` matches the id it ends), or None when the model is not known."""
    if not model_id:
        return None
    key = model_id.strip().rstrip("/").lower()
    for hf_id, defaults in KNOWN.items():
        if key == hf_id.lower() or key == hf_id.split("/", 1)[1].lower():
            return dict(defaults)
    return None


def model_generation_defaults(generation_config: Optional[dict], hf_id: Optional[str],
                              name: Optional[str]) -> tuple[dict, str]:
    """A model's sampling defaults and where they came from: its own `generation_config` (a preset's, or
    the generation_config.json read beside its config.json), else the known checkpoint named by `hf_id`
    or `name`, else none (vLLM's neutral defaults then apply)."""
    if generation_config is not None:
        return dict(generation_config), "the model's generation_config"
    for key in (hf_id, name):
        known = known_generation_defaults(key)
        if known is not None:
            return known, f"generation_config.json of {key} (testbed.core.generation_configs)"
    return {}, f"none known for {hf_id or name!r}: vLLM's neutral defaults"
