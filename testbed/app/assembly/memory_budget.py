"""What a simulation will hold in memory, estimated before it is built, and a run refused at start
when that cannot fit (issue 25: `backend.replicas=5000` took 21.7 GB for 200 requests and the OOM
killer ended it, after minutes and without a word on why).

The estimate is a sum of measured terms (`experiments/benchmarks/memory_estimate.py`, tracemalloc, which
counts the bytes the interpreter allocates; each constant is a slope between two sizes, so fixed costs
drop out; rounded up):

* `BYTES_PER_KV_BLOCK` = 75: one replica's `BlockManager` keeps, for every KV block of the device,
  its place in the free queue (at start a slot of a plain list, `_front`, since the free queue keeps its
  uncached blocks there: issue 27), its reference count and its cache tags (four list slots), allocated
  at start whether a block is ever used or not. Measured after that change by
  tests/test_memory_budget.py's tracemalloc count: 5,649,648 B for 3 replicas of Llama-3.1-8B's 26,197
  H100 blocks, 71.6 B a block once `BYTES_PER_REPLICA` is taken off (175 B with the OrderedDict
  queue before; the slope benchmark, experiments/benchmarks/memory_estimate.py, is still to re-run).
  This is where a many-replica run's memory goes: about 2 MB a replica at the default model and GPU.
* `BYTES_PER_REPLICA` = 6,400: the rest of a replica (its step loop, policy, simpy process, router
  state): a `Simulation` of 16-block replicas, 6,399 B a replica between 10 and 200 replicas.
* `BYTES_PER_REQUEST` = 4,100: a request through a whole run (its state, its row of the request table,
  its share of the step series and summary): the peak of `simulate` on the Azure conversation trace's
  first 250 and 2,000 requests, one replica, steps recorded: 4,042 B a request. Longer outputs record
  more steps; `output.record_token_times` adds every token's time, which this does not count.

The budget is what the machine can give: /proc/meminfo's MemAvailable, or less when this process's
cgroup has a limit (/sys/fs/cgroup/memory.max, less its memory.current); `backend.memory_budget_gb`
replaces it. The message names the key whose term is the largest, with the estimate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BYTES_PER_KV_BLOCK = 75
BYTES_PER_REPLICA = 6_400
BYTES_PER_REQUEST = 4_100
BUDGET_KEY = "backend.memory_budget_gb"


class MemoryBudgetError(ValueError):
    """The run's estimated memory exceeds the budget; the message names the key and the estimate."""


@dataclass(frozen=True)
class Term:
    """One part of the estimate: the key that sets it, its value, its bytes and what they are."""

    key: str
    value: Any
    bytes: float
    what: str


def replica_term(key: str, replicas: int, kv_blocks: int) -> Term:
    """`replicas` replicas of `kv_blocks` device KV blocks each."""
    per = kv_blocks * BYTES_PER_KV_BLOCK + BYTES_PER_REPLICA
    return Term(key, replicas, replicas * per, f"{replicas} replica{'s' * (replicas != 1)} x {kv_blocks} KV blocks ({_gb(per)} each)")


def request_term(key: str, value: Any, requests: float) -> Term:
    """About `requests` requests through the run."""
    return Term(key, value, requests * BYTES_PER_REQUEST, f"{requests:,.0f} requests")


def available_bytes() -> tuple[float, str]:
    """The memory this process can still take, and where that figure comes from."""
    found: list[tuple[float, str]] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024.0, "MemAvailable in /proc/meminfo"))
                break
    except (OSError, ValueError, IndexError):
        pass
    limit = _cgroup_room()
    if limit is not None:
        found.append(limit)
    return min(found) if found else (math.inf, "no /proc/meminfo: not checked")


def _cgroup_room() -> tuple[float, str] | None:
    """What this process's cgroup (v2) still allows: memory.max less memory.current, when it has a limit."""
    try:
        rel = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
    except (OSError, StopIteration, IndexError):
        return None
    for folder in (Path("/sys/fs/cgroup") / rel.strip().lstrip("/"), Path("/sys/fs/cgroup")):
        try:
            limit = (folder / "memory.max").read_text().strip()
            used = int((folder / "memory.current").read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max":
            return None
        return max(0.0, int(limit) - used), f"the cgroup's limit, {folder / 'memory.max'}, less its use"
    return None


def check_fits(terms: list[Term], budget_gb: float | None) -> float:
    """Raise MemoryBudgetError when the terms' sum exceeds the budget (`budget_gb`, else what the machine
    has: `available_bytes`), naming the largest term's key; returns the estimate in bytes."""
    total = sum(t.bytes for t in terms)
    if budget_gb is not None:
        room, source = budget_gb * 1e9, f"{BUDGET_KEY}={budget_gb:g}"
    else:
        room, source = available_bytes()
    if total <= room:
        return total
    top = max(terms, key=lambda t: t.bytes)
    parts = " + ".join(f"{t.what}: {_gb(t.bytes)}" for t in terms if t.bytes)
    raise MemoryBudgetError(
        f"{top.key}={top.value}: the run would hold about {_gb(total)} ({parts}), more than the {_gb(room)} "
        f"available ({source}); lower it, or set {BUDGET_KEY} if this machine can give more "
        f"(testbed/app/assembly/memory_budget.py says how the estimate is made)")


def _gb(n: float) -> str:
    return f"{n / 1e9:,.0f} GB" if n >= 1e11 else f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"
