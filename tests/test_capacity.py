"""Bisection for the maximum load under an SLO."""
from __future__ import annotations

import pytest

from testbed.app.analysis.capacity import bisect_max_scale


@pytest.mark.parametrize("threshold", [0.3, 1.7, 5.0])
def test_bisection_finds_a_known_threshold(threshold):
    # attainment falls linearly from 1 and crosses 0.9 exactly at `threshold`
    res = bisect_max_scale(lambda x: 1.0 - 0.1 * x / threshold, 0.9, lo=0.25, hi=8.0, rel_tol=0.01)
    assert res.bracketed and res.best_scale <= threshold < res.best_scale * 1.01
    assert all((a >= 0.9) == (x <= threshold) for x, a in res.curve)


def test_bisection_reports_unbracketed_and_hopeless_cases():
    assert bisect_max_scale(lambda x: 1.0, 0.9).bracketed is False
    hopeless = bisect_max_scale(lambda x: 0.0, 0.9)
    assert hopeless.best_scale is None and len(hopeless.curve) == 2
    with pytest.raises(ValueError, match="lo < hi"):
        bisect_max_scale(lambda x: 1.0, 0.9, lo=2, hi=1)


def test_bisection_on_the_simulator():
    """Real runs: the capacity of vLLM on 200 Azure conv requests under the interactive SLO (8 runs to bracket it)."""
    from hydra import compose, initialize_config_dir

    from testbed.app.entry.cli import CONF_DIR
    from testbed.app.assembly.run import simulate

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        def attainment(scale):
            cfg = compose("config", overrides=["trace.max_requests=200", f"trace.rate_scale={scale}",
                                               "slo=mlperf_llama3_8b_interactive", "scheduler.max_num_seqs=32"])
            return simulate(cfg).summary["slo_attainment"]

        res = bisect_max_scale(attainment, 0.9, lo=0.5, hi=64, rel_tol=0.1)
    assert res.bracketed and res.best_scale is not None
    best = res.best_scale
    tried = dict(res.curve)
    assert tried[best] >= 0.9
    assert any(a < 0.9 for x, a in tried.items() if best < x <= best * 1.1 + 1e-9)  # the bracket's failing end
