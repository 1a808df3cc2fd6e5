"""`load_trace`: a trace format's name, as the ``trace`` config group gives it, to its loader.

A module of its own so that the loaders it picks from (`testbed.traces.loaders` for the fixed and
column-mapped schemas, `testbed.traces.formats` for the published ones, `testbed.traces.qwen_bailian` for
sessions) can build on `loaders` without `loaders` importing them back.
"""
from __future__ import annotations

import os
from typing import Mapping

from testbed.traces import formats
from testbed.traces.loaders import (FIELDS, FIXED_FORMATS, FORMATS, NAMED_FORMATS, TABLE_FORMATS, TraceLoad, load_azure,
                                    load_mooncake, load_table)
from testbed.traces.qwen_bailian import load_qwen_bailian


def load_trace(path: str | os.PathLike, format: str, *, columns: Mapping[str, str] | None = None,
               time_unit: str = "s", lenient: bool = False, start_s: float | None = None,
               end_s: float | None = None, max_requests: int | None = None,
               row_filter: Mapping[str, str] | None = None, lengths_only: bool = False) -> TraceLoad:
    """Load by a format name, as the ``trace`` config group says: ``azure``, ``mooncake``,
    ``qwen_bailian`` (fixed schemas; their columns may also come in a ``.parquet`` file), ``csv``, ``jsonl``
    or ``parquet`` (through `columns` and `time_unit`), or a published format of
    `testbed.traces.formats` (``azure_2024``, ``azure_multimodal_2025``, ``burstgpt``;
    ``vidur`` only with `lengths_only`). Any of them may be gzip or zstd compressed (``.gz``,
    ``.zst``, ``.zstd``).

    `start_s`, `end_s`, `max_requests`: the selection the caller will make (trace.start_s,
    end_s, max_requests); a streaming loader (azure_2024, azure_multimodal_2025) reads only
    what it needs for it, the others ignore it (the caller's transforms select). `row_filter`:
    BurstGPT's Model / Log Type values to keep.
    """
    if row_filter and format != "burstgpt":
        raise ValueError(f"trace.row_filter applies to trace.format=burstgpt only (got format={format})")
    if format in NAMED_FORMATS or format in FIXED_FORMATS:  # schemas fixed by their publishers
        if columns:
            raise ValueError(f"trace.format={format}: trace.columns applies to {', '.join(TABLE_FORMATS)} only "
                             f"(the {format} schema is fixed)")
        if time_unit != "s":
            raise ValueError(f"trace.format={format}: trace.time_unit applies to {', '.join(TABLE_FORMATS)} only "
                             f"(the {format} schema fixes its time unit)")
    if format in NAMED_FORMATS:
        if format == "vidur":
            if not lengths_only:
                raise ValueError("trace.format=vidur has lengths but no arrival times: use it as "
                                 "trace.lengths_from with trace.lengths_format=vidur and trace.kind=poisson or gamma")
            return formats.load_vidur_lengths(path)
        if format == "burstgpt":
            return formats.load_burstgpt(path, lenient=lenient, row_filter=row_filter)
        return formats.load_azure_2024(path, lenient=lenient, start_s=start_s, end_s=end_s, max_requests=max_requests,
                                     multimodal=format == "azure_multimodal_2025")
    if format in FIXED_FORMATS:
        if format == "qwen_bailian":
            return load_qwen_bailian(path, lenient=lenient)
        return (load_azure if format == "azure" else load_mooncake)(path, lenient=lenient)
    if format in TABLE_FORMATS:
        if not columns:
            raise ValueError(f"trace.format={format}: give trace.columns, a mapping of arrival, prompt_len and "
                             f"output_len (and optionally {', '.join(FIELDS[3:])}) to the file's column names")
        return load_table(path, columns=columns, time_unit=time_unit, format=format, lenient=lenient)
    raise ValueError(f"trace.format={format!r}: expected one of {', '.join(FORMATS)}")
