"""The cyclic GC around a run: paused, then what the run made promoted to the oldest generation without
a pass (testbed/core/event_run.py gc_paused), and the vllm_bench.json text whichever way result_json
takes (speed-ups of results writing, issue 27)."""
import gc
import json
import math
import weakref

from testbed.app.analysis.vllm_bench_format import result_json
from testbed.core.event_run import gc_paused


class _Node:
    pass


def test_gc_paused_promotes_what_it_made_and_still_frees_its_cycles():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        made = [[] for _ in range(100)]
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a cycle only the GC frees
        gone = weakref.ref(a)
    assert gc.isenabled()
    assert any(o is made for o in gc.get_objects(generation=2))  # no pass promoted it: the splice did
    assert not gc.get_freeze_count()  # nothing left frozen, which no pass would ever free
    del a, b
    gc.collect()
    assert gone() is None


def test_gc_paused_nested_leaves_the_outer_pause_alone():
    with gc_paused():
        with gc_paused():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def _walked(result: dict) -> str:  # the walk result_json falls back to: NaN as null, everywhere
    def clean(x):
        if isinstance(x, float) and math.isnan(x):
            return None
        return [clean(v) for v in x] if isinstance(x, list) else x
    return json.dumps({k: clean(v) for k, v in result.items()})


def test_result_json_is_the_same_text_with_and_without_nan_or_infinity():
    base = {"ttfts": [0.1, 2.5e-05], "itls": [[], [0.25, 1e-7]], "label": "x", "request_goodput": None}
    for extra in ({}, {"duration": math.nan}, {"itls": [[math.nan, 0.5]]}, {"burstiness": math.inf},
                  {"ttfts": [-math.inf]}):
        result = {**base, **extra}
        assert result_json(result) == _walked(result)
    assert "NaN" not in result_json({"a": [math.nan]}) and json.loads(result_json({"a": [math.nan]})) == {"a": [None]}
