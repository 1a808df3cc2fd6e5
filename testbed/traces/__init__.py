"""Request traces: trace files and generators in, immutable `Request` lists out.

Everything above this layer (the step loop, both backends, the metrics) consumes a plain
``list[Request]``; this package is the only place that knows file formats, so a new
trace source is a loader here and nothing else. Modules, one job each:

* `testbed.traces.readers`: containers (CSV, JSONL, Parquet; gzip/zstd) -> raw cells with
  the line (or row) each came from, through pyarrow where it can name the row.
* `testbed.traces.loaders`: Azure CSV, Mooncake JSONL, any CSV/JSONL/Parquet through a column
  mapping, with row-exact errors (strict) or an account of every rejected row (lenient);
  relative paths fall back to the bundled traces in ``traces/data/``.
* `testbed.traces.dispatch`: `load_trace`, a format's name to its loader.
* `testbed.traces.formats`: published formats by name (Azure 2024, streamed in bounded memory;
  Azure multimodal 2025; BurstGPT; Vidur's length-only sets).
* `testbed.traces.generators`: Poisson and Gamma arrivals with fixed or trace-sampled lengths.
* `testbed.traces.transforms`: rate scaling, time windows, first n, length caps, spreading
  coarse timestamps over their buckets, and which rejected rows a selection keeps.
* `testbed.traces.servegen`: workloads generated from ServeGen's per-client rate, burstiness
  and length distributions.
* `testbed.traces.errors`: `TraceError` (file, line, field) and `RejectedRow`.
"""
from testbed.traces.errors import RejectedRow, TraceError
from testbed.traces.generators import gamma, poisson
from testbed.traces.loaders import (DATA_DIR, FORMATS, TIME_UNITS, TraceLoad, bundled_path, bundled_traces, load_azure,
                            load_mooncake, load_table, resolve_path)
from testbed.traces.dispatch import load_trace
from testbed.traces import formats
from testbed.traces.formats import (load_azure_2024, load_azure_multimodal_2025, load_burstgpt, load_vidur_lengths,
                                    missing_path)
from testbed.traces.servegen import read_servegen, resolve_servegen_path, servegen
from testbed.traces.transforms import (SPREAD_MODES, cap_lengths, detect_bucket_s, first_n, rejected_in_selection,
                                       scale_rate, spread_arrivals, time_window)

__all__ = ["RejectedRow", "TraceError", "gamma", "poisson", "DATA_DIR", "FORMATS", "TIME_UNITS", "TraceLoad",
           "bundled_path", "bundled_traces", "load_azure", "load_mooncake", "load_table", "load_trace",
           "resolve_path", "cap_lengths", "first_n", "rejected_in_selection", "scale_rate", "time_window",
           "SPREAD_MODES", "detect_bucket_s", "spread_arrivals", "read_servegen", "resolve_servegen_path", "servegen",
           "formats", "load_azure_2024", "load_azure_multimodal_2025", "load_burstgpt", "load_vidur_lengths",
           "missing_path"]
