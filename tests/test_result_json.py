"""vllm_bench.json's text whichever way result_json takes: json's own scan for NaN and infinity, or the
walk that writes NaN as null (a speed-up of results writing, issue 27)."""
import json
import math

from testbed.app.analysis.vllm_bench_format import result_json


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
