"""Errors that say exactly which row of which file is wrong, and why.

A trace is data someone else wrote; when a row is bad the user must be able to open the
file at that line and see the problem. So every error carries the file, the line number
(1-based, as an editor shows it: a CSV header is line 1) and the field (the column or
JSON key as the file spells it), and lenient loading keeps the same facts per rejected
row so the run can account for every row it did not serve.
"""
from __future__ import annotations

from dataclasses import dataclass


class TraceError(ValueError):
    """A trace row (or the file's header / column mapping) the loader cannot accept.

    `field` is the file's own column or key name; row-level problems (a line that is not
    JSON, a CSV line with too many fields) use the pseudo-field ``"<row>"``.
    """

    def __init__(self, file: str, line: int, field: str, reason: str):
        self.file, self.line, self.field, self.reason = str(file), int(line), str(field), str(reason)
        super().__init__(f"{self.file}:{self.line}: field {self.field!r}: {self.reason}")

    def __reduce__(self):  # survives pickling (parallel sweep launchers re-raise in the parent)
        return (type(self), (self.file, self.line, self.field, self.reason))


@dataclass(frozen=True, slots=True)
class RejectedRow:
    """A data row that lenient loading set aside, kept so the run can account for it.

    `id` is the request id the row would have had (ids are data-row indices, so the ids
    of the kept requests do not shift when a row is rejected); `file` is the file name,
    as in `Request.source`. `arrival` is the row's time in seconds since the first arrival,
    as a request's, when its time is known (parsed, in order, representable), else None:
    a time window uses it to tell whether the row lies inside.
    """

    id: int
    file: str
    line: int
    field: str
    reason: str
    arrival: float | None = None

    @property
    def source(self) -> str:
        return f"{self.file}:{self.line}"

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: field {self.field!r}: {self.reason}"
