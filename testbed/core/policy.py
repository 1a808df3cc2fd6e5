"""The contract between the testbed and a batching policy, and the registry of policies.

A policy is a small object with one required method, `schedule(view) -> Plan`. It may
keep its own state (queues, counters) and update it from the `on_arrival` /
`on_finish` hooks. Its knobs are a dataclass, which doubles as the Hydra schema of
`testbed/conf/policy/<name>.yaml`, so a typo'd knob fails at config time, not mid-run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from testbed.core.bounds import check_ranges
from testbed.core.plan import Plan
from testbed.core.registry import Registry
from testbed.core.request import RequestState

if TYPE_CHECKING:
    from testbed.core.view import SchedulerView


@runtime_checkable
class Policy(Protocol):
    name: str

    def schedule(self, view: "SchedulerView") -> Plan: ...

    def on_arrival(self, state: RequestState, view: "SchedulerView") -> None: ...

    def on_finish(self, state: RequestState, view: "SchedulerView") -> None: ...


@dataclass
class PolicyKnobs:
    """Base of every policy's knob dataclass; `name` selects the policy."""

    name: str = "???"

    def __post_init__(self):
        check_ranges(self, "policy")  # every knob's declared range (`testbed.core.bounds`)


class BasePolicy:
    """Convenience base: no-op hooks, knobs kept as attributes."""

    name = "base"
    Knobs: type[PolicyKnobs] = PolicyKnobs

    def __init__(self, knobs: PolicyKnobs | None = None):
        self.knobs = knobs if knobs is not None else self.Knobs(name=self.name)

    def schedule(self, view: "SchedulerView") -> Plan:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_arrival(self, state: RequestState, view: "SchedulerView") -> None:
        pass

    def on_finish(self, state: RequestState, view: "SchedulerView") -> None:
        pass


_POLICIES = Registry("policy", "testbed.policies")


def register(cls: type) -> type:
    """Class decorator: make a policy selectable as `policy=<cls.name>`."""
    return _POLICIES.register(cls)


def registered() -> dict[str, type]:
    """The policies registered so far. The core loads none itself: importing `testbed.policies`
    registers the bundled ones, and the application also loads those of the `testbed.policies`
    entry point group (`testbed.app.assembly.plugins`)."""
    return _POLICIES.registered()


def make_policy(name: str, **knobs) -> Policy:
    """Build a registered policy from its name and knob values (unknown knobs are an error)."""
    return _POLICIES.make(name, **knobs)
