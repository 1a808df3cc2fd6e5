"""The trace section of a run (`testbed.app.run.build_requests`): what a config selects, what
the run is told about the rows it did not serve, and how it fails when nothing is left."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from testbed.app.config import TraceConfig
from testbed.app.run import build_requests

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def trace_cfg(path, **kw):
    return OmegaConf.structured(TraceConfig(name="t", path=str(path), **kw))


def azure_rows(seconds, prompt=10):
    return "".join(f"2023-11-16 18:00:{s:09.6f},{prompt},5\n" for s in seconds)


# ----------------------------------------------------------------------------- nothing to simulate

def test_header_only_file_says_there_is_nothing_to_simulate(tmp_path):
    f = tmp_path / "empty.csv"
    f.write_text(HEADER)
    with pytest.raises(ValueError, match=r"nothing to simulate: .*empty\.csv has no data rows"):
        build_requests(trace_cfg(f), 0)


def test_a_window_after_the_last_arrival_names_the_keys(tmp_path):
    f = tmp_path / "short.csv"
    f.write_text(HEADER + azure_rows([0, 1, 2.5]))
    with pytest.raises(ValueError, match=r"nothing to simulate: trace\.start_s=100.* selects none of the 3 "
                                         r"requests of .*short\.csv.*arrive from 0 to 2\.5 s"):
        build_requests(trace_cfg(f, start_s=100.0), 0)
    with pytest.raises(ValueError, match=r"trace\.start_s=1\.5, trace\.end_s=2\.0 selects none"):
        build_requests(trace_cfg(f, start_s=1.5, end_s=2.0), 0)
    assert len(build_requests(trace_cfg(f, start_s=1.0), 0)[0]) == 2


def test_every_row_rejected_says_so(tmp_path):
    f = tmp_path / "bad.csv"
    f.write_text(HEADER + azure_rows([0, 1], prompt=0))
    with pytest.raises(ValueError, match=r"nothing to simulate: all 2 rows of .*bad\.csv were rejected "
                                         r"\(first: bad\.csv:2: field 'ContextTokens'"):
        build_requests(trace_cfg(f, lenient=True), 0)


# ----------------------------------------------------------------------------- the trace's name

def compose_trace(*overrides):
    from hydra import compose, initialize_config_dir

    from testbed.app.cli import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides)).trace


@pytest.mark.parametrize("overrides, name", [
    ((), "azure_conv"),
    (("trace=mooncake",), "mooncake"),
    (("trace=poisson",), "poisson"),
    (("trace.kind=file", "trace.format=csv", "trace.path=/data/my_trace.csv"), "my_trace"),
    (("trace.path=runs/day1.csv.gz",), "day1"),
    (("trace=mooncake", "trace.path=other.jsonl"), "other"),
    (("trace=poisson", "trace.kind=file", "trace.path=x/y.parquet"), "y"),
    (("trace.path=/data/my_trace.csv", "trace.name=mine"), "mine"),
])
def test_a_users_file_is_named_after_its_stem(overrides, name):
    """A file of one's own keeps no bundled trace's name: the summary, the table title and
    the output folder all read trace.name."""
    assert compose_trace(*overrides).name == name
