"""Speed work must not move a result: every configuration of `testbed.app.analysis.fingerprint.identity_configs`,
cut to 300 requests, gives the summary, per-request and per-step hashes recorded before the issue-15
speed work (tests/data/bit_identity_300.json: commit cfdf3f3, the simulator before that work, with one
change, the ITL mean and std summed over the sorted gaps, decided once in testbed/app/analysis/metrics.py `_stats`). A change that is meant to move a
result re-records the file and says why in its commit. The whole traces: experiments/benchmarks/bit_identity.py."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from testbed.app.entry.cli import CONF_DIR
from testbed.app.analysis.fingerprint import coalesced_steps, identity_configs, result_hashes
from testbed.app.assembly.run import simulate

REFERENCE = json.loads((Path(__file__).parent / "data" / "bit_identity_300.json").read_text())
_WORKDIR = tempfile.TemporaryDirectory(prefix="bit_identity_")  # the sessions trace, for the module's life
CONFIGS = identity_configs(_WORKDIR.name, 300)


def test_every_configuration_has_a_reference():
    assert sorted(CONFIGS) == sorted(REFERENCE)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_results_are_bit_identical_to_the_reference(name):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["logger=none", "output.progress=false", *CONFIGS[name]])
    r = simulate(cfg)
    assert result_hashes(r.summary, r.requests, r.steps) == REFERENCE[name]


def test_coalescing_merges_only_back_to_back_identical_decode_steps():
    import pandas as pd

    rows = [  # replica, start, duration, prefill, decode, running, waiting, kv, preempt, steps
        (0, 0.0, 1.0, 0, 2, 2, 0, 10, 0, 1), (0, 1.0, 2.0, 0, 2, 2, 0, 11, 0, 2),  # merged
        (0, 3.0, 1.0, 5, 2, 2, 0, 12, 0, 1),  # a prefill: its own row
        (0, 4.0, 1.0, 0, 2, 2, 0, 12, 0, 1), (0, 6.0, 1.0, 0, 2, 2, 0, 13, 0, 1),  # a gap: two rows
        (1, 7.0, 1.0, 0, 2, 2, 0, 13, 0, 1)]  # another replica
    cols = ["replica", "start", "duration", "prefill_tokens", "decode_tokens", "running", "waiting",
            "kv_used_blocks", "preemptions", "steps"]
    out = coalesced_steps(pd.DataFrame(rows, columns=cols))
    assert out["steps"].tolist() == [3, 1, 1, 1, 1]
    assert out["end"].tolist() == [3.0, 4.0, 5.0, 7.0, 8.0]
    assert out["kv_used_blocks"].tolist() == [10, 12, 12, 13, 13]
