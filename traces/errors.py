"""Errors that say exactly which row of which file is wrong, and why."""
from __future__ import annotations

from dataclasses import dataclass


class TraceError(ValueError):
    def __init__(self, file: str, line: int, field: str, reason: str):
        self.file, self.line, self.field, self.reason = file, line, field, reason
        super().__init__(f"{file}:{line}: field {field!r}: {reason}")


@dataclass(frozen=True)
class RejectedRow:
    """A row that lenient loading set aside, kept so the run can account for it."""

    id: int
    file: str
    line: int
    field: str
    reason: str
