"""The fitted cost model's terms beyond tokens and attention (testbed/sim/fitted_cost.py), on synthetic
profiles whose step times follow a known set of parameters: the fit must find each term where the grid
exercises it, price a step with it, and leave at zero a term the grid never exercises.

- c_mixed: a step with both decode rows and prefill chunks runs both attention paths (engine/attention.py);
  measured on the shipped CPU profile the fit puts it near 0.19 ms, and without it mixed rows came out a
  median 3.6% short in-sample (0.9% with it).
- h_pseq, h_ptok: the host work of a prefill step (arrival, admission, KV allocation, the prompt's token
  list), from the profile's host rows with a prompt admitted per step (`profile.host_prompts`).
"""
from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pandas as pd
import pytest

from testbed.core.cost import BatchShape
from testbed.sim.fitted_cost import ENGINE_TERMS, HOST_TERMS, ProfileCostModel

TRUE = dict(c0=1.4e-3, c_floor=0.0, c_tok=4.4e-6, c_pairs=1.6e-8, c_ctx_pairs=4e-9, c_pkv=1.2e-7, c_dkv=2.4e-7,
            c_pseq=3e-5, c_dseq=4e-6, c_mixed=1.9e-4)
HOST = dict(h0=9e-6, h_seq=1.2e-6, h_pseq=2.5e-5, h_ptok=3.5e-8)


def shape(chunks=(), b=0, ctx=0) -> BatchShape:
    toks = sum(c for c, _ in chunks)
    return BatchShape(num_prefill_tokens=toks, num_prefill_seqs=len(chunks),
                      prefill_attn_pairs=sum(c * (o + (c + 1) / 2) for c, o in chunks),
                      prefill_kv_tokens=sum(c + o for c, o in chunks), num_decode_seqs=b, decode_kv_tokens=b * (ctx + 1))


def truth(s: BatchShape, kind: str, engine=TRUE, host=HOST) -> float:
    if kind == "host":
        return (host["h0"] + host["h_seq"] * (s.num_prefill_seqs + s.num_decode_seqs)
                + host["h_pseq"] * s.num_prefill_seqs + host["h_ptok"] * s.num_prefill_tokens)
    t = (engine["c0"] + max(engine["c_floor"], engine["c_tok"] * (s.num_prefill_tokens + s.num_decode_seqs))
         + engine["c_pairs"] * s.prefill_attn_pairs + engine["c_pkv"] * s.prefill_kv_tokens
         + engine["c_dkv"] * s.decode_kv_tokens + engine["c_pseq"] * s.num_prefill_seqs
         + engine["c_dseq"] * s.num_decode_seqs)
    if s.prefill_kv_tokens > s.num_prefill_tokens:
        t += engine["c_ctx_pairs"] * s.num_prefill_tokens * s.prefill_kv_tokens / s.num_prefill_seqs
    if s.num_prefill_seqs and s.num_decode_seqs:
        t += engine["c_mixed"]
    return t


def profile(host_prompts=(16, 256, 1024), mixed=True, engine=TRUE, noise=0.01, seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    pts = [("prefill", shape([(c, o)])) for c in (8, 32, 128, 256, 512, 1024) for o in (0, 64, 512)]
    pts += [("prefill", shape([(c, 0)] * k)) for k in (2, 8) for c in (16, 128)]
    pts += [("decode", shape(b=b, ctx=L)) for b in (1, 4, 16, 64, 128) for L in (16, 128, 512, 2048)]
    if mixed:
        pts += [("mixed", shape([(c, 0)], b, L)) for c in (16, 256, 1024) for b in (4, 16, 64) for L in (64, 1024)]
    pts += [("host", shape(b=n, ctx=16)) for n in (1, 4, 16, 64, 256)]
    pts += [("host", shape([(c, 0)], n, 16)) for c in host_prompts for n in (1, 64)]
    for kind, s in pts:
        rows.append({"kind": kind, **asdict(s), "seconds": truth(s, kind, engine) * (1 + noise * rng.standard_normal())})
    return pd.DataFrame(rows)


def test_the_terms_are_recovered_from_a_profile_that_exercises_them():
    m = ProfileCostModel.from_frame(profile())
    assert set(m.params) == set(ENGINE_TERMS) | set(HOST_TERMS)
    assert m.params["c_mixed"] == pytest.approx(TRUE["c_mixed"], rel=0.3)
    assert m.params["h_pseq"] == pytest.approx(HOST["h_pseq"], rel=0.2)
    assert m.params["h_ptok"] == pytest.approx(HOST["h_ptok"], rel=0.5)
    assert m.holdout["median_ape"] < 0.03


def test_a_mixed_step_costs_both_paths_and_a_prefill_step_its_host_work():
    m = ProfileCostModel.from_frame(profile(noise=0.0))
    prefill, decode = shape([(256, 0)]), shape(b=4, ctx=300)
    both = shape([(256, 0)], 4, 300)
    # the engine part of a mixed step exceeds prefill + decode - c0 (one step's fixed cost) by the second path
    extra = m.engine_time(both) - (m.engine_time(prefill) + m.engine_time(decode) - m.params["c0"])
    assert extra == pytest.approx(TRUE["c_mixed"], rel=0.3)
    # a prefill's host share: admission and per-token work over the decode rows' per-sequence cost
    host_extra = m.host_time(both) - m.host_time(decode)
    assert host_extra == pytest.approx(HOST["h_seq"] + HOST["h_pseq"] + 256 * HOST["h_ptok"], rel=0.2)
    for s in (prefill, decode, both):
        assert m.step_time(s) == pytest.approx(truth(s, "engine") + truth(s, "host"), rel=0.05)


def test_a_term_the_grid_never_exercises_stays_zero():
    """An older profile (no host rows with a prompt, no mixed rows): those parameters are not free to take
    an arbitrary value that would then price shapes the profile never measured."""
    m = ProfileCostModel.from_frame(profile(host_prompts=(), mixed=False))
    assert m.params["h_pseq"] == 0.0 and m.params["h_ptok"] == 0.0 and m.params["c_mixed"] == 0.0
    assert m.host_time(shape([(1024, 0)], 4, 100)) == pytest.approx(m.host_time(shape(b=5, ctx=100)), rel=1e-9)


def test_without_the_mixed_term_the_mixed_steps_would_come_out_short(monkeypatch):
    """The evidence the term answers: on a profile whose mixed steps pay a second path, the fit without it
    (the form before it: its column all zeros, so the parameter stays 0) under-predicts them."""
    from testbed.sim import fitted_cost as fc

    df = profile(noise=0.0)
    mixed = df[df.kind == "mixed"]
    full = ProfileCostModel.from_frame(df)
    features = fc._features

    def without_mixed(d):
        f = features(d)
        f["mixed"] = np.zeros_like(f["mixed"])
        return f

    monkeypatch.setattr(fc, "_features", without_mixed)
    old = fc._fit_all(df, {})
    monkeypatch.setattr(fc, "_features", features)
    f = fc._features(mixed)
    y = mixed.seconds.to_numpy()
    assert old.engine[ENGINE_TERMS.index("c_mixed")] == 0.0
    assert np.median(fc._engine_pred(old.engine, f) / y - 1) < -0.02
    assert abs(np.median(fc._engine_pred(full.fit.engine, f) / y - 1)) < 0.01
