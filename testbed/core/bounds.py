"""The valid range of every numeric config key, declared on the dataclass field that holds it.

A knob written `max_num_seqs: int = bounded(256, ge=1)` carries its range as field metadata
(an `annotated_types.Interval`, the vocabulary pydantic and friends read), so that one
function can range-check a whole config at start (`testbed.app.assembly.validate`), a dataclass can
check its own instance (`check_ranges`), and a test can list every numeric key and whether
it declares a range. `None` is always allowed where the field's type allows it: there it
means "auto" or "off", as the field's comment says. List values are checked item by item.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from annotated_types import Interval

_UNSET: Any = dataclasses.MISSING


def bounded(default: Any = _UNSET, *, gt=None, ge=None, lt=None, le=None, factory: Any = _UNSET,
            **metadata) -> Any:
    """A dataclass field whose value (or each item, for a list) lies in the given interval."""
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={"bounds": Interval(gt=gt, ge=ge, lt=lt, le=le), **metadata})


def bounds_of(f: dataclasses.Field) -> Interval | None:
    return f.metadata.get("bounds")


def describe(iv: Interval) -> str:
    """'>= 1', '> 0 and <= 1', ..."""
    parts = [f"{op} {v:g}" for op, v in ((">", iv.gt), (">=", iv.ge), ("<", iv.lt), ("<=", iv.le)) if v is not None]
    return " and ".join(parts)


def range_problem(key: str, value: Any, iv: Interval | None) -> str | None:
    """'key=value: must be ...' when the value (or an item of it) is outside the interval, else None."""
    if iv is None or value is None:
        return None
    for v in value if isinstance(value, (list, tuple)) else (value,):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if ((iv.gt is not None and not v > iv.gt) or (iv.ge is not None and not v >= iv.ge)
                or (iv.lt is not None and not v < iv.lt) or (iv.le is not None and not v <= iv.le)
                or v != v):  # NaN is in no range
            return f"{key}={value}: must be {describe(iv)}"
    return None


def check_ranges(obj: Any, prefix: str) -> None:
    """Raise ValueError naming every field of the dataclass instance `obj` outside its declared range."""
    problems = [p for f in dataclasses.fields(obj)
                if (p := range_problem(f"{prefix}.{f.name}", getattr(obj, f.name), bounds_of(f)))]
    if problems:
        raise ValueError("; ".join(problems))
