"""Closed-loop replay of multi-turn sessions: a turn arrives when its parent's answer is in, plus
the user's think time, instead of at its recorded timestamp (trace.session_replay=closed).

Why: a recorded timestamp carries the recording server's latency. Replayed open-loop on a slower
(or faster) system, a turn can arrive before its parent's answer exists, which no user can do,
and the session's load no longer reacts to the system under test. Closed-loop replay keeps the
sessions' causality: the simulator holds each turn until its parent finishes
(`Simulation._release_children`), then releases it after its think time:

* the trace's recorded `Request.think_time` when it has one (>= 0);
* else `trace.think_time_s` when set;
* else the trace's own gap between the parent's and the turn's timestamps (which includes the
  recording server's answer time: an upper bound of the user's pause).

A turn with no parent in the run (a session's first turn, or one whose parent a time window or
`max_requests` cut away) arrives at its timestamp, as in open-loop replay. A parent rejected at
arrival rejects its turns (reason ``parent-rejected``); one that never finishes (the horizon, a
stall, an interrupt) leaves them unfinished (reason ``parent-unfinished``), each naming the parent.
"""
from __future__ import annotations

from typing import Sequence

from testbed.core.request import Request

SESSION_REPLAYS = ("open", "closed")


class ClosedLoopSessions:
    """The turns held back until their parents finish, and when each is released."""

    def __init__(self, requests: Sequence[Request], think_time_s: float | None = None):
        if think_time_s is not None and not think_time_s >= 0:
            raise ValueError(f"trace.think_time_s={think_time_s!r}: must be >= 0 (or null: the trace's gaps)")
        present = {r.id: r for r in requests}
        self.think_time_s = think_time_s
        self.roots: list[Request] = []  # arrive at their timestamps
        self.children: dict[int, list[Request]] = {}  # parent id -> its turns not yet released
        for r in requests:
            if r.parent_id >= 0 and r.parent_id in present and r.parent_id != r.id:
                self.children.setdefault(r.parent_id, []).append(r)
            else:
                self.roots.append(r)
        self._parent_arrival = {pid: present[pid].arrival for pid in self.children}
        # no turn comes sooner after its parent's finish than this (the least think time of all turns held):
        # the simulator's bound on when a replica's step end can bring a turn anywhere
        self.min_think = min((self.think(c) for turns in self.children.values() for c in turns), default=0.0)

    def think(self, child: Request) -> float:
        if child.think_time >= 0:
            return child.think_time
        if self.think_time_s is not None:
            return self.think_time_s
        return max(0.0, child.arrival - self._parent_arrival[child.parent_id])

    def take(self, parent_id: int) -> list[Request]:
        """The turns of a parent (once: they are then no longer held)."""
        return self.children.pop(parent_id, [])
