"""Reshaping a trace without touching the file: load scaling, windows, truncation, caps.

Each returns new `Request`s and keeps ids (so results still join back to trace rows).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from testbed.request import Request


def scale_rate(requests: Sequence[Request], factor: float) -> list[Request]:
    """Replay at `factor` times the load: every arrival time divided by `factor`."""
    if not factor > 0:
        raise ValueError(f"trace.rate_scale={factor}: must be > 0")
    return [dataclasses.replace(r, arrival=r.arrival / factor) for r in requests]


def time_window(requests: Sequence[Request], start_s: float, end_s: float) -> list[Request]:
    """Requests arriving in [start_s, end_s), re-based so the window starts at time 0."""
    if start_s < 0 or end_s <= start_s:
        raise ValueError(f"trace window [{start_s}, {end_s}): need 0 <= start_s < end_s")
    return [dataclasses.replace(r, arrival=r.arrival - start_s) for r in requests if start_s <= r.arrival < end_s]


def first_n(requests: Sequence[Request], n: int) -> list[Request]:
    if n < 1:
        raise ValueError(f"trace.max_requests={n}: must be >= 1")
    return list(requests[:n])


def cap_lengths(requests: Sequence[Request], max_prompt: int | None = None,
                max_output: int | None = None) -> list[Request]:
    """Clip prompt and output lengths (prefix hashes beyond the clipped prompt are dropped)."""
    for key, v in (("max_prompt_len", max_prompt), ("max_output_len", max_output)):
        if v is not None and v < 1:
            raise ValueError(f"trace.{key}={v}: must be >= 1")
    out = []
    for r in requests:
        p = min(r.prompt_len, max_prompt) if max_prompt else r.prompt_len
        o = min(r.output_len, max_output) if max_output else r.output_len
        if (p, o) == (r.prompt_len, r.output_len):
            out.append(r)
            continue
        keep = -(-p // r.prefix_block_tokens)
        out.append(dataclasses.replace(r, prompt_len=p, output_len=o, prefix_hashes=r.prefix_hashes[:keep]))
    return out
