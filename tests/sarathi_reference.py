"""A reference model of Sarathi-Serve's scheduler, on its own terms, for the policy's tests.

microsoft/sarathi-serve at commit 96f9911 ships no scheduler tests, so the tests of the
`sarathi` policy check it two ways: against hand-derived per-step decisions, and against this
model, which keeps Sarathi-Serve's own state rather than the testbed's: a sequence's prompt
token count, its outputs since the last recompute, its prompt-stage progress, a block table
allocated whole at admission, one free-block count and the `waiting` list with preempted
sequences inserted at its head. It is our own restatement of the rules (cited as file:line,
paths under sarathi/), not a copy:

  SS = core/scheduler/sarathi_scheduler.py   BS = core/scheduler/base_scheduler.py
  BM = core/block_space_manager/base_block_space_manager.py (+ vllm_block_space_manager.py:12-13)
  SQ = core/datatypes/sequence.py            SM = core/sequence_manager/base_sequence_manager.py

Where the policy differs on purpose, so does the model:
- A request stops after `max_tokens` tokens in all (Sarathi-Serve counts from its last
  recompute, SQ:181-182, 195), as the testbed's requests do.
- Preempted sequences are reset for recompute at the end of every `schedule`, also when
  it scheduled nothing (Sarathi-Serve's engine then skips the sequence manager,
  engine/base_llm_engine.py:381-382, and would never schedule again).
- The watermark while nothing runs: where Sarathi-Serve would wait forever for a request
  that fits the cache but not the watermark, the policy admits it; the model would wait
  (its tests never build that case; a dedicated test checks the policy alone).
Also: no pipeline parallelism (every running sequence is paused between steps, SS:133-135),
no dynamic chunking, arrival ties broken by id (as the policy).
"""
from __future__ import annotations

import random


class RefSeq:
    def __init__(self, rid: int, arrival: float, prompt_len: int, max_tokens: int):
        self.id, self.arrival, self.max_tokens = rid, arrival, max_tokens
        self.prompt = prompt_len  # len(prompt_token_ids) (SQ:38), grows on recompute (SQ:181)
        self.out = 0  # len(output_token_ids) since the last recompute (SQ:40, 182)
        self.generated = 0  # tokens sampled in all (the stop rule, see above)
        self.stage = 0  # prompt_tokens_stage_processed (SQ:42)
        self.reset_pending = False  # preempted in this step: reset_for_recompute runs after scheduling

    def length(self) -> int:  # get_len (SQ:120-121)
        return self.prompt + self.out

    def stage_done(self) -> bool:  # prompt_stage_processing_finished (SQ:105-106)
        return self.stage == self.prompt


class RefSarathi:
    def __init__(self, num_blocks: int, block_size: int, chunk_size: int = 512, max_num_seqs: int = 128,
                 watermark: float = 0.01):
        self.bs, self.chunk, self.max_num_seqs = block_size, chunk_size, max_num_seqs
        self.free = num_blocks  # BlockAllocator free list length (BM:27-30)
        self.watermark_blocks = int(watermark * num_blocks)  # BM:66
        self.tables: dict[int, int] = {}  # seq id -> blocks held (BM:69)
        self.waiting: list[RefSeq] = []
        self.running: list[RefSeq] = []
        self.quirk_steps: list[int] = []  # steps where a partial-prefill victim was re-admitted at once
        self.step_no = 0

    # --- block manager (BM) ---------------------------------------------------------------
    def _blocks(self, seq: RefSeq) -> int:  # len(logical_token_blocks) (vllm_block_space_manager.py:12-13)
        return -(-seq.length() // self.bs)

    def _can_allocate(self, seq: RefSeq) -> bool:  # BM:76-82
        return self.free - self._blocks(seq) >= self.watermark_blocks

    def _allocate(self, seq: RefSeq) -> None:  # BM:84-92
        need = self._blocks(seq)
        assert need <= self.free, "out of blocks"
        self.tables[seq.id] = need
        self.free -= need

    def _append_slot(self, seq: RefSeq) -> None:  # BM:98-107
        if self.tables[seq.id] < self._blocks(seq):
            assert self.free > 0
            self.tables[seq.id] += 1
            self.free -= 1

    def _free(self, seq: RefSeq) -> None:  # BM:117-123
        self.free += self.tables.pop(seq.id, 0)

    def _preempt(self, seq: RefSeq) -> None:  # BS:116-122
        self._free(seq)
        seq.reset_pending = True
        self.waiting.insert(0, seq)

    # --- scheduler ---------------------------------------------------------------------------
    def add(self, seq: RefSeq) -> None:  # BS:58-60
        self.waiting.append(seq)

    def _next_prefill(self, seq: RefSeq, batched: int) -> int:  # SS:74-96 (static chunking)
        return min(seq.prompt - seq.stage, self.chunk - batched)

    def schedule(self):
        """One `_schedule` (SS:98-246). Returns ({seq id: tokens}, [preempted ids])."""
        running, prefills, items, preempted = [], [], {}, []
        batched = 0
        self.running.sort(key=lambda s: (s.arrival, s.id))  # SS:124 (FCFS, core/policy.py:27-34)
        while self.running:  # SS:130-160
            seq = self.running.pop(0)
            if not seq.stage_done():
                prefills.append(seq)
                continue
            while self.free <= 0:  # not can_append_slot (BM:94-96)
                if self.running:
                    victim = self.running.pop(-1)
                    self._preempt(victim)
                    preempted.append(victim.id)
                else:
                    self._preempt(seq)
                    preempted.append(seq.id)
                    break
            else:
                self._append_slot(seq)
                running.append(seq)
                batched += 1
                items[seq.id] = 1
        for seq in prefills:  # SS:165-187
            n = self._next_prefill(seq, batched)
            running.append(seq)
            if n <= 0:
                continue
            batched += n
            items[seq.id] = n
        while self.waiting:  # SS:196-235
            seq = self.waiting[0]
            if not self._can_allocate(seq):
                break
            if len(running) >= self.max_num_seqs:
                break
            n = self._next_prefill(seq, batched)
            if n <= 0:
                break
            self.waiting.pop(0)
            if seq.reset_pending:  # a victim of this step, not yet reset: a partial prefill
                self.quirk_steps.append(self.step_no)  # (a decode's chunk reads 0 above)
            self._allocate(seq)
            batched += n
            items[seq.id] = n
            running.append(seq)
        for seq in self.waiting:  # SM:70-71 -> SQ:175-182, after the scheduler returns
            if seq.reset_pending:
                self._reset(seq)
        for seq in running:
            if seq.reset_pending:  # re-admitted in the step that preempted it
                self._reset(seq)
        self.running = running
        return items, preempted

    @staticmethod
    def _reset(seq: RefSeq) -> None:  # SQ:175-182
        seq.reset_pending = False
        seq.prompt += seq.out
        seq.out = 0
        seq.stage = 0

    def complete(self, items: dict[int, int]) -> list[int]:
        """The step ran: SM's on_step_completed (SM:112-143) and BS:93-101. Returns finished ids."""
        finished = []
        by_id = {s.id: s for s in self.running}
        for rid, n in items.items():
            seq = by_id[rid]
            if not seq.stage_done():
                seq.stage += n  # SQ:99-106
                if not seq.stage_done():
                    continue  # a partial chunk samples nothing (SM:100-101)
            seq.out += 1  # SQ:108-118
            seq.generated += 1
            if seq.generated == seq.max_tokens:
                finished.append(rid)
        for rid in finished:
            self._free(by_id[rid])
        self.running = [s for s in self.running if s.id not in finished]
        self.step_no += 1
        return finished


def random_scenario(seed):
    """One seeded draw of a small scenario under a tight cache (the policy's random test and the
    real-code referee's scenarios both use it): (requests as (arrival step, prompt, output),
    blocks, block size, chunk, max_num_seqs), or None when no drawn request fits the cache."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    nb = rng.choice([6, 8, 12, 16, 24, 100, 120])
    chunk = rng.choice([2, 3, 5, 8, 16, 512])
    reqs = sorted((rng.randint(0, 8), rng.randint(1, 40), rng.randint(1, 25)) for _ in range(rng.randint(1, 8)))
    reqs = [r for r in reqs if -(-(r[1] + r[2]) // bs) <= nb]
    if not reqs:
        return None
    return reqs, nb, bs, chunk, rng.choice([2, 4, 128])
