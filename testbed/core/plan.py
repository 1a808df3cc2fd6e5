"""What a policy hands back each step, and the rules the loop holds every plan to.

A plan is data, in the shape of vLLM V1's scheduler output: how many tokens each chosen
request computes this step (a prefill chunk, or 1 for a decode) and which running
requests to preempt first. Because the policy never touches KV or progress itself, the
loop can check every plan before applying it, and a broken policy fails loudly, naming
itself and the rule, instead of quietly producing wrong numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from testbed.core.request import RequestState

RECOMPUTE = "recompute"
SWAP = "swap"
PREEMPT_MODES = (RECOMPUTE, SWAP)


@dataclass(slots=True)
class Plan:
    """`items`: (request, tokens this step) pairs; `preempt`: (running request, mode) pairs."""

    items: list[tuple[RequestState, int]] = field(default_factory=list)
    preempt: list[tuple[RequestState, str]] = field(default_factory=list)
    # request id -> KV tokens to have free (uncached) right after that recompute preemption,
    # evicting cached free blocks as the cache evicts (BlockManager.evict_to_free; SGLang's
    # retract_decode evicts 20 tokens per request kept, then for the kept requests' next tokens:
    # sglang 0.5.23 schedule_batch.py L2389-2392, L3459-3461)
    keep_free: dict[int, int] | None = None
    # KV tokens to have free (uncached) before the preemptions, evicting cached free blocks (SGLang's
    # update_running_batch evicts for the whole decode before it retracts: check_decode_mem,
    # sglang 0.5.23 scheduler.py L4469, schedule_batch.py L3432-3449)
    free_first: int = 0
    # the prefix lookups the scheduler made this step, in order, as (waiting request, tokens of its
    # sequence looked up): SGLang's radix tree re-stamps what a lookup matches, which orders its
    # eviction, so the loop replays them on a cache that tracks lookups (BlockManager.touch) before
    # the plan's admissions; None: the admissions' own lookups
    touch: list[tuple[RequestState, int]] | None = None

    def schedule(self, state: RequestState, num_tokens: int) -> None:
        self.items.append((state, num_tokens))

    def preempt_request(self, state: RequestState, mode: str = RECOMPUTE) -> None:
        self.preempt.append((state, mode))

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items or self.preempt)


class PlanError(RuntimeError):
    """A policy returned a plan that breaks one of the loop's rules."""

    def __init__(self, policy: str, rule: str, detail: str):
        self.policy, self.rule, self.detail = policy, rule, detail
        super().__init__(policy, rule, detail)  # args rebuild it: SimPy re-raises a process's error that way

    def __str__(self) -> str:
        return f"policy {self.policy!r} returned an invalid plan: [{self.rule}] {self.detail}"
