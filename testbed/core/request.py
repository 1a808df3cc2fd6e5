"""The request record every trace loader produces and every backend consumes.

A `Request` is what the trace says and never changes; everything that changes while a
request is served lives in `RequestState`, which only the step loop writes. Keeping the
two apart is what lets the simulator and the engine share one trace in memory and lets a
policy read progress without being able to corrupt it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Request:
    """One row of a trace.

    `prefix_hashes` are the trace's content ids for the leading prompt blocks of
    `prefix_block_tokens` tokens each (Mooncake's `hash_ids`, 512 tokens a block): two
    requests whose leading ids are equal share that prefix and can reuse its KV blocks.
    `source` names the file and line the request came from, for error messages.
    `session_id` groups the turns of one conversation ("" = none), for session-affine routing.
    `parent_id` is the id of the request whose prompt and answer this turn's prompt extends (-1:
    none), `think_time` the trace's recorded pause between the parent's answer and this turn (s;
    -1: not recorded): closed-loop replay (trace.session_replay=closed) releases a turn only once
    its parent finished plus that pause (testbed/sim/sessions.py). `hashes_span_output`: the
    `prefix_hashes` name the whole sequence, prompt then output (a parent whose answer a later turn
    reads back: testbed/traces/sessions.py), so its decoded blocks are cached under keys that
    later turn shares; otherwise they name prompt blocks only, and ids past the prompt are ignored.
    """

    id: int
    arrival: float  # seconds since the start of the trace
    prompt_len: int
    output_len: int
    prefix_hashes: tuple[int, ...] = ()
    prefix_block_tokens: int = 512
    tenant: str = "default"
    priority: int = 0
    slo_class: str = "default"
    source: str = ""
    session_id: str = ""
    parent_id: int = -1
    think_time: float = -1.0
    hashes_span_output: bool = False

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


class Status(enum.Enum):
    WAITING = "waiting"  # arrived, holds no KV (never started, or preempted by recompute)
    RUNNING = "running"  # holds KV on the device
    SWAPPED = "swapped"  # preempted by swap: its KV sits in host memory
    FINISHED = "finished"
    REJECTED = "rejected"


class Outcome(enum.Enum):
    FINISHED = "finished"
    REJECTED = "rejected"
    UNFINISHED = "unfinished"


@dataclass(slots=True, eq=False)
class RequestState:
    """The loop's record of one request's progress; policies read it, never write it.

    Token accounting follows vLLM V1: `num_computed` tokens of the request's known
    sequence (prompt plus tokens generated so far) have KV in the cache. A step that
    brings `num_computed` up to the known length samples one new token. Preemption by
    recompute resets `num_computed` and keeps the generated tokens, which are then
    recomputed with the prompt.
    """

    req: Request
    status: Status = Status.WAITING
    num_computed: int = 0
    num_generated: int = 0
    blocks: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks whose content is registered in the prefix cache
    swapped_blocks: int = 0
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens found in the prefix cache, summed over admissions
    first_scheduled: float = -1.0
    first_token_time: float = -1.0
    last_token_time: float = -1.0
    finish_time: float = -1.0
    reject_reason: str = ""
    token_times: list[float] | None = None  # filled only when per-token times are recorded
    _block_keys: tuple[int, ...] | None = None  # keys of its trace-prefix blocks, made on demand
    _past_blocks: list[list[int]] = field(default_factory=list)  # blocks it held before a preemption
    _own_from: int = 0  # its first block this life registered itself (after its prefix hit; testbed/core/kv.py)

    @property
    def id(self) -> int:
        return self.req.id

    @property
    def known_len(self) -> int:
        """Tokens whose identity is known: the prompt plus what was generated so far."""
        return self.req.prompt_len + self.num_generated

    @property
    def remaining(self) -> int:
        """Tokens that must still be computed before the next token can be sampled."""
        return self.req.prompt_len + self.num_generated - self.num_computed

    @property
    def is_prefill(self) -> bool:
        """True until the prompt (and any recomputed output) is in the cache."""
        return self.remaining > 1 or self.num_generated == 0

    @property
    def remaining_output(self) -> int:
        return self.req.output_len - self.num_generated
