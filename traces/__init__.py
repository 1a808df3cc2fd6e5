"""Request traces: loaders for real trace files, synthetic generators, and transforms."""
from traces.errors import RejectedRow, TraceError
from traces.generators import gamma, poisson
from traces.loaders import (DATA_DIR, TraceLoad, bundled_traces, load_azure, load_mooncake, load_table,
                            load_trace, resolve_path)
from traces.transforms import cap_lengths, first_n, scale_rate, time_window

__all__ = ["RejectedRow", "TraceError", "gamma", "poisson", "DATA_DIR", "TraceLoad", "bundled_traces", "load_azure",
           "load_mooncake", "load_table", "load_trace", "resolve_path", "cap_lengths", "first_n", "scale_rate",
           "time_window"]
