"""Speculative decoding in the step loop: which draft tokens a step verifies, and how many are accepted.

vLLM V1 (v0.32) schedules a decoding request's sampled token plus its k draft tokens in one step
(`num_tokens_with_spec`, vllm/v1/core/sched/scheduler.py L597 and L704-715), counts them in the token
budget and allocates KV slots for them (`allocate_slots`), trims the drafts when the budget or the
model length runs out (L861-876), and after the verify pass rolls `num_computed_tokens` back by the
rejected drafts (L2110-2128): a request emits its accepted drafts plus one token sampled by the target.

Here the policy plans as without speculation (a decode is 1 token; `SchedulerView.num_new_tokens`
says 1), and the loop widens each decode item of the validated plan by its drafts (`Drafter.widen`).
So every registered policy keeps working unchanged, and its decisions (which requests, which chunks)
are the same as without drafts; only KV pressure can differ, as drafts hold slots. The drafts take
what the policy's plan left of the token budget, in plan order (vLLM serves running requests first,
so there drafts come before new prefill chunks: with a full budget here a prefill chunk keeps its
tokens and the drafts are trimmed), and only the KV blocks free after the plan's allocations (vLLM
would preempt to make room; a trimmed draft costs a little speed, a preemption a policy's decision).
A request's drafts are also capped at its remaining output less one, which keeps it within
max_model_len too (vLLM schedules all k and discards the tokens past max_tokens). The KV slots of
rejected drafts stay with the request, reused by its next step's drafts, as vLLM's blocks do.

Acceptance (standard speculative sampling): each draft token is accepted with probability alpha,
independently, until the first rejection, so P(a >= i) = alpha^i and a step emits a + 1 tokens. One
uniform per verify step, through the inverse of that law, makes a request's i-th verify step's draw
independent of its cap, of the routing and of the order in which requests are served; each request's
stream is seeded from the run's seed and its id, and with acceptance_dist=beta its alpha is drawn
first from Beta(alpha c, (1 - alpha) c) (mean alpha, concentration c).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from testbed.core.cost import BatchShape, add_drafts
from testbed.core.request import RequestState

METHODS = ("none", "ngram", "draft")
ACCEPTANCE_DISTS = ("fixed", "beta")


@dataclass
class DraftStats:
    """vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py): request-steps that verified drafts,
    draft tokens verified, and those accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, other: "DraftStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens

    def summary(self) -> dict:
        """vLLM's figures: mean acceptance length counts the bonus token (1 + accepted per draft)."""
        d, t, a = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {"spec_num_drafts": d, "spec_num_draft_tokens": t, "spec_num_accepted_tokens": a,
                "spec_mean_acceptance_length": 1 + a / d if d else None,
                "spec_draft_acceptance_rate": a / t if t else None}


class Drafter:
    """One loop's speculation: `num_speculative_tokens` drafts per decode, accepted at `acceptance_rate`."""

    def __init__(self, num_speculative_tokens: int, acceptance_rate: float, acceptance_dist: str = "fixed",
                 acceptance_concentration: float = 10.0, seed: int = 0):
        if num_speculative_tokens < 1:
            raise ValueError(f"spec_decode.num_speculative_tokens={num_speculative_tokens}: must be >= 1")
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"spec_decode.acceptance_rate={acceptance_rate}: must be in [0, 1]")
        if acceptance_dist not in ACCEPTANCE_DISTS:
            raise ValueError(f"spec_decode.acceptance_dist={acceptance_dist!r}: expected one of {', '.join(ACCEPTANCE_DISTS)}")
        if not acceptance_concentration > 0:
            raise ValueError(f"spec_decode.acceptance_concentration={acceptance_concentration}: must be > 0")
        self.k = num_speculative_tokens
        self.alpha = acceptance_rate
        self.beta = acceptance_dist == "beta" and 0.0 < acceptance_rate < 1.0  # a Beta at 0 or 1 is that point
        self.concentration = acceptance_concentration
        self.seed = seed
        self.stats = DraftStats()
        self._streams: dict[int, tuple[random.Random, float]] = {}

    # --- the plan ---------------------------------------------------------------------------
    def widen(self, items: list[tuple[RequestState, int]], budget: int, kv, shape: BatchShape) -> list[int] | None:
        """The drafts of each applied plan item (0 for a prefill chunk), with their KV allocated and their
        work added to `shape`; None when no item verifies a draft. `budget`: tokens the plan left."""
        drafts = None
        bs = kv.block_size if kv is not None else 0
        for i, (s, n) in enumerate(items):
            if budget <= 0:
                break
            k = self._cap(s, n, budget)
            if k and kv is not None:  # only the blocks free after the plan's own allocations
                room = (len(s.blocks) + kv.num_free_blocks) * bs - s.num_computed - 1
                k = min(k, room)
                if k > 0:
                    kv.allocate(s, 1 + k)
            if k > 0:
                if drafts is None:
                    drafts = [0] * len(items)
                drafts[i] = k
                budget -= k
                add_drafts(shape, s.num_computed, k)
        return drafts

    def _cap(self, s: RequestState, n: int, budget: int) -> int:
        """Drafts a planned item can verify: a decode's k, within its remaining output and the budget."""
        if n != 1 or s.num_generated == 0 or s.num_computed + 1 != s.req.prompt_len + s.num_generated:
            return 0
        return min(self.k, s.req.output_len - s.num_generated - 1, budget)

    def predict(self, items, budget: int, offsets, shape: BatchShape) -> None:
        """Add to `shape` the drafts `widen` would give these planned items (KV not checked)."""
        for (s, n), offset in zip(items, offsets):
            if budget <= 0:
                return
            k = self._cap(s, n, budget)
            if k > 0:
                budget -= k
                add_drafts(shape, offset, k)

    # --- the verify pass ----------------------------------------------------------------------
    def accepted(self, s: RequestState, k: int) -> int:
        """Draft tokens of `s` accepted in this verify step, of `k`: min(k, G), P(G >= i) = alpha^i."""
        stream = self._streams.get(s.req.id)
        if stream is None:
            rng = random.Random(self.seed * (1 << 64) + s.req.id)
            alpha = rng.betavariate(self.alpha * self.concentration, (1 - self.alpha) * self.concentration) \
                if self.beta else self.alpha
            stream = self._streams[s.req.id] = (rng, alpha)
        rng, alpha = stream
        u = 1.0 - rng.random()  # in (0, 1]: one draw per step, whatever k is
        if alpha >= 1.0:
            a = k
        elif alpha <= 0.0:
            a = 0
        else:
            a = min(k, int(math.log(u) / math.log(alpha)))
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += k
        st.num_accepted_tokens += a
        return a

    def forget(self, s: RequestState) -> None:
        """A finished request's stream is dropped (a preempted one keeps its place in it)."""
        self._streams.pop(s.req.id, None)
