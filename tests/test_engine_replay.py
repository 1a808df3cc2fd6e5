"""The engine's real-time replay driver, with a fake runner and a fake clock (no model)."""
from __future__ import annotations

import pytest

from conftest import make_loop, make_requests
from testbed.engine.prompts import PromptTokens
from testbed.engine.replay import EngineReplay
from testbed.app.analysis.metrics import request_table
from testbed.policies import make_policy
from testbed.core.request import Request


class FakeClock:
    def __init__(self):
        self.t = 100.0
        self.slept = []

    def __call__(self):
        return self.t

    def sleep(self, dt):
        self.slept.append(dt)
        self.t += dt


class FakeRunner:
    """Each step takes 10 ms of fake time; the next token is always 7."""

    def __init__(self, clock, interrupt_at=None):
        self.clock, self.steps, self.interrupt_at = clock, 0, interrupt_at

    def execute(self, items, token_ids):
        self.steps += 1
        if self.steps == self.interrupt_at:
            raise KeyboardInterrupt
        self.clock.t += 0.01
        return {s.req.id: 7 for s, n in items if s.num_computed + n == len(token_ids[s.req.id])}


def replay(reqs, interrupt_at=None):
    clock = FakeClock()
    runner = FakeRunner(clock, interrupt_at)
    loop = make_loop(make_policy("vllm"))
    r = EngineReplay(reqs, loop, runner, PromptTokens(100), clock=clock, sleep=clock.sleep)
    return r, r.run(), clock


def test_replay_follows_the_trace_clock():
    reqs = make_requests([(0, 8, 3), (0.5, 4, 2)])
    r, out, clock = replay(reqs)
    table = request_table([(0, s) for s in out.loops[0].states], out.not_arrived)
    assert list(table.outcome) == ["finished", "finished"]
    assert table.ttft_ms.tolist() == pytest.approx([10.0, 10.0])
    # it slept once, until the second arrival, and never while work was waiting
    assert len(clock.slept) == 1 and abs(clock.slept[0] - (0.5 - 0.03)) < 1e-9
    assert r.generated == {0: [7, 7, 7], 1: [7, 7]}
    assert len(r.step_wall) == 5


def test_ctrl_c_keeps_finished_results():
    reqs = make_requests([(0, 4, 1), (0, 4, 5), (5.0, 4, 2)])
    r, out, _ = replay(reqs, interrupt_at=3)
    assert out.interrupted
    table = request_table([(0, s) for s in out.loops[0].states], out.not_arrived, (), "interrupted before it arrived")
    assert list(table.outcome) == ["finished", "unfinished", "unfinished"]
    assert table.reason.tolist()[1:] == ["interrupted", "interrupted before it arrived"]


def test_prompt_tokens_share_prefixes():
    pt = PromptTokens(1000, seed=3)
    a = pt(Request(0, 0.0, 1200, 1, prefix_hashes=(5, 6, 7)))
    b = pt(Request(1, 0.0, 1100, 1, prefix_hashes=(5, 6, 9)))
    c = pt(Request(2, 0.0, 300, 1))
    assert a[:1024] == b[:1024] and a[1024:1100] != b[1024:1100]
    assert len(a) == 1200 and len(b) == 1100 and len(c) == 300
    assert pt(Request(2, 0.0, 300, 1)) == c and all(16 <= t < 1000 for t in a + c)
