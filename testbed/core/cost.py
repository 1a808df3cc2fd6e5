"""How long one engine step takes, the only thing the simulator asks of the hardware.

A step's cost is decided by a few features of its batch, not by which requests are in
it; `BatchShape` carries exactly those features, summed by the step loop in one pass.
Cost models are interchangeable behind `CostModel.step_time`: the analytic roofline
(`testbed.sim.roofline`) needs only a model config and a hardware spec; a model fitted
to a profile of the real engine (`testbed.sim.fitted_cost`) plugs into the same interface.
"""
from __future__ import annotations

from copy import copy
from dataclasses import dataclass
from typing import Iterable, Protocol


@dataclass(slots=True)
class BatchShape:
    num_prefill_tokens: int = 0
    num_prefill_seqs: int = 0
    prefill_attn_pairs: float = 0.0  # query-key pairs of all prefill chunks: sum c * (offset + (c + 1) / 2)
    prefill_kv_tokens: int = 0  # KV tokens the prefill chunks attend over: sum (offset + c)
    num_decode_seqs: int = 0
    decode_kv_tokens: int = 0  # KV tokens read by decode sequences: sum of their context lengths
    swap_blocks: int = 0  # KV blocks moved between host and device before this step
    load_blocks: int = 0  # prefix blocks loaded from the host KV tier (kv.offload_gb) before this step
    # speculative decoding (spec_decode.*; all 0 without it): the draft tokens the decode sequences verify in
    # this step's target pass, the KV tokens those extra queries attend (the j-th draft of a sequence whose
    # decode token reads c KV tokens reads c + j), and the decode sequences verifying at least one draft
    num_spec_tokens: int = 0
    spec_kv_tokens: int = 0
    num_spec_seqs: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs

    @property
    def num_seqs(self) -> int:
        return self.num_prefill_seqs + self.num_decode_seqs

    @property
    def kind(self) -> str:
        """"prefill", "decode" or "mixed" (both), as profiles and per-step errors group steps."""
        if self.num_prefill_seqs:
            return "mixed" if self.num_decode_seqs else "prefill"
        return "decode"


def add_drafts(shape: BatchShape, offset: int, k: int) -> None:
    """Add `k` draft tokens verified after the decode token of a sequence with `offset` tokens in its
    cache: k more query tokens, the j-th attending offset + 1 + j KV tokens."""
    shape.num_spec_tokens += k
    shape.spec_kv_tokens += k * (offset + 1) + k * (k + 1) // 2
    shape.num_spec_seqs += 1


def verify_as_decode_rows(shape: BatchShape) -> BatchShape:
    """The step with every draft token counted as one more decode sequence at its own context: how a
    cost model that knows only one-query decode rows (a profile's fit, a decode-attention table) prices
    a verify pass. Exact in tokens and query-key pairs; it reads each sequence's KV once per query."""
    if not shape.num_spec_tokens:
        return shape
    rows = copy(shape)
    rows.num_decode_seqs += shape.num_spec_tokens
    rows.decode_kv_tokens += shape.spec_kv_tokens
    rows.num_spec_tokens = rows.spec_kv_tokens = rows.num_spec_seqs = 0
    return rows


def add_work(shape: BatchShape, work: Iterable[tuple[int, int, bool]]) -> None:
    """Add a batch's (offset, tokens, is_decode) items to `shape`: a decode reads its context plus
    the new token; a prefill chunk of n tokens at offset o (tokens already in the cache) is n query
    tokens over o + n KV tokens, n * (o + (n + 1) / 2) query-key pairs. The rule batch features are
    summed by, for the simulator's step loop and for a real vLLM step alike, so a cost model fitted to
    one is asked the same question by the other. (`StepLoop._apply` inlines this arithmetic in its walk
    over a plan's items: calling it there cost 1-2 s of the main command's 4.5 s simulation; a change
    here must be made there too, and tests/test_bit_identity.py fails on any difference.)"""
    prefill_tokens = prefill_seqs = decode_seqs = decode_kv = prefill_kv = 0
    pairs = 0.0
    for offset, n, decode in work:
        if decode:
            decode_seqs += 1
            decode_kv += offset + 1
        else:
            prefill_tokens += n
            prefill_seqs += 1
            prefill_kv += offset + n
            pairs += n * (offset + (n + 1) / 2)
    shape.num_prefill_tokens += prefill_tokens
    shape.num_prefill_seqs += prefill_seqs
    shape.prefill_attn_pairs += pairs
    shape.prefill_kv_tokens += prefill_kv
    shape.num_decode_seqs += decode_seqs
    shape.decode_kv_tokens += decode_kv


def decode_run_ends(step_time, shape: BatchShape, start: float, k_max: int, next_arrival: float,
                    horizon: float) -> list[float]:
    """The end times of a run of up to `k_max` decode steps from `start`, each step's contexts one token
    longer per sequence than the last: every step that starts before `next_arrival` (the first always
    does) and ends before `horizon`. Ends are summed one step at a time, as the clock would. `shape` is
    the run's first step; it is left as it was. A cost model may offer the same as its own
    `decode_run_ends(shape, start, k_max, next_arrival, horizon)`, in one call (the step loop asks for
    it once per fast-forwarded run); this is the one for any `step_time`."""
    n = shape.num_decode_seqs
    ctx0 = shape.decode_kv_tokens
    ends = []
    t = start
    try:
        for i in range(k_max):
            if i and t >= next_arrival:
                break
            shape.decode_kv_tokens = ctx0 + i * n
            end = t + step_time(shape)
            if end >= horizon:
                break
            ends.append(end)
            t = end
    finally:
        shape.decode_kv_tokens = ctx0
    return ends


class CostModel(Protocol):
    name: str

    def step_time(self, shape: BatchShape) -> float:
        """Seconds for one engine iteration over a batch of this shape."""
