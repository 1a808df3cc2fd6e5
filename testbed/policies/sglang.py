"""SGLang's scheduler: prefill first, KV reserved by a decaying new-token ratio, retraction.

Source: SGLang `python/sglang/srt/managers/scheduler.py` (get_next_batch_to_run,
get_new_batch_prefill, update_running_batch), `schedule_policy.py` (SchedulePolicy,
PrefillAdder), `schedule_batch.py` (retract_decode), v0.4 onwards.
Rule, per step (`max_new` is the trace's output length, SGLang's max_new_tokens):
1. Prefill first. The request whose prompt is being chunked continues first (its next
   chunk, if its KV blocks fit). Then waiting requests, in the order of `schedule_policy`,
   join the prefill batch while the chunk budget (`chunked_prefill_size`, capped by the
   step's token budget), the sequence cap and the KV allow. KV admission (PrefillAdder):
   the free KV in tokens, less `min(max_new - generated, clip_max_new_tokens) *
   new_token_ratio` for every running (decoding) request, must exceed the candidate's
   uncached prompt plus `min(max_new - generated, clip_max_new_tokens)` (its own output
   at full weight, as `add_one_req`); an admitted request takes both off the remainder,
   a chunked one only its chunk (its output is reserved with its last chunk). The first
   candidate that does not fit stops admission. At most one request is chunked at a time:
   once one is truncated, nothing else joins. If the prefill batch is not empty, the step
   is that batch alone (running requests do not decode in it).
2. Otherwise a decode step of every running request. If their next tokens' KV does not
   fit, retract (preempt by recompute) running requests with the fewest output tokens
   (ties: the longer prompt first, as retract_decode's sort) until the rest fit; the last
   decoding request is never retracted. After a decode step without retraction the ratio
   decays by `new_token_ratio_decay`, down to `min_new_token_ratio`; when nothing runs
   (the scheduler idles) it is reset to `init_new_token_ratio`.
   Retraction and the ratio, `retract_decode_steps` = 0 (default): retract until the
   remaining requests' next token fits, and reset the ratio to its initial value.
   `retract_decode_steps` = N > 0 is SGLang's exact rule (N = 20 there): retract until
   the remaining requests can each grow N tokens, and set the ratio to
   `min(1, (tokens generated + N * requests) / (sum of their max_new + 1))`.
Orders (`schedule_policy`): `fcfs`; `lpm`, longest cached prefix first (stable, FCFS
among equals; as SGLang, only while the queue holds at most 128 requests, else fcfs);
`dfs_weight`; `lof`, longest max_new first.
`dfs_weight`, an approximation: SGLang walks the radix tree depth first, visiting
children in descending weight (the number of waiting requests below a node) and placing
each node's own requests after its children. We build that tree from the trace's prefix
ids instead of the radix cache: requests are grouped by their first prefix id, each group
by its second id, and so on; larger groups come first, ties in arrival order, and a
request whose ids end at a node follows that node's subgroups. A request without prefix
ids is a group of one. SGLang places a request at its *cached* match, so requests that
share a not-yet-cached prefix are not grouped there; here they are, since the first of
them to run caches the prefix for the rest.
Choices: SGLang's in-batch prefix-caching deprioritization (lpm), `max_prefill_tokens`
and page rounding are not modelled; a request stalled mid-prefill holds no output and so
is the first retraction victim (in SGLang a chunked request is not in the decode batch).
"""
from __future__ import annotations

from dataclasses import dataclass

from testbed.core.bounds import bounded
from testbed.core.plan import Plan
from testbed.core.policy import BasePolicy, PolicyKnobs, register

ORDERS = ("fcfs", "lpm", "dfs_weight", "lof")
LPM_QUEUE_LIMIT = 128  # SGLang falls back to fcfs above this many waiting requests


@dataclass
class SGLangKnobs(PolicyKnobs):
    name: str = "sglang"
    schedule_policy: str = "fcfs"
    chunked_prefill_size: int = bounded(8192, ge=1)
    init_new_token_ratio: float = bounded(0.7, ge=0, le=1)
    min_new_token_ratio: float = bounded(0.1, ge=0, le=1)
    new_token_ratio_decay: float = bounded(0.001, ge=0)  # (0.7 - 0.1) / 600 decode steps
    clip_max_new_tokens: int = bounded(4096, ge=1)
    retract_decode_steps: int = bounded(0, ge=0)  # 0: retract until the next token fits, ratio back to init; N: SGLang's rule

    def __post_init__(self):
        super().__post_init__()
        if self.schedule_policy not in ORDERS:
            raise ValueError(f"policy.schedule_policy={self.schedule_policy!r}: expected one of {ORDERS}")
        if self.min_new_token_ratio > self.init_new_token_ratio:
            raise ValueError(f"policy.min_new_token_ratio={self.min_new_token_ratio}: must be <= "
                             f"policy.init_new_token_ratio={self.init_new_token_ratio}")
        if self.retract_decode_steps < 0:
            raise ValueError(f"policy.retract_decode_steps={self.retract_decode_steps}: must be >= 0")


def dfs_weight_order(waiting) -> list:
    """SGLang's dfs_weight order over a tree built from the requests' prefix ids."""
    out: list = []

    def visit(group: list, depth: int) -> None:
        while True:
            here, children = [], {}
            for s in group:
                ids = s.req.prefix_hashes
                if len(ids) > depth:
                    children.setdefault(ids[depth], []).append(s)
                elif depth == 0:
                    children[("solo", s.req.id)] = [s]  # no prefix ids: a group of its own
                else:
                    here.append(s)
            if len(children) == 1 and not here:  # one shared id: go deeper without recursing
                group = next(iter(children.values()))
                if len(group) == 1:
                    out.append(group[0])
                    return
                depth += 1
                continue
            for child in sorted(children.values(), key=len, reverse=True):  # stable: earlier group first
                if len(child) == 1:
                    out.append(child[0])
                else:
                    visit(child, depth + 1)
            out.extend(here)
            return

    if waiting:
        visit(list(waiting), 0)
    return out


@register
class SGLangPolicy(BasePolicy):
    name = "sglang"
    Knobs = SGLangKnobs

    def __init__(self, knobs=None):
        super().__init__(knobs)
        self.ratio = self.knobs.init_new_token_ratio
        self._decode_mark: int | None = None  # steps_done when the last unretracted decode plan was made

    def is_steady(self, view) -> bool:
        """No waiting request: decode steps of every running request repeat until something
        arrives or finishes (the ratio's decay is caught up from `view.steps_done`, so a
        fast-forwarded run decays it exactly as step-by-step planning would)."""
        return not view.waiting

    def _catch_up(self, view) -> None:
        """Decay the ratio once per decode step completed since the last decode plan."""
        if self._decode_mark is not None:
            k = self.knobs
            steps = view.steps_done - self._decode_mark
            self.ratio = max(k.min_new_token_ratio, self.ratio - k.new_token_ratio_decay * steps)
            self._decode_mark = None

    def _order(self, view) -> list:
        waiting = view.waiting
        policy = self.knobs.schedule_policy
        if policy == "lpm" and len(waiting) <= LPM_QUEUE_LIMIT:
            return sorted(waiting, key=lambda s: -view.prefix_hit_tokens(s))
        if policy == "dfs_weight":
            return dfs_weight_order(waiting)
        if policy == "lof":
            return sorted(waiting, key=lambda s: -s.req.output_len)
        return waiting

    def _max_new(self, s) -> int:
        return min(s.req.output_len - s.num_generated, self.knobs.clip_max_new_tokens)

    def schedule(self, view) -> Plan:
        self._catch_up(view)
        plan = self._prefill(view)
        if plan.items:
            return plan
        if not view.running:  # idle: SGLang resets the ratio
            self.ratio = self.knobs.init_new_token_ratio
            return plan
        return self._decode(view, plan)

    def _prefill(self, view) -> Plan:
        k = self.knobs
        plan = Plan()
        chunk_budget = min(k.chunked_prefill_size, view.token_budget)
        free_blocks = view.free_blocks
        # PrefillAdder's rem_total_tokens: free KV less the running requests' expected outputs
        rem_total = free_blocks * view.block_size - sum(
            self._max_new(s) * self.ratio for s in view.running if not s.is_prefill)
        chunking = False
        for s in view.running:  # the chunked request continues first
            if not s.is_prefill:
                continue
            chunking = True  # whatever happens to it, no second request is chunked
            n = min(s.remaining, chunk_budget)
            need = view.blocks_needed(s, n)
            if n <= 0 or need > free_blocks:
                return plan  # its next chunk waits for KV: no new work joins, decode instead
            plan.schedule(s, n)
            chunk_budget -= n
            free_blocks -= need
            if n < s.remaining:
                return plan  # still truncated: the chunk budget is spent on it
            rem_total -= n + self._max_new(s)
            chunking = False
        if chunking or not view.waiting:
            return plan
        seqs = len(view.running)
        for s in self._order(view):
            if chunk_budget <= 0 or seqs >= view.max_num_seqs:
                break
            want = view.num_new_tokens(s)
            total = want + self._max_new(s)
            if total > rem_total:
                break  # NO_TOKEN
            n = min(want, chunk_budget)
            need = view.blocks_needed(s, n)
            if need > free_blocks:
                break
            plan.schedule(s, n)
            seqs += 1
            chunk_budget -= n
            free_blocks -= need
            if n < want:  # chunked: its output is reserved with its last chunk
                break
            rem_total -= total
        return plan

    def _decode(self, view, plan: Plan) -> Plan:
        k = self.knobs
        decoding = [s for s in view.running if not s.is_prefill]
        free = view.free_blocks
        if sum(view.blocks_needed(s, 1) for s in decoding) > free:
            steps = max(1, k.retract_decode_steps)
            need = sum(view.blocks_needed(s, steps) for s in decoding)
            # fewest output tokens first, ties: longer prompt first (retract_decode's sort);
            # a request stalled mid-prefill has no output yet and goes first
            for victim in sorted(view.running, key=lambda s: (s.num_generated, -s.req.prompt_len)):
                if need <= free:
                    break
                if len(decoding) == 1 and victim is decoding[0]:
                    continue  # keep the last decode: alone it always fits (longer requests are rejected)
                plan.preempt_request(victim)
                if victim in decoding:
                    decoding.remove(victim)
                    need -= view.blocks_needed(victim, steps)
                free += view.reclaimable_blocks(victim)
            if k.retract_decode_steps:
                generated = sum(s.num_generated for s in decoding)
                max_new = sum(s.req.output_len for s in decoding)
                self.ratio = min(1.0, (generated + k.retract_decode_steps * len(decoding)) / (max_new + 1))
            else:
                self.ratio = k.init_new_token_ratio
            self._decode_mark = None  # SGLang does not decay the ratio on a retracting step
        else:
            self._decode_mark = view.steps_done
        for s in decoding[:view.token_budget]:
            plan.schedule(s, 1)
        return plan
