"""A registry of named, knob-configured classes: the policies and the routers each keep one.

A class registers itself by name (a decorator); the application builds one from its name and
its knob values, checked against the class's `Knobs` dataclass, so a typo'd name or knob fails
naming what exists. The core holds the registries; the packages that fill them (testbed.policies,
testbed.routers, plugins) are imported by the application.
"""
from __future__ import annotations

from dataclasses import fields


class Registry:
    def __init__(self, kind: str, package: str):
        self.kind, self.package = kind, package  # "policy", "testbed.policies"
        self._table: dict[str, type] = {}

    def register(self, cls: type) -> type:
        """Class decorator: make `cls` selectable as `<kind>=<cls.name>`."""
        if cls.name in self._table and self._table[cls.name] is not cls:
            raise ValueError(f"{self.kind} name {cls.name!r} is registered twice "
                             f"({self._table[cls.name].__qualname__}, {cls.__qualname__})")
        self._table[cls.name] = cls
        return cls

    def registered(self) -> dict[str, type]:
        """The classes registered so far."""
        return dict(self._table)

    def make(self, name: str, **knobs):
        """Build a registered class from its name and knob values (unknown knobs are an error)."""
        table = self._table
        if name not in table:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(table)) or 'none'}"
                           + ("" if table else f" (import {self.package} to register the bundled ones)"))
        cls = table[name]
        allowed = {f.name for f in fields(cls.Knobs)}
        unknown = set(knobs) - allowed
        if unknown:
            raise TypeError(f"{self.kind} {name!r} has no knob(s) {sorted(unknown)}; its knobs: "
                            f"{sorted(allowed - {'name'})}")
        return cls(cls.Knobs(**{**knobs, "name": name}))
