"""The `profile` config section: what `testbed-profile` measures and where it writes it.

Kept apart from `engine/profile.py` (which imports torch) so that the testbed's config
schema can name it without loading the engine. A grid preset (`quick` for a CPU or a
small budget, `full` for a GPU) gives every list; each list can be overridden on its
own (`profile.decode_batches=[1,8,64]`). Points that do not fit (past the model's
context, the KV cache, or `max_kv_tokens`) are skipped and counted.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from testbed.core.bounds import bounded, check_ranges


@dataclass
class ProfileConfig:
    grid: str = "quick"  # quick (CPU, small budgets: the tiny model in well under a minute) or full (GPU)
    out: Optional[str] = None  # the profile file; null: <output.dir>/profile.csv
    repeats: Optional[int] = bounded(None, ge=1)  # timed runs per point, the median is recorded; null: the grid's
    warmup: Optional[int] = bounded(None, ge=0)  # untimed runs before them; null: the grid's
    min_time_s: Optional[float] = bounded(None, ge=0)  # short points repeat until this much was timed (at most 10 x repeats)
    retries: int = bounded(3, ge=0)  # CPU: re-measure a point whose wall time exceeds its CPU time by >10% (another process ran)
    threads: Optional[int] = bounded(None, ge=1)  # torch.set_num_threads on CPU (keep 1 on a small shared machine); null: as is
    progress: Optional[bool] = None  # a tqdm bar; null: only on a terminal, never in CI
    # grid lists; null: the preset's
    prefill_chunks: Optional[list[int]] = bounded(None, ge=1)  # prefill chunk sizes (tokens)...
    prefill_offsets: Optional[list[int]] = bounded(None, ge=0)  # ...at these context offsets (tokens already cached)
    prefill_seqs: Optional[list[int]] = bounded(None, ge=1)  # several fresh chunks in one step: how many...
    prefill_seq_chunks: Optional[list[int]] = bounded(None, ge=1)  # ...of how many tokens each
    decode_batches: Optional[list[int]] = bounded(None, ge=1)  # decode sequences per step...
    decode_contexts: Optional[list[int]] = bounded(None, ge=1)  # ...each with this many tokens of context
    mixed_chunks: Optional[list[int]] = bounded(None, ge=1)  # one prefill chunk (offset 0)...
    mixed_batches: Optional[list[int]] = bounded(None, ge=1)  # ...plus this many decodes...
    mixed_contexts: Optional[list[int]] = bounded(None, ge=1)  # ...of this context
    host_batches: Optional[list[int]] = bounded(None, ge=1)  # loop overhead (plan + complete, no model) for N running decodes
    host_prompts: Optional[list[int]] = bounded(None, ge=1)  # ... and with one prompt of this many tokens admitted per step
    host_policy: str = "vllm"
    max_kv_tokens: Optional[int] = bounded(None, ge=1)  # skip points holding more KV tokens than this; null: the grid's


GRIDS: dict[str, dict] = {
    # The tiny model on a 2-core CPU profiles in about 20 s with these.
    "quick": dict(
        repeats=5, warmup=2, min_time_s=0.03,
        prefill_chunks=[8, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048],
        prefill_offsets=[0, 64, 256, 512, 1024],
        prefill_seqs=[2, 4, 8, 16, 32],
        prefill_seq_chunks=[16, 64, 128, 256],
        decode_batches=[1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256],
        decode_contexts=[16, 32, 64, 128, 192, 256, 384, 512, 1024, 2048],
        mixed_chunks=[16, 64, 256, 1024],
        mixed_batches=[4, 16, 64, 128],
        mixed_contexts=[64, 256, 1024],
        host_batches=[1, 2, 4, 8, 16, 32, 64, 128, 256],
        host_prompts=[16, 256, 1024],
        max_kv_tokens=65536,
    ),
    # A GPU: chunks up to the default token budget, decode batches up to vLLM's max_num_seqs.
    "full": dict(
        repeats=10, warmup=3, min_time_s=0.05,
        prefill_chunks=[16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192],
        prefill_offsets=[0, 256, 1024, 2048, 4096, 8192, 16384],
        prefill_seqs=[2, 4, 8, 16, 32, 64],
        prefill_seq_chunks=[16, 64, 256, 1024],
        decode_batches=[1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 384, 512],
        decode_contexts=[16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768],
        mixed_chunks=[16, 64, 256, 1024, 4096],
        mixed_batches=[4, 16, 64, 128, 256],
        mixed_contexts=[128, 1024, 4096],
        host_batches=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
        host_prompts=[64, 1024, 4096],
        max_kv_tokens=2_000_000,
    ),
}


def resolve(pc) -> ProfileConfig:
    """A complete ProfileConfig: a config node or dict (possibly partial, as `+profile.grid=quick`
    makes one) over the dataclass defaults, with every null filled from the grid preset."""
    from omegaconf import DictConfig, OmegaConf

    data = OmegaConf.to_container(pc, resolve=True) if isinstance(pc, DictConfig) else dict(pc or {})
    known = {f.name for f in fields(ProfileConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"profile: unknown key(s) {unknown}; expected some of {sorted(known)}")
    out = ProfileConfig(**data)
    try:
        preset = GRIDS[out.grid]
    except KeyError:
        raise ValueError(f"profile.grid={out.grid!r}: expected one of {sorted(GRIDS)}") from None
    for key, value in preset.items():
        if getattr(out, key) is None:
            setattr(out, key, list(value) if isinstance(value, list) else value)
    check_ranges(out, "profile")
    return out
