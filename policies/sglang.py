"""SGLang's scheduler: prefill first, KV reserved by a decaying new-token ratio, retraction.

Source: SGLang `python/sglang/srt/managers/scheduler.py` (get_next_batch_to_run,
update_running_batch), `schedule_policy.py` (SchedulePolicy, PrefillAdder),
`schedule_batch.py` (retract_decode), v0.4.
Rule, per step:
1. Prefill first. A request whose prompt is being chunked continues first. Then waiting
   requests, in the order of `schedule_policy`, join a prefill batch while the chunk budget
   (`chunked_prefill_size`, capped by the scheduler's budget), the sequence cap and the KV
   allow. KV admission reserves, for every running request, `min(max_new - generated,
   clip_max_new_tokens) * new_token_ratio` future tokens, and for the candidate its
   uncached prompt plus `min(max_new, clip) * ratio`; at most one request is chunked at a
   time. If the prefill batch is not empty, the step is that batch alone.
2. Otherwise a decode step of every running request. If their next tokens do not fit,
   retract (preempt by recompute) the requests with the fewest output tokens (ties: the
   longer prompt first) until the rest fit, and reset the ratio to its initial value.
   After each decode step the ratio decays by `new_token_ratio_decay`, down to its minimum.
Orders: `fcfs`; `lpm`, longest cached prefix first (as SGLang, only while the queue has
at most 128 requests, else fcfs); `dfs_weight`, an approximation of SGLang's radix-tree
DFS weighting: requests grouped by their first prefix hash, larger groups first, FCFS
within a group (requests without prefix hashes form groups of one); `lof`, longest
output first. `max_new` is the trace's output length (SGLang's max_new_tokens).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from testbed.plan import Plan
from testbed.policy import BasePolicy, PolicyKnobs, register

ORDERS = ("fcfs", "lpm", "dfs_weight", "lof")
LPM_QUEUE_LIMIT = 128


@dataclass
class SGLangKnobs(PolicyKnobs):
    name: str = "sglang"
    schedule_policy: str = "fcfs"
    chunked_prefill_size: int = 8192
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001  # (0.7 - 0.1) / 600 decode steps
    clip_max_new_tokens: int = 4096

    def __post_init__(self):
        if self.schedule_policy not in ORDERS:
            raise ValueError(f"policy.schedule_policy={self.schedule_policy!r}: expected one of {ORDERS}")
        if not 0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise ValueError("policy: need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1")
        if self.chunked_prefill_size < 1 or self.clip_max_new_tokens < 1:
            raise ValueError("policy.chunked_prefill_size and policy.clip_max_new_tokens must be >= 1")


@register
class SGLangPolicy(BasePolicy):
    name = "sglang"
    Knobs = SGLangKnobs

    def __init__(self, knobs=None):
        super().__init__(knobs)
        self.ratio = self.knobs.init_new_token_ratio
        self._decode_steps_seen: int | None = None  # steps_done when the last decode plan was made

    def is_steady(self, view) -> bool:
        """No waiting request: decode steps repeat until something arrives or finishes (the
        ratio's decay is caught up from `view.steps_done`, so fast-forwarding stays exact)."""
        return not view.waiting

    def _decay(self, view) -> None:
        if self._decode_steps_seen is not None:
            k = self.knobs
            steps = view.steps_done - self._decode_steps_seen
            self.ratio = max(k.min_new_token_ratio, self.ratio - k.new_token_ratio_decay * steps)
            self._decode_steps_seen = None

    def _order(self, view) -> list:
        waiting = view.waiting
        policy = self.knobs.schedule_policy
        if policy == "lpm" and len(waiting) <= LPM_QUEUE_LIMIT:
            return sorted(waiting, key=lambda s: -view.prefix_hit_tokens(s))  # stable: FCFS among equals
        if policy == "dfs_weight":
            group = lambda s: s.req.prefix_hashes[0] if s.req.prefix_hashes else ("solo", s.req.id)  # noqa: E731
            size = Counter(group(s) for s in waiting)
            return sorted(waiting, key=lambda s: -size[group(s)])
        if policy == "lof":
            return sorted(waiting, key=lambda s: -s.req.output_len)
        return waiting

    def _reserve(self, s) -> float:
        return min(s.req.output_len - s.num_generated, self.knobs.clip_max_new_tokens) * self.ratio

    def schedule(self, view) -> Plan:
        self._decay(view)
        k, bs = self.knobs, view.block_size
        plan = Plan()
        chunk_budget = min(k.chunked_prefill_size, view.token_budget)
        free_tokens = view.free_blocks * bs - sum(self._reserve(s) for s in view.running if not s.is_prefill)
        seqs = len(view.running)
        chunking = False
        for s in view.running:  # the request being chunked continues first
            if s.is_prefill and chunk_budget > 0:
                n = min(s.remaining, chunk_budget)
                if view.blocks_needed(s, n) > view.free_blocks:
                    break
                plan.schedule(s, n)
                chunk_budget -= n
                free_tokens -= n + self._reserve(s)
                chunking = chunking or n < s.remaining
        free_blocks = view.free_blocks - sum(view.blocks_needed(s, n) for s, n in plan.items)
        for s in self._order(view) if view.waiting else ():
            if chunk_budget <= 0 or seqs >= view.max_num_seqs or chunking:
                break
            want = view.num_new_tokens(s)
            n = min(want, chunk_budget)
            need = view.blocks_needed(s, n)
            if want + min(s.req.output_len, k.clip_max_new_tokens) * self.ratio > free_tokens or need > free_blocks:
                break
            plan.schedule(s, n)
            chunk_budget -= n
            free_tokens -= want + self._reserve(s)
            free_blocks -= need
            seqs += 1
            chunking = n < want
        if plan.items:
            return plan
        return self._decode(view, plan)

    def _decode(self, view, plan: Plan) -> Plan:
        decoding = [s for s in view.running if not s.is_prefill]
        need = sum(view.blocks_needed(s, 1) for s in decoding)
        free = view.free_blocks
        if need > free:
            # retract the fewest-output requests first (ties: longer prompt first), as
            # retract_decode; a request still in its (chunked) prefill has none and goes first
            for victim in sorted(view.running, key=lambda s: (s.num_generated, -s.req.prompt_len)):
                if need <= free:
                    break
                if len(decoding) == 1 and victim is decoding[0]:
                    continue  # keep one decode: alone it always fits (longer requests are rejected)
                plan.preempt_request(victim)
                if victim in decoding:
                    decoding.remove(victim)
                    need -= view.blocks_needed(victim, 1)
                free += view.reclaimable_blocks(victim)
            self.ratio = self.knobs.init_new_token_ratio
        for s in decoding[:view.token_budget]:
            plan.schedule(s, 1)
        self._decode_steps_seen = view.steps_done
        return plan
