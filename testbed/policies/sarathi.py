"""Sarathi-Serve's stall-free batching, as its scheduler ships.

Source: Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference with
Sarathi-Serve", OSDI 2024 (Algorithm 1), and its code, microsoft/sarathi-serve at commit
96f9911 (cited below as file:line, paths under sarathi/):
  SS = core/scheduler/sarathi_scheduler.py, BS = core/scheduler/base_scheduler.py,
  BM = core/block_space_manager/base_block_space_manager.py (the Sarathi block manager is
  the vLLM one, sarathi_block_space_manager.py:6-7 and vllm_block_space_manager.py:12-13:
  a request's initial blocks are its whole known sequence), CF = config/config.py.

Checked step by step against Sarathi-Serve's real SarathiScheduler, block space manager and
sequence manager (imported from the source, no model): experiments/sarathi_referee/ and
tests/test_sarathi_referee.py, identical on every scenario where Sarathi-Serve finishes.

Each step, with `chunk` = `token_budget` (Sarathi's `chunk_size`, CF:246-248):
1. Running requests are sorted by arrival, oldest first (SS:124; FCFS priority
   `now - arrival_time`, core/policy.py:15-34) and walked in that order (SS:130-160). A
   request whose prompt is not done is set aside for pass 2 (SS:137-139). A decode first
   needs one free block, whether or not its token opens a new block (`can_append_slot` is
   `free > 0`, BM:94-96; the block is taken only when needed, BM:98-107); while none is free
   it preempts, by recompute, the LAST request of the not-yet-walked rest of the sorted
   list: the newest, decode or partial prefill alike (SS:141-146); when that rest is empty
   it preempts itself (SS:147-152). A decode takes one token, outside the chunk (SS:157).
2. Each set-aside partial prefill, in order, takes min(rest of its prompt, chunk - tokens
   so far) (SS:91-94, 165-187); with nothing left of the chunk it stays running, unscheduled
   (SS:177-179). Its blocks were all taken at admission, so it never preempts.
3. Waiting requests, FCFS (preempted ones go back to the head, BS:116-122, which is arrival
   order again since victims are always the newest running), are admitted while: the WHOLE
   known sequence fits with a watermark left free, `free - blocks(known) >= int(0.01 *
   num_blocks)` (BM:57, 66, 76-82; the watermark is never passed in, BS:38-43), else stop
   (SS:208-212); fewer than `max_num_seqs` requests are running, counting every one kept
   above (SS:216-217; CF:179-184, default 128); and the chunk has room left, else stop
   (SS:220-225). It takes min(its known length, chunk - tokens so far) now (SS:227-235) and
   ALL its prompt's blocks at once (`allocate`, BM:84-92). After preemptions the head of
   the queue is the step's oldest victim (BS:122), which the scheduler still sees as it was:
   it is reset for recompute only after scheduling, by the sequence manager (sequence.py:
   175-182, core/sequence_manager/base_sequence_manager.py:32-36, 70-71). So a decode victim
   reads a chunk of 0 and admission stops (SS:224-225): nothing is admitted; a partial-
   prefill victim that fits again is re-admitted at once with a chunk of min(what its prompt
   had left, chunk - tokens) (SS:91-94), computed from token 0.
   The loop cannot preempt and schedule one request in one plan, so a step that preempts
   is planned twice: the preemptions alone, then (the loop asks again at once, in the same
   step) the rest, with this step's victims remembered for the admission rule above.
A recompute-preempted request comes back with its generated tokens folded into its prompt
(core/datatypes/sequence.py:175-182) and is a prefill until all of them are recomputed,
even when one token is left (its `remaining` then looks like a decode's: the policy keeps
the target per request).

The step loop allocates blocks per chunk, so the policy counts Sarathi's free blocks as the
loop's free blocks less the blocks running partial prefills will still take (Sarathi took
them at admission); a partial-prefill victim gives back both.

Not modelled (and where this differs from Sarathi-Serve):
- Pipeline parallelism (ParallelConfig defaults to 2 stages, CF:165-168): no paused
  micro-batches (SS:133-135), one batch in flight (BS:78-84).
- The stop rule after a recompute: Sarathi-Serve counts max_tokens from the reset
  (sequence.py:181-182, 195), so a preempted request generates more than its output
  length; here a request stops at its trace's output length.
- Dynamic chunking (`enable_dynamic_chunking_schedule`, off by default, CF:249-251).
- Where Sarathi-Serve would never schedule again, the policy goes on: with nothing running,
  a head request that fits the free cache but not the watermark is admitted, and a decode
  that preempted itself alone is re-admitted (Sarathi-Serve's engine skips the sequence
  manager after an empty schedule, engine/base_llm_engine.py:381-382, so it is never reset).
- Decodes are capped by the loop's `scheduler.max_num_batched_tokens` (Sarathi never caps
  them, SS:157); a chunk left negative by more decodes than `chunk` counts as empty (Sarathi
  would schedule a negative chunk, SS:91-94).
- Ties in arrival are broken by request id (Sarathi's stable sort keeps the previous
  running order).
- The prompt-length check (BS:124-132) is the loop's rejection at arrival (prompt + output
  against max_model_len and the whole cache).
- Prefix caching: Sarathi-Serve has none (the preset turns it off). If it is turned on, a
  hit shortens a prefill, and admission still charges the whole known sequence's blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

from testbed.core.bounds import bounded
from testbed.policies._passes import arrival_order
from testbed.core.plan import RECOMPUTE, Plan
from testbed.core.policy import BasePolicy, PolicyKnobs, register


@dataclass
class SarathiKnobs(PolicyKnobs):
    name: str = "sarathi"
    # chunk_size: tokens a step's prefills may fill, decodes included (CF:246-248)
    token_budget: int = bounded(512, ge=1)
    # share of KV blocks an admission must leave free, rounded down (BM:57, 66, 82)
    watermark: float = bounded(0.01, ge=0, lt=1)


@register
class SarathiPolicy(BasePolicy):
    name = "sarathi"
    Knobs = SarathiKnobs

    def __init__(self, knobs=None):
        super().__init__(knobs)
        self._prefill_end: dict[int, int] = {}  # recomputing request id -> known length to reach
        self._victims: dict[int, int] = {}
        self._victims_step = -1

    def _in_prefill(self, s) -> bool:
        end = self._prefill_end.get(s.req.id)
        if end is None:
            return s.is_prefill
        if s.num_computed < end:
            return True
        del self._prefill_end[s.req.id]
        return False

    def on_finish(self, state, view) -> None:
        self._prefill_end.pop(state.req.id, None)

    def is_steady(self, view) -> bool:
        # The loop may repeat this all-decode step until the first finish; Sarathi would
        # preempt in any of those steps that starts a decode with no block free (BM:94-96),
        # so say steady only when that run cannot use the free blocks up.
        if view.waiting or not view.running:
            return False
        k = min(s.req.output_len - s.num_generated for s in view.running)
        return sum(view.blocks_needed(s, k) for s in view.running) < view.free_blocks

    def schedule(self, view) -> Plan:
        # this step's victims, when the loop asks again after a preempt-only plan:
        # id -> the chunk Sarathi's admission reads for it (0 for a decode, see below)
        victims = self._victims if self._victims_step == view.steps_done else {}
        self._victims = {}
        plan = Plan()
        chunk = min(self.knobs.token_budget, view.token_budget)
        rest = sorted(view.running, key=arrival_order)  # SS:124
        prefill = {s.req.id: self._in_prefill(s) for s in rest}
        # Sarathi's free blocks: partial prefills hold their whole prompt from admission
        free = view.free_blocks - sum(view.blocks_needed(s, s.remaining) for s in rest if prefill[s.req.id])
        tokens = 0
        kept = 0  # requests that stay running (SS's `running`), for the max_num_seqs check
        set_aside = []
        rest.reverse()  # pop() takes the oldest; victims come from index 0 (the newest)
        while rest:
            s = rest.pop()  # SS:131
            if prefill[s.req.id]:
                set_aside.append(s)  # SS:137-139
                continue
            if tokens >= view.token_budget:  # the loop's hard cap, not Sarathi's: stays running, unscheduled
                kept += 1
                continue
            while free <= 0:  # not can_append_slot (BM:94-96)
                victim = rest.pop(0) if rest else s  # SS:142-152
                plan.preempt_request(victim, RECOMPUTE)
                free += view.reclaimable_blocks(victim)
                # a partial prefill gives back its whole prompt; admission will read what
                # its prompt had left, a decode's reads 0 (see the module docstring)
                self._victims[victim.req.id] = victim.remaining if prefill[victim.req.id] else 0
                if prefill[victim.req.id]:
                    free += view.blocks_needed(victim, victim.remaining)
                if victim is s:
                    break
            else:
                plan.schedule(s, 1)  # SS:155-160
                free -= view.blocks_needed(s, 1)
                tokens += 1
                kept += 1
        if plan.preempt:
            # Preempt first, alone: the loop applies it and asks again at once, and that
            # second pass, finding the blocks freed, schedules what this one would have
            # (no further victim) and admits as Sarathi-Serve does after preempting.
            self._victims_step = view.steps_done
            plan.items.clear()
            return plan
        for s in set_aside:  # SS:165-187
            kept += 1
            n = min(s.remaining, chunk - tokens)
            if n > 0:
                plan.schedule(s, n)
                tokens += n
        bs = view.block_size
        wm = int(self.knobs.watermark * view.num_blocks)  # BM:66
        for s in view.waiting:  # SS:196-235 (this step's victims first: BS:122)
            need = -(-s.known_len // bs)  # BM:79, 87 with vllm_block_space_manager.py:12-13
            if free - need < wm and (kept or need > free):  # BM:82; see "not modelled"
                break
            if kept >= view.max_num_seqs:  # SS:216-217
                break
            left = victims.get(s.req.id)
            if left is None or not (left or kept):  # not a victim; or Sarathi would hang (see above)
                left = view.num_new_tokens(s)
            n = min(left, chunk - tokens)  # SS:91-94
            if n <= 0:  # SS:224-225
                break
            plan.schedule(s, n)  # SS:227-235
            free -= need
            tokens += n
            kept += 1
            if s.num_generated:
                self._prefill_end[s.req.id] = s.known_len
        return plan

